"""Multi-node serving on one machine: two "nodes" on 127.0.0.1 (``--tp 2 --nnodes 2``), and
torchrun (``--spp 2``: the sampling rank is not the driver).

Each answers greedy requests with the text the in-process ``LLM`` produces; an
idle pair outlives the ranks' wait bound (keepalives); a SIGTERM on node 0 ends
node 1 cleanly; a dead driver ends node 1 with an error; bad set-ups are
one-line errors.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from medha_runtime import LLM, SamplingParams
from tests.server.conftest import Server, free_port, start_server, stop_server

openai = pytest.importorskip("openai")

COST_SPEC = "affine:base=0.01,per_token=0.0001,per_attn=0"
#: flags every process of a run gets (start_server adds the same two limits)
LIMITS = ("--max-model-len", "256", "--kv-cache-tokens", "2048")
#: CPU ranks (gloo) on any machine: both "nodes" run here and would share its GPUs
COMMON = ("--cost-model", COST_SPEC, "--tp", "2", "--device", "cpu")
#: torchrun runs two pipeline stages: the sampling rank is rank 1, not the driver
TORCHRUN_LAYOUT = ("--cost-model", COST_SPEC, "--spp", "2", "--device", "cpu")
PROMPTS = ["hello", "The sky over the port was", "Medha shards the KV cache"]
MAX_TOKENS = 10
#: the ranks' bound on waiting for the driver (keepalives every quarter of it)
DIST_TIMEOUT_S = 5.0
#: how long node 1 may take to exit once the driver stopped or died
EXIT_BOUND_S = 20.0


@pytest.fixture(scope="module")
def reference() -> list[str]:
    """Greedy texts from one process (same cost model, hence the same schedule)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(
        "tiny", max_model_len=256, kv_cache_tokens=2048, cost_model=COST_SPEC, device="cpu"
    ) as llm:
        return [o.outputs[0].text for o in llm.generate(PROMPTS, params)]


def greedy(url: str, prompt: str, *, stream: bool = False) -> str:
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=60, max_retries=0)
    kw = {"model": "tiny", "temperature": 0, "max_tokens": MAX_TOKENS}
    kw["extra_body"] = {"ignore_eos": True}
    if stream:
        return "".join(
            ch.choices[0].text for ch in c.completions.create(prompt=prompt, stream=True, **kw)
        )
    r = c.completions.create(prompt=prompt, **kw)
    assert r.usage.completion_tokens == MAX_TOKENS
    return r.choices[0].text


