"""The ``medha-runtime`` command (also ``python -m medha_runtime``).

Subcommands:

- ``profile [MODEL] --out PROFILE.json``: time real forward passes on this
  device over a grid of prefill chunk sizes x KV lengths and decode batch
  sizes x KV lengths, write a ``TableCostModel`` profile (load it with
  ``TableCostModel.from_json`` or ``LLM(cost_model="table:PROFILE.json")``), and
  report how well the roofline model predicts the measurements.
- ``serve [MODEL]``: an OpenAI-compatible HTTP server (``/v1/completions``,
  ``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/metrics``,
  ``/tokenize``, ``/detokenize``); see :mod:`medha_runtime.server`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


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
    p.add_argument("model", nargs="?", default="tiny", help="model directory, or 'tiny' (default)")
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
    p.add_argument(
        "--hardware",
        default=None,
        help="roofline hardware preset (a100, h100, h200); default: measured on this device",
    )
    _add_serve(sub)
    return parser


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _add_serve(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    s = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible server",
        description=(
            "Serve MODEL over an OpenAI-compatible HTTP API. The model runs in a separate "
            "engine process (and its workers); the HTTP process talks to it over ZeroMQ."
        ),
    )
    s.add_argument("model", nargs="?", default="tiny", help="model directory, or 'tiny' (default)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    s.add_argument("--served-model-name", default=None, help="model id in the API (default MODEL)")
    s.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    s.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda if any")
    s.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel degree")
    s.add_argument("--spp", type=_positive_int, default=1, help="pipeline stages")
    s.add_argument("--kvp", type=_positive_int, default=1, help="KV-parallel groups")
    s.add_argument(
        "--policy",
        default="lars-mp",
        choices=["fcfs", "edf", "lrs", "lars", "lars-mp"],
        help="scheduling policy (default lars-mp)",
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
    s.add_argument("--kv-cache-tokens", type=_positive_int, default=None, help="KV pool per group")
    s.add_argument(
        "--cost-model",
        default=None,
        help="cost model spec (e.g. table:PROFILE.json); default: a quick profile at start-up",
    )
    s.add_argument("--seed", type=_non_negative_int, default=0, help="engine seed")
    s.add_argument("--log-level", default="info", help="uvicorn log level")
    for flag, kind, default, text in (
        ("--nnodes", _positive_int, 1, "nodes (only 1 is supported in this version)"),
        ("--node-rank", _non_negative_int, 0, "this node's rank (only 0 is supported)"),
        ("--master-addr", str, "127.0.0.1", "torch.distributed rendezvous address"),
        ("--master-port", _positive_int, 29501, "torch.distributed rendezvous port"),
    ):
        s.add_argument(flag, type=kind, default=default, help=text)


def _serve(args: argparse.Namespace) -> int:
    import os

    from medha_runtime.server import EngineArgs, run_server

    nnodes = int(os.environ.get("NNODES", args.nnodes))
    if nnodes != 1 or args.node_rank != 0:
        raise ValueError(
            "multi-node serving (--nnodes > 1 or --node-rank > 0) is not supported yet; "
            "run on one node"
        )
    if os.environ.get("WORLD_SIZE", "1") not in ("", "1"):
        raise ValueError(
            "started by torchrun with WORLD_SIZE > 1: run 'medha-runtime serve' once and "
            "use --tp/--spp/--kvp instead"
        )
    engine = EngineArgs(
        model=args.model,
        dtype=args.dtype,
        tp=args.tp,
        spp=args.spp,
        kvp=args.kvp,
        policy=args.policy,
        chunk_size=args.chunk_size,
        target_batch_time=args.target_batch_time,
        max_model_len=args.max_model_len,
        kv_cache_tokens=args.kv_cache_tokens,
        seed=args.seed,
        cost_model=args.cost_model,
        device=args.device,
    )
    run_server(
        engine,
        host=args.host,
        port=args.port,
        api_key=args.api_key or os.environ.get("MEDHA_API_KEY") or None,
        served_model_name=args.served_model_name,
        log_level=args.log_level,
    )
    return 0


def _profile(args: argparse.Namespace) -> int:
    from medha_runtime.profile import FULL_GRID, QUICK_GRID, run_profile

    result = run_profile(
        args.model,
        dtype=args.dtype,
        device=args.device,
        tp=args.tp,
        spp=args.spp,
        kvp=args.kvp,
        block_size=args.block_size,
        grid=QUICK_GRID if args.quick else FULL_GRID,
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


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "profile":
            return _profile(args)
        if args.command == "serve":
            return _serve(args)
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"medha-runtime {args.command}: error: {exc}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
