"""``medha-runtime profile`` writes a loadable TableCostModel and reports the roofline error."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from medha_runtime.cli import build_parser, main
from medha_runtime.executor import InProcessExecutor
from medha_runtime.profile import calibrate_affine, synthetic_plan
from medha_runtime.runner import RunnerSpec
from medha_sched import AffineCostModel, ParallelDegrees, TableCostModel
from medha_sched.cost import BatchWork


def test_profile_quick_writes_a_table(tmp_path) -> None:
    out = tmp_path / "tiny.json"
    cmd = [sys.executable, "-m", "medha_runtime", "profile", "tiny", "--quick"]
    grid = ["--prefill-q", "1,16,64", "--prefill-kv", "0,512", "--decode-n", "2,8"]
    proc = subprocess.run(
        [*cmd, *grid, "--out", str(out), "--repeats", "2", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    table = TableCostModel.from_json(out)
    assert table.layout == ParallelDegrees()
    assert table.predict(BatchWork.single_group((64, 512))) > 0
    meta = json.loads(out.read_text())["meta"]
    assert meta["model"] == "tiny" and len(meta["measurements"]) == 3 * 2 + 2 * 1
    assert [m["requests"] for m in meta["measurements"]][-2:] == [2, 8]
    assert table.attention_q == (1, 16, 64) and table.per_request_s >= 0
    assert meta["roofline"]["mean_relative_error"] >= 0
    assert "roofline" in proc.stdout and "mean relative error" in proc.stdout
    assert f"wrote {out}" in proc.stdout


def test_cli_lists_only_working_subcommands(capsys) -> None:
    help_text = build_parser().format_help()
    assert "profile" in help_text and "serve" in help_text
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert sorted(sub.choices) == ["bench", "download", "profile", "serve"]
    with pytest.raises(SystemExit):
        main(["profile", "--tp", "0", "--out", "x.json"])
    assert "expected an integer >= 1" in capsys.readouterr().err


def test_download_help_names_the_cache_the_model_goes_to() -> None:
    """``download --help`` said "$MEDHA_CACHE_DIR, else ~/.cache/medha"; with
    ``XDG_CACHE_HOME`` set the file goes to ``$XDG_CACHE_HOME/medha`` (README, cache_dir)."""
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    text = " ".join(sub.choices["download"].format_help().split())
    assert "$MEDHA_CACHE_DIR, else $XDG_CACHE_HOME/medha, else ~/.cache/medha" in text


def test_serve_help_gives_the_in_process_thread_default() -> None:
    """``serve --help`` said --num-threads defaults to the node's cores divided by its
    ranks; one rank runs in the engine process with torch's own setting (README,
    ``EngineConfig.num_threads``), which follows OMP_NUM_THREADS and physical cores."""
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    text = " ".join(sub.choices["serve"].format_help().split())
    assert "with one rank, run in the engine process, torch's own setting" in text


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--prefill-q", "16,1"], "grid prefill_q must be strictly increasing integers >= 1"),
        (["--prefill-kv", "0"], "grid prefill_kv needs at least 2 values, got [0]"),
        (["--decode-n", "1,4"], "grid decode_n must be strictly increasing integers >= 2"),
    ],
)
def test_cli_rejects_a_bad_grid(tmp_path, capsys, flags, needle) -> None:
    assert main(["profile", "--out", str(tmp_path / "p.json"), *flags]) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_cli_grid_flags_need_integers(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["profile", "--out", "x.json", "--decode-kv", "1k"])
    assert "expected comma-separated integers, got '1k'" in capsys.readouterr().err


def test_cli_reports_a_bad_model_clearly(tmp_path, capsys) -> None:
    code = main(["profile", str(tmp_path / "missing"), "--quick", "--out", str(tmp_path / "p")])
    assert code == 1
    err = capsys.readouterr().err
    assert "error" in err and "missing" in err


def test_calibrate_affine_and_synthetic_plans() -> None:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        spec = RunnerSpec(
            model="tiny", dtype="float32", device="cpu", num_blocks=64, group_tokens=512
        )
        executor = InProcessExecutor(spec)
        cost = calibrate_affine(executor, ParallelDegrees(), vocab_size=259, repeats=1)
        assert isinstance(cost, AffineCostModel) and cost.base > 0
        assert cost.per_token >= 0 and cost.per_attn >= 0
        plan = synthetic_plan(-1, [(5, 16), (1, 0)], block_size=16, num_blocks=64, vocab_size=259)
        assert [c.start for c in plan.chunks] == [16, 0]
        assert plan.chunks[0].new_blocks == ((0, (0, 1)),)
        assert len(executor.execute(plan)) == 2
        assert len(executor.runner.tables) == 0  # synthetic requests are released
    finally:
        torch.set_num_threads(n)


class _FakeExecutor:
    """Times synthetic steps by a two-regime law (no model runs): attention
    pairs cost 100 ns, or 20 ns on chunks of at least 128 queries and 512K
    pairs, as the native kernel and torch's flash op do on a CPU."""

    def __init__(self, group_tokens: int) -> None:
        self.spec = RunnerSpec(
            model="tiny", num_blocks=group_tokens // 16, group_tokens=group_tokens
        )


