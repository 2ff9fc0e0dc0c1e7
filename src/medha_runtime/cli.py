"""The ``medha-runtime`` command (also ``python -m medha_runtime``).

Subcommands:

- ``profile [MODEL] --out PROFILE.json``: time real forward passes on this
  device over a grid of prefill chunk sizes x KV lengths and decode batch
  sizes x KV lengths, write a ``TableCostModel`` profile (load it with
  ``TableCostModel.from_json`` or ``LLM(cost_model="table:PROFILE.json")``), and
  report how well the roofline model predicts the measurements.
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
    return parser


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
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"medha-runtime {args.command}: error: {exc}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