class Pair:
    """Node 0 (HTTP server and driver) and node 1 (a worker node) of one run."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.log = log
        node = ("--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(self.port))
        node += ("--dist-timeout", str(DIST_TIMEOUT_S))
        cmd = [sys.executable, "-m", "medha_runtime", "serve", "tiny", *LIMITS, *COMMON, *node]
        with log.open("wb") as err:  # node 1's stderr
            self.node1 = subprocess.Popen(
                [*cmd, "--node-rank", "1"], stderr=err, start_new_session=True
            )
        try:
            self.node0: Server = start_server(*COMMON, *node, "--node-rank", "0")
        except BaseException as exc:
            err = self.stderr()
            self.close()
            raise RuntimeError(f"the two nodes did not start: {exc}; node 1: {err}") from exc

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def close(self) -> None:
        if getattr(self, "node0", None) is not None:
            stop_server(self.node0)
        if self.node1.poll() is None:
            os.killpg(self.node1.pid, signal.SIGKILL)
            self.node1.wait(timeout=10)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    p = Pair(tmp_path_factory.mktemp("node1") / "stderr.log")
    try:
        yield p
    finally:
        p.close()


def test_two_nodes_answer_like_one_process(pair: Pair, reference: list[str]) -> None:
    for prompt, want in zip(PROMPTS, reference, strict=True):
        assert greedy(pair.node0.url, prompt) == want, prompt
    assert greedy(pair.node0.url, PROMPTS[0], stream=True) == reference[0]


def test_two_nodes_stay_up_while_idle(pair: Pair, reference: list[str]) -> None:
    time.sleep(DIST_TIMEOUT_S + 1.5)  # idle longer than node 1 may wait: keepalives keep it up
    assert httpx.get(f"{pair.node0.url}/health", timeout=10).status_code == 200
    assert pair.node1.poll() is None
    assert greedy(pair.node0.url, PROMPTS[1]) == reference[1]


def test_a_second_node_with_the_same_rank_is_refused(
    pair: Pair, reference: list[str], tmp_path: Path
) -> None:
    """A node started twice with --node-rank 1 (its rank is taken) exits 1 at once, saying
    so, instead of waiting silently; the running pair goes on serving."""
    node = ("--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(pair.port))
    cmd = [sys.executable, "-m", "medha_runtime", "serve", "tiny", *LIMITS, *COMMON, *node]
    log = tmp_path / "dup.log"
    with log.open("wb") as err:
        dup = subprocess.Popen([*cmd, "--node-rank", "1"], stderr=err, start_new_session=True)
    try:
        assert dup.wait(timeout=EXIT_BOUND_S + 20) == 1
        assert "rank 1 has joined already" in log.read_text(), log.read_text()
    finally:
        if dup.poll() is None:
            os.killpg(dup.pid, signal.SIGKILL)
            dup.wait(timeout=10)
    assert pair.node1.poll() is None
    assert greedy(pair.node0.url, PROMPTS[0]) == reference[0]


def test_sigterm_on_node0_ends_node1(pair: Pair) -> None:
    start = time.monotonic()
    stop_server(pair.node0)
    code = pair.node1.wait(timeout=EXIT_BOUND_S)
    assert code == 0, pair.stderr()
    assert time.monotonic() - start < EXIT_BOUND_S
    assert "the driver shut down" in pair.stderr()


@pytest.mark.slow
def test_a_dist_timeout_below_the_model_load_time_still_starts(
    smollm2_cache: Path, tmp_path: Path
) -> None:
    """--dist-timeout bounds waits once every rank has started; loading the model (smollm2
    takes longer than 2 s here) is start-up, bounded by the start bound: both nodes
    failed at start-up with gloo's 'Timed out waiting 2000ms'."""
    pytest.importorskip("gguf")
    env = {**os.environ, "MEDHA_CACHE_DIR": str(smollm2_cache)}
    port = free_port()
    node = ("--kvp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port")
    node += (str(port), "--dist-timeout", "2", "--device", "cpu", "--cost-model", COST_SPEC)
    cmd = [sys.executable, "-m", "medha_runtime", "serve", "smollm2", *LIMITS, *node]
    log = tmp_path / "node1.log"
    with log.open("wb") as err:
        node1 = subprocess.Popen(
            [*cmd, "--node-rank", "1"], stderr=err, start_new_session=True, env=env
        )
    try:
        node0 = start_server(*node, "--node-rank", "0", model="smollm2", env=env, timeout_s=240)
        try:
            c = openai.OpenAI(base_url=f"{node0.url}/v1", api_key="none", max_retries=0)
            r = c.completions.create(model="smollm2", prompt="Hello", max_tokens=4)
            assert r.usage.completion_tokens >= 1
        finally:
            stop_server(node0)
        assert node1.wait(timeout=EXIT_BOUND_S) == 0, log.read_text()
    finally:
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)
            node1.wait(timeout=10)


