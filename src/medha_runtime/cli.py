"""The ``medha-runtime`` command (also ``python -m medha_runtime``).

Subcommands:

- ``profile [MODEL] --out PROFILE.json``: time real forward passes on this
  device over a grid of prefill chunk sizes x KV lengths and decode batch
  sizes x KV lengths, write a ``TableCostModel`` profile (load it with
  ``TableCostModel.from_json`` or ``LLM(cost_model="table:PROFILE.json")``), and
  report how well the roofline model predicts the measurements.
- ``serve [MODEL]``: an OpenAI-compatible HTTP server (``/v1/completions``,
  ``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/metrics``,
  ``/tokenize``, ``/detokenize``); see :mod:`medha_runtime.server`. Several
  nodes: ``--nnodes N --node-rank R --master-addr A --master-port P`` on each
  (node 0 serves HTTP and drives), or under torchrun (rank 0 serves); see
  :mod:`medha_runtime.dist_executor`.
- ``download MODEL``: fetch ``smollm2`` (or a hub id) now, so that serving
  it later needs no network.

MODEL is a Hugging Face directory, a ``.gguf`` file, ``tiny``, ``smollm2``
or a hub id in the local cache (see :mod:`medha_runtime.model.names`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from medha_runtime.config import EngineConfig
    from medha_runtime.dist_config import DistConfig


MODEL_HELP = (
    "a Hugging Face model directory, a .gguf file, 'tiny' (default: random weights), "
    "'smollm2' (SmolLM2-135M-Instruct, fetched once), or a hub id in the local Hugging Face "
    "cache (e.g. meta-llama/Llama-3.2-1B-Instruct)"
)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="medha-runtime", description="Medha's model runtime: run and profile LLMs."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    p = sub.add_parser(
        "profile",
        help="measure iteration times and write a TableCostModel profile",
        description=(
            "Time forward passes on this device over a grid (prefill chunk size x KV length, "
            "decode batch size x KV length), write a TableCostModel JSON profile and report "
            "the roofline model's prediction error."
        ),
    )
    p.add_argument("model", nargs="?", default="tiny", help=MODEL_HELP)
    p.add_argument(
        "--out", required=True, metavar="PROFILE.json", help="where to write the profile"
    )
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda if any")
    p.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel degree")
    p.add_argument("--spp", type=_positive_int, default=1, help="pipeline stages")
    p.add_argument("--kvp", type=_positive_int, default=1, help="KV-parallel groups")
    p.add_argument("--block-size", type=_positive_int, default=16, help="KV block size")
    p.add_argument("--repeats", type=_positive_int, default=3, help="timed runs per point")
    p.add_argument("--quick", action="store_true", help="a small grid (seconds on a CPU)")
    for flag, what in (
        ("--prefill-q", "prefill chunk sizes"),
        ("--prefill-kv", "KV lengths before each prefill chunk"),
        ("--decode-n", "decode batch sizes"),
        ("--decode-kv", "KV lengths of the decode batches"),
    ):
        p.add_argument(
            flag,
            type=_int_list,
            default=None,
            metavar="N,N,...",
            help=f"{what} to measure (replaces the grid's)",
        )
    p.add_argument(
        "--hardware",
        default=None,
        help="roofline hardware preset (a100, h100, h200); default: measured on this device",
    )
    _add_serve(sub)
    d = sub.add_parser(
        "download",
        help="fetch a model ahead of time (smollm2, or a hub id into the Hugging Face cache)",
        description=(
            "Fetch MODEL now so that serving it later needs no network: 'smollm2' goes to "
            "the Medha cache ($MEDHA_CACHE_DIR, else $XDG_CACHE_HOME/medha, else "
            "~/.cache/medha), a hub id to the Hugging Face cache. Prints the local path."
        ),
    )
    d.add_argument("model", help="'smollm2' or a hub id such as HuggingFaceTB/SmolLM2-135M")
    from medha_runtime.bench.cli import add_bench_parser

    add_bench_parser(sub)
    return parser


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {value}")
    return value


def _wait_s(text: str) -> float:
    from medha_runtime.dist_config import MAX_WAIT_S

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value <= MAX_WAIT_S:
        raise argparse.ArgumentTypeError(
            f"expected a finite number of seconds in (0, {MAX_WAIT_S:g}], got {text!r}"
        )
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _port(text: str) -> int:
    value = _non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535, got {value}")
    return value


def _json_list(text: str) -> tuple[str, ...]:
    from medha_runtime.server.cors import json_str_list

    try:
        return json_str_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_serve(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    s = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible server",
        description=(
            "Serve MODEL over an OpenAI-compatible HTTP API. The model runs in a separate "
            "engine process (and its workers); the HTTP process talks to it over ZeroMQ."
        ),
    )
    s.add_argument("model", nargs="?", default="tiny", help=MODEL_HELP)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=_port, default=8000, help="port (default 8000)")
    s.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $MEDHA_API_KEY, if set)",
    )
    for flag, what in (
        ("--allowed-origins", "origins (e.g. '[\"https://app.example\"]')"),
        ("--allowed-methods", "HTTP methods"),
        ("--allowed-headers", "request headers"),
    ):
        s.add_argument(
            flag,
            type=_json_list,
            default=("*",),
            metavar="JSON_LIST",
            help=f'CORS: the {what} allowed cross-origin, a JSON list (default ["*"]: any)',
        )
    s.add_argument(
        "--allow-credentials",
        action="store_true",
        help="CORS: let browsers send credentials (cookies, Authorization) cross-origin",
    )
    s.add_argument("--served-model-name", default=None, help="model id in the API (default MODEL)")
    s.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    s.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda if any")
    s.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel degree")
    s.add_argument("--spp", type=_positive_int, default=1, help="pipeline stages")
    s.add_argument("--kvp", type=_positive_int, default=1, help="KV-parallel groups")
    from medha_sched import available_policies

    s.add_argument(
        "--policy",
        default="lars-mp",
        choices=list(available_policies()),
        help="scheduling policy, from medha_sched's policy registry (default lars-mp)",
    )
    s.add_argument(
        "--chunk-size",
        type=_non_negative_int,
        default=None,
        help="fixed prefill chunk (Sarathi-style FCFS baseline); 0: no chunking",
    )
    s.add_argument(
        "--target-batch-time",
        type=_positive_float,
        default=None,
        metavar="SEC",
        help="iteration-time budget in seconds (default: from the cost model)",
    )
    s.add_argument("--max-model-len", type=_positive_int, default=None, help="context limit")
    s.add_argument(
        "--kv-cache-tokens",
        type=_positive_int,
        default=None,
        help="KV pool per KVP group, in tokens (default: what device memory holds, at most "
        "twice the context per group or 16384; raise it to hold more requests at once)",
    )
    s.add_argument(
        "--max-batch-requests",
        "--max-num-seqs",
        type=_positive_int,
        default=None,
        metavar="N",
        help="most requests in one batch (vLLM's --max-num-seqs; default 512)",
    )
    s.add_argument(
        "--generation-config",
        default="auto",
        metavar="auto|vllm|DIR",
        help="default sampling parameters (temperature, top_p, top_k, min_p, "
        "repetition_penalty, max_new_tokens) for requests that leave them unset: 'auto' "
        "(default) the model directory's generation_config.json, 'vllm' none, or a "
        "directory holding one",
    )
    s.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_TEXT",
        help="chat template to use instead of the model's: a Jinja file, or the Jinja text "
        "itself (its escapes, such as \\n, read as vLLM reads them)",
    )
    s.add_argument(
        "--cost-model",
        default=None,
        help="cost model spec (e.g. table:PROFILE.json, or online:STATE.json to resume "
        "learning); default 'online': a quick profile at start-up, then learned from every step",
    )
    s.add_argument(
        "--cost-model-out",
        default=None,
        metavar="FILE",
        help="save the online cost model's state here on exit (load it with "
        "--cost-model online:FILE, or in medha-sim)",
    )
    s.add_argument(
        "--admission",
        choices=["accept", "reject"],
        default="accept",
        help="'reject': answer 429 (with the predicted TTFT and Retry-After) to a request "
        "whose ttft_slo_ms the current queue cannot meet; default 'accept'",
    )
    s.add_argument("--seed", type=_non_negative_int, default=0, help="engine seed")
    s.add_argument(
        "--num-threads",
        type=_positive_int,
        default=None,
        metavar="N",
        help=(
            "torch CPU threads per rank (default: the node's cores divided by its ranks; "
            "with one rank, run in the engine process, torch's own setting)"
        ),
    )
    s.add_argument("--block-size", type=_positive_int, default=16, help="tokens per KV block")
    s.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV of prompt prefixes computed before (default: on)",
    )
    s.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="form and ship the next batch while the model runs the current one "
        "(any tp and kvp; with spp > 1 once it cleared stage 0, the last stage "
        "sending its tokens to stage 0 through shared memory: one node, no torchrun; "
        "default: on with spp > 1 on one node, off otherwise)",
    )
    s.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="replay decode-only steps from CUDA graphs (one rank, Triton attention; "
        "default: on with a CUDA device and one rank)",
    )
    s.add_argument(
        "--step-log",
        default=None,
        metavar="PATH",
        help="write every batch's timings and work to this JSON-lines file",
    )
    s.add_argument(
        "--max-body-bytes",
        type=_positive_int,
        default=None,
        help="larger request bodies get a 413 before they are read (default 4 MiB)",
    )
    s.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="log level of the server's log and uvicorn's (default info)",
    )
    s.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="no access line per request",
    )
    for flag, kind, default, text in (
        (
            "--nnodes",
            _positive_int,
            1,
            "nodes the tp*spp*kvp ranks are spread over (an equal share each); node 0 serves "
            "HTTP and drives, every other node runs 'serve MODEL --node-rank R' with the same "
            "layout flags and --master-addr/--master-port",
        ),
        (
            "--node-rank",
            _non_negative_int,
            0,
            "this node's rank, 0 .. nnodes-1 (0: HTTP server and driver; R > 0: ranks "
            "R*k .. R*k+k-1 in the foreground until the driver shuts down)",
        ),
        ("--master-addr", str, "127.0.0.1", "node 0's address, reachable from every node"),
        ("--master-port", _positive_int, 29501, "a free port on node 0 for the rendezvous"),
        (
            "--dist-timeout",
            _wait_s,
            600.0,
            "multi-node/torchrun: once every rank has started, seconds a rank waits for the "
            "driver before giving up (a hung driver ends its workers after this; an idle "
            "driver sends keepalives; default 600); start-up itself (node 0 waiting for the "
            "other nodes, or they for node 0, then every rank loading the model) waits up "
            "to 600 s whatever this is",
        ),
    ):
        s.add_argument(flag, type=kind, default=default, help=text)


def _serve_preflight(args: argparse.Namespace) -> Any:
    """The HTTP server's socket, bound (and the device checked) before anything heavy
    imports: a port in use is one line within a second. None where this process
    serves no HTTP (a worker rank or a node R > 0)."""
    import os

    if _serve_role(args, os.environ)[0] != "server":
        return None
    from medha_runtime.server.startup import bind_socket, check_device, check_model_file

    check_device(args.device)
    check_model_file(args.model)
    return bind_socket(args.host, args.port)


def _serve(args: argparse.Namespace, sock: Any = None) -> int:
    import os

    from medha_runtime.server import EngineArgs, run_server
    from medha_runtime.server.cors import CorsConfig

    role = _serve_role(args, os.environ)
    if role[0] == "worker":  # torchrun, RANK > 0
        from medha_runtime.dist_worker import worker_main

        return worker_main(role[1], rank=role[2], local_rank=role[3], local_world=role[4])
    if role[0] == "node":  # --node-rank R > 0
        from medha_runtime.dist_worker import run_node

        return run_node(role[1], node_rank=args.node_rank, ranks_per_node=role[2])
    engine = EngineArgs(engine=engine_config(args, distributed=role[1]), admission=args.admission)
    run_server(
        engine,
        host=args.host,
        port=args.port,
        api_key=args.api_key or os.environ.get("MEDHA_API_KEY") or None,
        served_model_name=args.served_model_name,
        log_level=args.log_level,
        log_requests=not args.disable_log_requests,
        sock=sock,
        cors=CorsConfig(
            allowed_origins=args.allowed_origins,
            allowed_methods=args.allowed_methods,
            allowed_headers=args.allowed_headers,
            allow_credentials=args.allow_credentials,
        ),
        **({} if args.max_body_bytes is None else {"max_body_bytes": args.max_body_bytes}),
    )
    return 0


#: ``serve``'s flags that configure the engine besides MODEL (each sets the
#: ``EngineConfig`` field of its name); every node of a multi-node run must give the same
ENGINE_FLAGS = (
    "dtype", "tp", "spp", "kvp", "policy", "chunk_size", "target_batch_time",
    "max_model_len", "kv_cache_tokens", "max_batch_requests", "chat_template",
    "generation_config", "block_size", "seed", "cost_model", "cost_model_out", "device",
    "num_threads", "enable_prefix_caching", "step_log", "async_scheduling", "cuda_graphs",
)  # fmt: skip


def engine_config(args: argparse.Namespace, *, distributed: DistConfig | None) -> EngineConfig:
    """The :class:`~medha_runtime.config.EngineConfig` that ``serve``'s flags describe."""
    from medha_runtime.config import EngineConfig
    from medha_runtime.tokenizer import unescape_inline_chat_template

    kw = {name: getattr(args, name) for name in ENGINE_FLAGS}
    if kw["chat_template"] is not None:
        kw["chat_template"] = unescape_inline_chat_template(kw["chat_template"])
    return EngineConfig(model=args.model, distributed=distributed, **kw)