def _two_regime(batch) -> float:
    secs = 1e-3
    for q, kv in batch:
        flash = q >= 128 and q * (kv + q) >= 1 << 19
        secs += 2e-5 * q + (20e-9 if flash else 100e-9) * q * (kv + q)
    return secs


@pytest.fixture
def fake_timing(monkeypatch):
    import medha_runtime.profile as profile

    timed = []

    def time_steps(executor, batches, *, vocab_size, repeats=3, warmup=1):
        timed.extend(batches)
        return [_two_regime(b) for b in batches]

    monkeypatch.setattr(profile, "time_steps", time_steps)
    return timed


@pytest.mark.parametrize(
    ("probes", "binding", "plain_misses"),
    [
        ({(32, 32736): 2.0, (2048, 0): 1.1}, (32, 32736), False),  # long context: the end chunk
        ({(32, 4064): 2.0, (2048, 0): 1.1}, (2048, 0), True),  # short context: the first chunk
    ],
)
def test_calibration_is_exact_at_the_probe_the_budget_comes_from(
    fake_timing, probes, binding, plain_misses
):
    plain = calibrate_affine(_FakeExecutor(32768), ParallelDegrees(), vocab_size=259)
    plain_steps = list(fake_timing)
    cost = calibrate_affine(_FakeExecutor(32768), ParallelDegrees(), vocab_size=259, probes=probes)
    probe_steps = [[p] for p in probes]
    # the generic steps, then each probe once, then again the ones under 0.5 s
    again = [[p] for p in probes if _two_regime([p]) < 0.5]
    assert fake_timing[len(plain_steps) :] == plain_steps + probe_steps + again
    true = _two_regime([binding])
    got = cost.predict(BatchWork.single_group(binding))
    assert got == pytest.approx(true, rel=5e-3)
    # the fit without probes prices a 2,048-token chunk as if on the native kernel
    miss = abs(plain.predict(BatchWork.single_group(binding)) - true) / true
    assert (miss > 1.0) if plain_misses else (miss < 1e-3)


def test_calibration_probes_are_cut_to_one_shard_and_checked(fake_timing):
    calibrate_affine(
        _FakeExecutor(1024),
        ParallelDegrees(),
        vocab_size=259,
        probes={(32, 5000): 2.0, (2048, 0): 1.1, (4096, 0): 1.5},
    )
    # cut to the shard, the two first chunks merged; all under 0.5 s: timed again
    assert fake_timing[-4:] == [[(32, 992)], [(1024, 0)]] * 2
    with pytest.raises(ValueError, match=r"got \(0, 5\): 2.0"):
        calibrate_affine(
            _FakeExecutor(1024), ParallelDegrees(), vocab_size=259, probes={(0, 5): 2.0}
        )


def test_a_slow_probe_is_timed_once(monkeypatch):
    import medha_runtime.profile as profile

    timed = []

    def time_steps(executor, batches, *, vocab_size, repeats=3, warmup=1):
        timed.append((list(batches), repeats, warmup))
        return [2.0 if b[0][0] >= 1024 else _two_regime(b) for b in batches]

    monkeypatch.setattr(profile, "time_steps", time_steps)
    probes = {(32, 4064): 2.0, (2048, 0): 1.1}
    calibrate_affine(_FakeExecutor(8192), ParallelDegrees(), vocab_size=259, probes=probes)
    # the generic steps (warmed up), both probes once, then the fast one twice more
    assert [t[1:] for t in timed] == [(3, 1), (1, 0), (2, 0)]
    assert timed[1][0] == [[(32, 4064)], [(2048, 0)]] and timed[2][0] == [[(32, 4064)]]


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--tp", "3"], "tp=3 must divide the model's 2 KV heads"),
        (["--spp", "99"], "spp=99 exceeds the model's 4 layers"),
        (["--hardware", "b200"], "unknown GPU preset 'b200'"),
    ],
)
def test_cli_refuses_what_cannot_run_before_measuring(tmp_path, capsys, flags, needle) -> None:
    """A layout the model cannot take, or a bad preset, is one line before any worker
    starts (tp=3 failed inside the workers with their tracebacks, spp=99 hung, a bad
    --hardware came after the whole grid was measured)."""
    out = tmp_path / "p.json"
    assert main(["profile", "tiny", "--quick", "--device", "cpu", "--out", str(out), *flags]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing measured: not even the "profiling ..." line
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in captured.err
    assert not out.exists()


def test_cli_refuses_cuda_without_a_gpu(tmp_path, capsys) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = tmp_path / "p.json"
    assert main(["profile", "tiny", "--quick", "--device", "cuda", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "0 are visible" in err and len(err.strip().splitlines()) == 1


def test_cli_out_is_checked_and_its_directory_made_before_measuring(tmp_path, capsys) -> None:
    assert main(["profile", "tiny", "--quick", "--out", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "is a directory" in captured.err
    out = tmp_path / "new" / "dir" / "p.json"
    grid = ["--prefill-q", "1,16", "--prefill-kv", "0,16", "--decode-n", "2", "--decode-kv", "16"]
    code = main(["profile", "tiny", "--device", "cpu", "--repeats", "1", *grid, "--out", str(out)])
    assert code == 0 and TableCostModel.from_json(out).attention_q == (1, 16)