def engine_pid(server_pid: int) -> int:
    """The spawned engine process under the HTTP process."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if ppid == server_pid and b"spawn" in cmdline:
            return int(d.name)
    raise AssertionError("no engine process found")


def test_dead_driver_ends_node1_with_an_error(tmp_path: Path) -> None:
    p = Pair(tmp_path / "node1.log")
    try:
        os.kill(engine_pid(p.node0.proc.pid), signal.SIGKILL)
        code = p.node1.wait(timeout=EXIT_BOUND_S)
        assert code == 1
        err = p.stderr()
        assert "the driver or a peer rank is gone" in err and "exited with code 1" in err, err
        assert node0_noticed(p.node0), "node 0 neither reported the dead engine nor exited"
    finally:
        p.close()


#: node 0's flags, node 1's, and what both say: another world size, or another node count
MISMATCHES = [
    (
        ("--tp", "2", "--nnodes", "2"),
        ("--tp", "3", "--nnodes", "3"),
        ("a world of 3 ranks", "driver's world of 2 ranks"),
    ),
    (
        ("--tp", "2", "--spp", "2", "--nnodes", "2"),
        ("--tp", "2", "--spp", "2", "--nnodes", "4"),
        ("1 rank(s) per node", "driver's 2 per node"),
    ),
    (
        ("--tp", "2", "--nnodes", "2"),
        ("--tp", "2", "--nnodes", "2", "--model-on-node-1", "smollm2"),
        ("with MODEL 'smollm2'", "the driver serves 'tiny'"),
    ),
    (  # engine flags: node 1's were ignored without a word
        ("--tp", "2", "--nnodes", "2"),
        ("--tp", "2", "--nnodes", "2", "--max-model-len", "128", "--no-enable-prefix-caching"),
        (
            "--max-model-len 128 on this node, 256 on the driver",
            "--enable-prefix-caching off on this node, on on the driver",
            "give every node the same engine flags",
        ),
    ),
    (  # the same world size from another layout
        ("--tp", "2", "--nnodes", "2"),
        ("--spp", "2", "--nnodes", "2"),
        ("--tp 1 on this node, 2 on the driver", "--spp 2 on this node, 1 on the driver"),
    ),
]


@pytest.mark.parametrize(("flags0", "flags1", "says"), MISMATCHES)
def test_nodes_with_different_layouts_fail_at_once(
    flags0: tuple[str, ...], flags1: tuple[str, ...], says: tuple[str, ...], tmp_path: Path
) -> None:
    """Node 0 and node 1 disagree on the world size (2 ranks against --tp 3 --nnodes 3) or
    on the node count (--nnodes 2 against 4, one world of 4 ranks: node 1 claimed node 0's
    rank 1): both exit 1 within seconds, naming the two (they waited the whole start
    bound, 600 s, in silence). Or on MODEL or an engine flag (each named with both
    values): node 1 ran node 0's without a word."""
    port = free_port()
    node = ("--master-addr", "127.0.0.1", "--master-port", str(port))
    cmd = [sys.executable, "-m", "medha_runtime", "serve", "tiny", *LIMITS, "--device", "cpu"]
    logs = tmp_path / "node0.log", tmp_path / "node1.log"
    flags1 = list(flags1)
    if "--model-on-node-1" in flags1:  # node 1 was told another MODEL
        at = flags1.index("--model-on-node-1")
        cmd1 = [*cmd[:4], flags1[at + 1], *cmd[5:]]
        del flags1[at : at + 2]
    else:
        cmd1 = cmd
    argv = (
        [*cmd, *flags0, "--node-rank", "0", "--port", str(free_port())],
        [*cmd1, *flags1, "--node-rank", "1"],
    )
    procs = []
    try:
        for args, log in zip(argv, logs, strict=True):
            with log.open("wb") as err:
                procs.append(subprocess.Popen([*args, *node], stderr=err, start_new_session=True))
        for p, log in zip(procs, logs, strict=True):
            assert p.wait(timeout=60) == 1, log.read_text()
        for log in logs:
            err = log.read_text()
            assert all(text in err for text in says), err
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)


def node0_noticed(server: Server, within_s: float = 10.0) -> bool:
    """Whether the HTTP server answers 503 on /health, or exits non-zero, within ``within_s``."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        code = server.proc.poll()
        if code is not None:
            return code != 0
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 503:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return False


def session_alive(sid: int) -> list[int]:
    """Processes of session ``sid`` that are still running (not zombies)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[4]) == sid and fields[0] != "Z":
                out.append(int(d.name))
    return out


