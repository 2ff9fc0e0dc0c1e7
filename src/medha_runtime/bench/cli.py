"""``medha-runtime bench``: the command-line flags, turned into a :class:`BenchConfig` and run."""

from __future__ import annotations

import argparse
import math
import os
import sys

from medha_runtime.bench.config import DATASETS, GOODPUT_METRICS, PROMPT_FORMATS, BenchConfig
from medha_runtime.cli import _non_negative_int, _positive_int

DESCRIPTION = (
    "Load-test an OpenAI-compatible server (medha-runtime serve, vLLM, SGLang) with streaming "
    "/v1/completions requests: TTFT, TPOT, inter-token latency, end-to-end latency, "
    "throughput and goodput, for all, short and long requests."
)


def _float(*, allow_inf: bool = False, allow_zero: bool = False) -> object:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        ok = (value >= 0 if allow_zero else value > 0) and (allow_inf or math.isfinite(value))
        if math.isnan(value) or not ok:
            bound = ">= 0" if allow_zero else "> 0"
            raise argparse.ArgumentTypeError(
                f"expected a {'' if allow_inf else 'finite '}number {bound}, got {text!r}"
            )
        return value

    return parse


def _unit(*, closed: bool) -> object:
    def parse(text: str) -> float:
        value = _float(allow_zero=True)(text)  # type: ignore[operator]
        if value > 1 or (value == 1 and not closed):
            raise argparse.ArgumentTypeError(
                f"expected a number in [0, {'1]' if closed else '1)'}, got {text!r}"
            )
        return value

    return parse


def _slo(text: str) -> tuple[str, float]:
    metric, sep, ms = text.partition(":")
    if not sep or metric not in GOODPUT_METRICS:
        raise argparse.ArgumentTypeError(
            f"expected METRIC:MS with METRIC one of {', '.join(GOODPUT_METRICS)}, got {text!r}"
        )
    return metric, _float()(ms)  # type: ignore[operator]


def _percentiles(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(p) for p in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 50,90,99, got {text!r}") from None
    if not all(0 < p < 100 for p in values):
        raise argparse.ArgumentTypeError(f"percentiles must lie in (0, 100), got {text!r}")
    return values


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Add the ``bench`` subcommand to ``subparsers``."""
    p = subparsers.add_parser(
        "bench", help="load-test an OpenAI-compatible server", description=DESCRIPTION
    )
    _server_flags(p)
    _dataset_flags(p)
    _load_flags(p)
    _output_flags(p)
    return p


def _server_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="server URL")
    g.add_argument("--api-key", default=None, help="bearer key (default: $OPENAI_API_KEY)")
    g.add_argument("--model", default=None, help="model id (default: first of GET /v1/models)")
    g.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS")
    g.add_argument(
        "--no-slo-fields",
        action="store_true",
        help="do not send ttft_slo_ms/tpot_slo_ms/priority (for servers that reject them)",
    )
    g.add_argument(
        "--no-stream-usage",
        action="store_true",
        help="do not ask for stream_options.include_usage; count chunks as tokens",
    )
    g.add_argument(
        "--request-timeout", type=_float(), default=600.0, metavar="SEC", help="per request"
    )


def _dataset_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--dataset-name", choices=DATASETS, default="random", help="default random")
    g.add_argument("--dataset-path", default=None, help="trace JSONL or ShareGPT JSON file")
    g.add_argument(
        "--num-prompts",
        type=_positive_int,
        default=None,
        help="requests (default: 100; trace: all)",
    )
    g.add_argument("--random-input-len", type=_positive_int, default=1024)
    g.add_argument("--random-output-len", type=_positive_int, default=128)
    g.add_argument("--random-range-ratio", type=_unit(closed=False), default=0.0)
    g.add_argument("--long-fraction", type=_unit(closed=True), default=0.05, help="mixed")
    g.add_argument(
        "--max-prompt-tokens",
        type=_positive_int,
        default=None,
        help="mixed: compress prompt lengths to this ceiling; sharegpt: skip longer; trace: clip",
    )
    g.add_argument(
        "--max-output-tokens", type=_positive_int, default=None, help="clip output lengths"
    )
    g.add_argument(
        "--long-threshold",
        type=_non_negative_int,
        default=None,
        help="prompts longer than this are 'long' (default 8192, compressed for mixed)",
    )
    g.add_argument("--prompt-format", choices=PROMPT_FORMATS, default="tokens")
    g.add_argument("--tokenizer", default=None, help="local tokenizer directory (tokenizer.json)")


def _load_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load")
    g.add_argument(
        "--request-rate",
        type=_float(allow_inf=True),
        default=None,
        help="requests/s, or inf (default: the trace's times, else inf)",
    )
    g.add_argument(
        "--burstiness", type=_float(), default=1.0, help="gamma shape: 1 Poisson, < 1 burstier"
    )
    g.add_argument("--max-concurrency", type=_positive_int, default=None, help="requests in flight")
    g.add_argument("--seed", type=_non_negative_int, default=0)


def _output_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument(
        "--goodput",
        nargs="+",
        type=_slo,
        default=[],
        metavar="METRIC:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000",
    )
    g.add_argument("--percentiles", type=_percentiles, default=(50.0, 90.0, 99.0))
    g.add_argument("--result-file", default=None, metavar="PATH.json")
    g.add_argument("--plot", default=None, metavar="PATH.png", help="CDFs of TTFT, TPOT, ITL")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        base_url=args.base_url,
        model=args.model,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY") or None,
        dataset_name=args.dataset_name,
        dataset_path=args.dataset_path,
        num_prompts=args.num_prompts,
        random_input_len=args.random_input_len,
        random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio,
        long_fraction=args.long_fraction,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
        long_threshold=args.long_threshold,
        prompt_format=args.prompt_format,
        tokenizer=args.tokenizer,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        ignore_eos=not args.no_ignore_eos,
        slo_fields=not args.no_slo_fields,
        stream_usage=not args.no_stream_usage,
        goodput=tuple(args.goodput),
        percentiles=tuple(args.percentiles),
        result_file=args.result_file,
        plot=args.plot,
        request_timeout_s=args.request_timeout,
        progress=not args.no_progress,
    )


def run_bench(args: argparse.Namespace) -> int:
    """Run ``medha-runtime bench``; errors are one line on stderr and exit status 1."""
    import httpx

    from medha_runtime.bench.session import run_session

    try:
        if args.plot:  # before the run, not after it
            from medha_sched.sim.plot import check_figure_path

            check_figure_path(args.plot, flag="--plot")
        return run_session(config_from_args(args))
    except (ValueError, OSError, RuntimeError, httpx.HTTPError) as exc:
        print(f"medha-runtime bench: error: {exc}", file=sys.stderr)
        return 1