#: engine flags only the driver reads (its step log, where it saves the learned cost
#: model): the check-in does not compare them
DRIVER_ONLY_FLAGS = ("step_log", "cost_model_out")


def _engine_flags(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """``(--flag, value as text)`` for each of :data:`ENGINE_FLAGS` but the driver's own
    (:data:`DRIVER_ONLY_FLAGS`), for the check-in; a dtype by its canonical name
    (``bf16`` and ``bfloat16`` are one)."""
    from medha_runtime.config import canonical_dtype

    def text(name: str, value: Any) -> str:
        if value is None:
            return "unset"
        if isinstance(value, bool):
            return "on" if value else "off"
        if name == "dtype":
            value = canonical_dtype(value)
        return repr(value) if isinstance(value, str) else str(value)

    return tuple(
        ("--" + n.replace("_", "-"), text(n, getattr(args, n)))
        for n in ENGINE_FLAGS
        if n not in DRIVER_ONLY_FLAGS
    )


def _serve_role(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[Any, ...]:
    """What this process runs: ``("server", DistConfig | None)``, ``("node", config, k)``
    (a node R > 0 with k ranks) or ``("worker", config, rank, local_rank, local_world)``."""
    world = args.tp * args.spp * args.kvp
    if env.get("WORLD_SIZE", "1") not in ("", "1"):
        return _torchrun_role(args, env, world)
    nnodes, node = args.nnodes, args.node_rank
    if node >= nnodes:
        raise ValueError(f"--node-rank {node} must be below --nnodes {nnodes}")
    if nnodes == 1:
        return ("server", None)
    if world % nnodes:
        raise ValueError(
            f"the world size tp*spp*kvp = {world} is not divisible by --nnodes {nnodes}"
        )
    k = world // nnodes
    addr, port = args.master_addr, args.master_port
    _check_resolves(addr, port)
    config = _dist_config(args, world=world, addr=addr, port=port, local_ranks=k)
    return ("server", config) if node == 0 else ("node", config, k)


def _check_resolves(addr: str, port: int) -> None:
    """A ``ValueError`` unless ``--master-addr`` resolves (torch would retry the lookup,
    warning each time, for the whole start bound)."""
    import socket

    try:
        socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        why = getattr(exc, "strerror", None) or exc
        raise ValueError(f"--master-addr {addr!r} does not resolve: {why}") from None


def _dist_config(
    args: argparse.Namespace, *, world: int, addr: str, port: int, local_ranks: int, **kw: Any
) -> DistConfig:
    from medha_runtime.dist_config import DistConfig

    wait = args.dist_timeout
    return DistConfig(
        world_size=world,
        master_addr=addr,
        master_port=port,
        local_ranks=local_ranks,
        control_timeout_s=wait,
        keepalive_s=min(5.0, wait / 4),
        model=args.model,
        engine_flags=_engine_flags(args),
        **kw,
    )


def _torchrun_role(args: argparse.Namespace, env: Mapping[str, str], world: int) -> tuple[Any, ...]:
    if args.nnodes != 1 or args.node_rank != 0:
        raise ValueError("under torchrun use torchrun's --nnodes/--node-rank, not serve's")
    try:
        size, rank = int(env["WORLD_SIZE"]), int(env["RANK"])
        local, local_world = int(env.get("LOCAL_RANK", "0")), int(env.get("LOCAL_WORLD_SIZE", "1"))
        addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    except (KeyError, ValueError) as exc:
        raise ValueError(f"torchrun's environment is incomplete or malformed: {exc}") from None
    if size != world:
        raise ValueError(
            f"torchrun started WORLD_SIZE={size} processes but tp*spp*kvp = "
            f"{args.tp}*{args.spp}*{args.kvp} = {world}; they must be equal"
        )
    config = _dist_config(
        args, world=world, addr=addr, port=port, local_ranks=local_world, start_local=False
    )
    if rank == 0:
        return ("server", config)
    return ("worker", config, rank, local, local_world)


def _profile(args: argparse.Namespace) -> int:
    import dataclasses

    from medha_runtime.profile import FULL_GRID, QUICK_GRID, run_profile

    grid = QUICK_GRID if args.quick else FULL_GRID
    axes = ("prefill_q", "prefill_kv", "decode_n", "decode_kv")
    try:
        grid = dataclasses.replace(
            grid, **{a: getattr(args, a) for a in axes if getattr(args, a) is not None}
        )
    except ValueError as exc:
        print(f"medha-runtime profile: {exc}", file=sys.stderr)
        return 2
    _check_out(args.out)  # before minutes of measuring, not after
    result = run_profile(
        args.model,
        dtype=args.dtype,
        device=args.device,
        tp=args.tp,
        spp=args.spp,
        kvp=args.kvp,
        block_size=args.block_size,
        grid=grid,
        repeats=args.repeats,
        hardware=args.hardware,
        log=lambda line: print(line, flush=True),
    )
    result.write(args.out)
    table = result.table
    print(
        f"wrote {args.out}: TableCostModel with base {table.base_s * 1e3:.2f} ms, "
        f"{len(table.linear_tokens)} linear points, "
        f"{len(table.attention_q)}x{len(table.attention_kv)} attention grid"
    )
    print(result.summary())
    return 0


def _check_out(path: str) -> None:
    """Make ``--out``'s directory, or raise (one line) where the file cannot go."""
    from pathlib import Path

    out = Path(path)
    if out.is_dir():
        raise ValueError(f"--out {path} is a directory; give a file name")
    out.parent.mkdir(parents=True, exist_ok=True)


#: the third-party modules each command needs, and the extra that installs them
_MODEL_STACK = ("torch", "safetensors", "tokenizers", "jinja2")
_SERVER = ("fastapi", "uvicorn", "zmq", "prometheus_client", "httpx")
#: model names that are GGUF files (``medha_runtime.model.smollm2.PACKAGED_MODELS``,
#: which imports torch, so not imported here)
_GGUF_NAMES = ("smollm2",)
NEEDS: Mapping[str, tuple[str, ...]] = {
    "profile": _MODEL_STACK,
    "serve": _MODEL_STACK + _SERVER,
    "bench": ("httpx", "tqdm"),
}


def _require_found(modules: Sequence[str]) -> None:
    """Like ``require``, without importing them (the HTTP process must not import torch)."""
    import importlib.util

    from medha_sched.extras import MissingExtra

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtra(
            f"needs {', '.join(missing)}, which is not installed: pip install 'medha[runtime]'"
        )


def _is_gguf(model: str) -> bool:
    """Whether ``model`` names a GGUF file: a packaged name, a ``.gguf`` path, or a
    directory holding ``.gguf`` files and no ``config.json`` (as
    ``medha_runtime.model.names.resolve_model`` reads them)."""
    from pathlib import Path

    if model in _GGUF_NAMES or model.lower().endswith(".gguf"):
        return True
    path = Path(model)
    return path.is_dir() and not (path / "config.json").exists() and any(path.glob("*.gguf"))


def check_extras(args: argparse.Namespace) -> None:
    """Raise ``MissingExtra`` (one line naming the extra) before a command starts work."""
    from medha_sched.extras import require

    needs = NEEDS.get(args.command, ())
    if args.command == "serve":  # the model stack loads in the engine process only
        _require_found(_MODEL_STACK)
        needs = _SERVER
    require(needs, extra="runtime")
    # GGUF files are read with the gguf package (in the engine process for serve,
    # seconds after the server started); it imports no torch, so check it here
    model = getattr(args, "model", None)
    if args.command in ("serve", "profile") and isinstance(model, str) and _is_gguf(model):
        require(("gguf",), extra="gguf", what=f"the GGUF model {model}")
    if getattr(args, "plot", None):
        require(("matplotlib",), extra="sim", what="--plot")


def _download(args: argparse.Namespace) -> int:
    from medha_runtime.model.names import resolve_model

    if args.model == "tiny":
        print("tiny is built in: nothing to download", file=sys.stderr)
        return 0
    print(resolve_model(args.model).path)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2: bad usage or a missing extra)."""
    from medha_sched.extras import MissingExtra

    args = build_parser().parse_args(argv)
    sock = None
    if args.command == "serve":
        try:
            sock = _serve_preflight(args)
        except (ValueError, OSError) as exc:
            print(f"medha-runtime serve: error: {exc}", file=sys.stderr)
            return 1
    try:
        check_extras(args)
    except MissingExtra as exc:
        print(f"medha-runtime {args.command}: error: {exc}", file=sys.stderr)
        return 2
    try:
        if args.command == "profile":
            return _profile(args)
        if args.command == "serve":
            return _serve(args, sock)
        if args.command == "download":
            return _download(args)
        if args.command == "bench":
            from medha_runtime.bench.cli import run_bench

            return run_bench(args)
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"medha-runtime {args.command}: error: {exc}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