def test_torchrun_spp2(reference: list[str]) -> None:
    port, master = free_port(), free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1"]
    cmd += ["--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(master)]
    cmd += ["-m", "medha_runtime", "serve", "tiny", "--port", str(port), *LIMITS, *TORCHRUN_LAYOUT]
    cmd += ["--log-level", "warning"]
    proc = subprocess.Popen(cmd, start_new_session=True, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"torchrun exited with code {proc.returncode}"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        for prompt, want in zip(PROMPTS, reference, strict=True):
            assert greedy(url, prompt) == want, prompt
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=EXIT_BOUND_S)
        deadline = time.monotonic() + 10
        while session_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not session_alive(proc.pid), "torchrun left processes behind"
    finally:
        if proc.poll() is None or session_alive(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def test_torchrun_nodes_with_other_engine_flags_both_say_why(tmp_path: Path) -> None:
    """Two torchrun nodes (one rank each) whose --dtype differs: there was no check-in
    under torchrun, so rank 1 built its own bfloat16 model under rank 0's float32
    engine. Now both ranks exit at start-up, and each names the flag with both values."""
    master, port = free_port(), free_port()
    run = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
    run += ["--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(master)]
    serve = ["-m", "medha_runtime", "serve", "tiny", "--port", str(port), *LIMITS]
    serve += [*TORCHRUN_LAYOUT, "--log-level", "warning"]
    procs, logs = [], []
    try:
        for node, dtype in ((0, "float32"), (1, "bfloat16")):
            logs.append(tmp_path / f"node{node}.log")
            with logs[-1].open("wb") as err:
                cmd = [*run, "--node-rank", str(node), *serve, "--dtype", dtype]
                procs.append(subprocess.Popen(cmd, stdout=err, stderr=err, start_new_session=True))
        codes = [proc.wait(timeout=120) for proc in procs]
        texts = [log.read_text(errors="replace") for log in logs]
        assert all(code != 0 for code in codes), (codes, texts)
        want = "--dtype 'bfloat16' on this node, 'float32' on the driver"
        for text in texts:
            assert "rank 1 cannot join" in text and want in text, text
    finally:
        for proc in procs:
            if proc.poll() is None or session_alive(proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        for pid in serving_on(port):  # ranks torchrun started outside its session
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def serving_on(port: int) -> list[int]:
    """Processes whose command line holds ``--port PORT`` (this test's ranks)."""
    want = f"--port\0{port}\0".encode()
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                if want in (d / "cmdline").read_bytes():
                    out.append(int(d.name))
    return out


# ------------------------------------------------------------- bad set-ups
BAD_SETUPS = [
    (["--tp", "3", "--nnodes", "2"], {}, "tp*spp*kvp = 3 is not divisible by --nnodes 2"),
    (["--tp", "2", "--nnodes", "2", "--node-rank", "2"], {}, "--node-rank 2 must be below"),
    (["--node-rank", "1"], {}, "--node-rank 1 must be below --nnodes 1"),
    (
        ["--tp", "2"],
        {"WORLD_SIZE": "4", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
        "WORLD_SIZE=4 processes but tp*spp*kvp = 2*1*1 = 2",
    ),
    (["--tp", "2"], {"WORLD_SIZE": "2", "RANK": "1"}, "torchrun's environment is incomplete"),
    (
        ["--tp", "2", "--nnodes", "2"],
        {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
        "use torchrun's --nnodes",
    ),
]


@pytest.mark.parametrize(("argv", "env", "message"), BAD_SETUPS)
def test_bad_setups_are_clear_errors(
    argv: list[str], env: dict[str, str], message: str, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    from medha_runtime.cli import main

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["serve", "tiny", *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("medha-runtime serve: error:") and message in err, err


def test_a_master_address_that_does_not_resolve_is_refused_up_front() -> None:
    """Either node: one line at once (torch retried the lookup for the whole 600 s start
    bound, printing a warning each time)."""
    from medha_runtime.cli import _serve_role, build_parser

    for node in ("0", "1"):
        argv = ["serve", "tiny", "--tp", "2", "--nnodes", "2", "--node-rank", node]
        args = build_parser().parse_args([*argv, "--master-addr", "nosuchhost.invalid"])
        with pytest.raises(ValueError, match=r"--master-addr 'nosuchhost\.invalid' does not"):
            _serve_role(args, {})
        args = build_parser().parse_args([*argv, "--master-addr", "localhost"])
        assert _serve_role(args, {})[1].master_addr == "localhost"


def test_dist_timeout_help_says_what_it_bounds() -> None:
    """The flag does not bound joining (600 s): its help said "seconds a rank waits for the
    driver before giving up", and a node 1 started alone waited 600 s with --dist-timeout 10."""
    from medha_runtime.cli import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    (action,) = [a for a in serve._actions if "--dist-timeout" in a.option_strings]
    assert "once every rank has started" in action.help
    assert "start-up itself" in action.help and "up to 600 s" in action.help


def test_a_node_whose_driver_never_starts_says_so() -> None:
    """Node 1 alone: after the start bound its rank says it could not reach the driver,
    not that "the driver or a peer rank is gone" (it never came). Run in a fresh process:
    the rank is a forkserver child, and a forkserver another test started writes to that
    test's stderr."""
    port = free_port()
    code = (
        "import sys\n"
        "from medha_runtime.dist_config import DistConfig\n"
        "from medha_runtime.dist_worker import run_node\n"
        "if __name__ == '__main__':\n"
        f"    config = DistConfig(world_size=2, master_port={port}, start_timeout_s=2.0)\n"
        "    sys.exit(run_node(config, node_rank=1, ranks_per_node=1))\n"
    )
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert time.monotonic() - start < 60
    err = proc.stderr
    assert f"rank 1: cannot reach the driver at 127.0.0.1:{port} within 2 s" in err, err
    assert "is node 0 started" in err, err


@pytest.mark.parametrize("value", ["inf", "1e20", "1e10"])
def test_a_dist_timeout_torch_cannot_take_is_refused(value: str, capsys) -> None:
    """--dist-timeout inf (or 1e20) passed, then every node failed at start-up with
    OverflowError; 1e10 s made the store give up at once (nanoseconds overflow)."""
    from medha_runtime.cli import build_parser
    from medha_runtime.dist_config import DistConfig

    argv = ["serve", "tiny", "--tp", "2", "--nnodes", "2", "--dist-timeout", value]
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert "--dist-timeout: expected a finite number of seconds in (0, 1e+08]" in err, err
    for name in ("start_timeout_s", "control_timeout_s"):
        with pytest.raises(ValueError, match=f"{name} must be a finite number of seconds"):
            DistConfig(world_size=2, **{name: float(value)})
    assert DistConfig(world_size=2, start_timeout_s=1e8, control_timeout_s=1e8)


def test_dist_config_validates() -> None:
    from medha_runtime.dist_config import DistConfig

    with pytest.raises(ValueError, match="world_size must be an integer >= 2, got 1"):
        DistConfig(world_size=1)
    with pytest.raises(ValueError, match="local_ranks=3 exceeds world_size=2"):
        DistConfig(world_size=2, local_ranks=3)
    with pytest.raises(ValueError, match="keepalive_s=9 must be below control_timeout_s=5"):
        DistConfig(world_size=2, keepalive_s=9, control_timeout_s=5)
    with pytest.raises(ValueError, match="master_port must be at most 65535, got 70000"):
        DistConfig(world_size=2, master_port=70000)
    with pytest.raises(ValueError, match=r"engine_flags must be \(flag, value\) pairs"):
        DistConfig(world_size=2, engine_flags=(("--tp", 2),))  # type: ignore[arg-type]
    from medha_runtime.config import EngineConfig

    with pytest.raises(ValueError, match=r"world has 4 ranks but tp\*spp\*kvp = 2\*1\*1 = 2"):
        EngineConfig(tp=2, distributed=DistConfig(world_size=4))


def test_every_engine_flag_is_compared_at_check_in() -> None:
    """The flags a node sends to the check-in are the ones that build its engine config."""
    import dataclasses

    from medha_runtime.cli import ENGINE_FLAGS, _serve_role, build_parser
    from medha_runtime.config import EngineConfig

    fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "distributed"}
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    flags = {a.dest for a in serve._actions}
    assert set(ENGINE_FLAGS) == fields & flags, set(ENGINE_FLAGS) ^ (fields & flags)
    argv = ["serve", "tiny", "--tp", "2", "--nnodes", "2", "--node-rank", "1"]
    args = build_parser().parse_args([*argv, "--max-num-seqs", "8", "--chat-template", "{{ x }}"])
    sent = dict(_serve_role(args, {})[1].engine_flags)
    assert len(sent) == len(ENGINE_FLAGS) - 2  # all but the driver's own outputs
    assert "--step-log" not in sent and "--cost-model-out" not in sent
    assert sent["--max-batch-requests"] == "8" and sent["--tp"] == "2"
    assert sent["--chat-template"] == "'{{ x }}'" and sent["--max-model-len"] == "unset"
    assert sent["--enable-prefix-caching"] == "on" and sent["--cuda-graphs"] == "unset"


def test_driver_only_flags_are_not_compared_and_dtype_aliases_are_one() -> None:
    """A node 1 without node 0's --step-log (which only the driver writes) was refused,
    and so was --dtype bf16 against --dtype bfloat16 (one dtype)."""
    from medha_runtime.cli import _serve_role, build_parser
    from medha_runtime.dist_config import _flag_differences

    argv = ["serve", "tiny", "--tp", "2", "--nnodes", "2", "--node-rank"]
    driver = build_parser().parse_args([*argv, "0", "--dtype", "bf16", "--step-log", "s.jsonl"])
    node = build_parser().parse_args([*argv, "1", "--dtype", "bfloat16"])
    mine, theirs = (_serve_role(a, {})[1].engine_flags for a in (node, driver))
    assert dict(mine)["--dtype"] == "'bfloat16'"
    assert _flag_differences(mine, theirs) == ""
    other = build_parser().parse_args([*argv, "1", "--dtype", "fp16"])
    differ = _flag_differences(_serve_role(other, {})[1].engine_flags, theirs)
    assert differ == "--dtype 'float16' on this node, 'bfloat16' on the driver", differ


@pytest.mark.parametrize(
    "facts, says",
    [
        (None, "the driver runs another Medha version (an older one;"),
        ({"format": 3, "medha": "9.9"}, "the driver runs another Medha version (9.9;"),
        ({"format": 2, "medha": "0.0.1", "engine_flags": []}, "the driver runs Medha 0.0.1, "),
    ],
)
def test_a_driver_of_another_version_is_refused_by_name(facts: object, says: str) -> None:
    """A node reading a check-in of another layout died with a ValueError traceback
    (unpacking), and the driver then waited its whole start bound."""
    import datetime
    import json

    import torch.distributed as dist

    from medha_runtime.dist_config import (
        _FACTS,
        _REFUSED,
        _WORLD,
        DistConfig,
        JoinRefused,
        check_in,
    )

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=30))
    if facts is not None:  # what a driver of that version published
        store.set(_FACTS, json.dumps(facts))
    store.set(_WORLD, json.dumps([2, 1, None]))
    config = DistConfig(world_size=2, master_port=port, start_timeout_s=10.0)
    with pytest.raises(JoinRefused, match="give every node the same Medha version") as info:
        check_in(config, rank=1)
    assert says in str(info.value), str(info.value)
    assert store.get(_REFUSED).decode() == str(info.value)  # the driver hears it too


def test_the_driver_keeps_the_world_layout_earlier_nodes_read() -> None:
    """A node of the previous Medha unpacks ``[world, local_ranks, model]``: the driver
    still publishes that, and its version and flags under another key."""
    import datetime
    import json
    import threading

    import torch.distributed as dist

    from medha_runtime.dist_config import (
        _FACTS,
        _REFUSED,
        _WORLD,
        CHECK_IN_FORMAT,
        DistConfig,
        JoinRefused,
        check_in,
        medha_version,
    )

    port = free_port()
    flags = (("--tp", "2"),)
    config = DistConfig(
        world_size=2, master_port=port, start_timeout_s=20.0, model="tiny", engine_flags=flags
    )
    errors: list[BaseException] = []

    def driver() -> None:
        try:
            check_in(config, rank=0)
        except JoinRefused as exc:
            errors.append(exc)

    thread = threading.Thread(target=driver)
    thread.start()
    client = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=20))
    theirs, their_k, their_model = json.loads(client.get(_WORLD))  # as the old node reads
    assert (theirs, their_k, their_model) == (2, 1, "tiny")
    facts = json.loads(client.get(_FACTS))
    assert facts == {
        "format": CHECK_IN_FORMAT,
        "medha": medha_version(),
        "engine_flags": [list(f) for f in flags],
    }
    client.set(_REFUSED, "test over")
    thread.join(timeout=20)
    assert not thread.is_alive() and str(errors[0]) == "test over"
