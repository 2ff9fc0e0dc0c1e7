"""A whole ``medha-runtime bench`` run: reach the server, build the workload, send it, report."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import httpx

from medha_runtime.bench.arrivals import schedule
from medha_runtime.bench.config import BenchConfig
from medha_runtime.bench.datasets import (
    BenchRequest,
    default_long_threshold,
    load_trace,
    mixed_requests,
    random_requests,
)
from medha_runtime.bench.metrics import summarize
from medha_runtime.bench.prompts import PreparedRequest, prepare
from medha_runtime.bench.report import format_summary
from medha_runtime.bench.result import result_document, write_result
from medha_runtime.bench.runner import Runner
from medha_runtime.bench.server_metrics import (
    format_prediction_error,
    scrape_prediction_error,
    settled_prediction_error,
    summarize_prediction_error,
)
from medha_runtime.bench.sharegpt import load_sharegpt
from medha_runtime.bench.tokens import TokenSource, open_token_source

DEFAULT_NUM_PROMPTS = 100


class BenchError(RuntimeError):
    """The run cannot go on (server unreachable, no model, ...); one line for the user."""


def api_root(base_url: str) -> str:
    """``http://host:port`` from a base URL with or without a trailing ``/v1``."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def run_session(config: BenchConfig, *, log: Callable[[str], None] = print) -> int:
    """Run the benchmark; returns the exit status (0 ok, 1 nothing completed, 130 interrupted)."""
    root = api_root(config.base_url)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    with httpx.Client(timeout=60.0, headers=headers) as http:
        model = server_model(http, root, config.model)
        requests, prepared, threshold = build_workload(config, http, root, model, log)
    offsets = schedule(
        [r.arrival_s for r in requests],
        rate=config.request_rate,
        burstiness=config.burstiness,
        seed=config.seed,
    )
    runner = Runner(
        prepared,
        offsets,
        url=f"{root}/v1/completions",
        base_body=base_body(config, model),
        headers=headers,
        slo_fields=config.slo_fields,
        max_concurrency=config.max_concurrency,
        timeout_s=config.request_timeout_s,
        progress=config.progress,
    )
    log(_plan_line(config, model, len(prepared), threshold))
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    with httpx.Client(timeout=10.0, headers=headers) as http:
        before = scrape_prediction_error(http, root)
        interrupted = _run(runner)
        after = settled_prediction_error(http, root, before)
    if interrupted:
        log("interrupted: unfinished requests are recorded as failed")
    server = {"prediction_error": summarize_prediction_error(after and after.since(before))}
    status = _report(config, runner, root, model, started_at, log, server)
    return 130 if interrupted else status


def build_workload(
    config: BenchConfig, http: httpx.Client, root: str, model: str, log: Callable[[str], None]
) -> tuple[list[BenchRequest], list[PreparedRequest], int]:
    """The dataset's requests, their prompts, and the long/short threshold used."""
    source = open_token_source(http, root, model, config.tokenizer)
    if source is None:
        log(f"note: {root} has no /tokenize and no --tokenizer given: prompt ids are 32-126")
    requests = load_requests(config, source)
    threshold = config.long_threshold
    if threshold is None:
        threshold = default_long_threshold(config.dataset_name, config.max_prompt_tokens)
    prepared = prepare(
        requests,
        prompt_format=config.prompt_format,
        source=source,
        seed=config.seed,
        long_threshold=threshold,
    )
    return requests, prepared, threshold


def _run(runner: Runner) -> bool:
    """Run; on Ctrl-C mark the unfinished requests and return True."""
    try:
        asyncio.run(runner.run())
    except KeyboardInterrupt:
        runner.mark_unfinished()
        return True
    return False


def _report(
    config: BenchConfig,
    runner: Runner,
    root: str,
    model: str,
    started_at: str,
    log: Callable[[str], None],
    server: dict[str, Any],
) -> int:
    goodput = dict(config.goodput) or None
    summary = summarize(
        runner.records,
        duration_s=runner.duration_s,
        percentiles=config.percentiles,
        goodput=goodput,
    )
    log(format_summary(summary, config.percentiles))
    log(format_prediction_error(server["prediction_error"]))
    if config.result_file:
        doc = result_document(
            config=config.to_json(),
            base_url=root,
            model=model,
            started_at=started_at,
            summary=summary,
            records=runner.records,
            server=server,
        )
        write_result(config.result_file, doc)
        log(f"wrote {config.result_file}")
    if config.plot:
        from medha_runtime.bench.plot import plot_cdfs

        plot_cdfs(runner.records, config.plot, title=f"{model} @ {root}")
        log(f"wrote {config.plot}")
    if summary["all"]["completed"] == 0:
        log("every request failed (see the reasons above)")
        return 1
    return 0


def server_model(http: httpx.Client, root: str, model: str | None) -> str:
    """Check the server answers ``GET /v1/models``; ``model``, or the first model it lists."""
    try:
        r = http.get(f"{root}/v1/models")
    except httpx.HTTPError as exc:
        reason = str(exc) or type(exc).__name__
        raise BenchError(f"cannot reach the server at {root}: {reason}") from None
    if r.status_code != 200:
        if model is not None and r.status_code == 404:
            return model  # a server without /v1/models: trust --model
        raise BenchError(f"GET {root}/v1/models failed: HTTP {r.status_code}: {r.text[:300]}")
    if model is not None:
        return model
    try:
        return str(r.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise BenchError(f"{root}/v1/models lists no model; pass --model") from None


def load_requests(config: BenchConfig, source: TokenSource | None) -> list[BenchRequest]:
    """The dataset named in ``config``, as requests by length."""
    n = config.num_prompts or DEFAULT_NUM_PROMPTS
    caps = {"max_prompt_tokens": config.max_prompt_tokens}
    caps["max_output_tokens"] = config.max_output_tokens
    name = config.dataset_name
    if name == "trace":
        assert config.dataset_path is not None
        return load_trace(config.dataset_path, num_prompts=config.num_prompts, **caps)
    if name == "sharegpt":
        assert config.dataset_path is not None
        return load_sharegpt(
            config.dataset_path, num_prompts=n, seed=config.seed, source=source, **caps
        )
    if name == "mixed":
        return mixed_requests(n, long_fraction=config.long_fraction, seed=config.seed, **caps)
    return random_requests(
        n,
        input_len=config.random_input_len,
        output_len=config.random_output_len,
        range_ratio=config.random_range_ratio,
        seed=config.seed,
    )


def base_body(config: BenchConfig, model: str) -> dict[str, object]:
    """Fields every request carries."""
    body: dict[str, object] = {"model": model, "stream": True, "temperature": 0.0}
    if config.stream_usage:
        body["stream_options"] = {"include_usage": True}
    if config.ignore_eos:
        body["ignore_eos"] = True
    return body


def _plan_line(config: BenchConfig, model: str, n: int, threshold: int) -> str:
    rate = config.request_rate
    if rate is None:
        when = "the trace's arrival times" if config.dataset_name == "trace" else "all at once"
    else:
        when = "all at once" if math.isinf(rate) else f"{rate:g} req/s"
        if not math.isinf(rate) and config.burstiness != 1.0:
            when += f" (gamma, burstiness {config.burstiness:g})"
    limit = f", at most {config.max_concurrency} in flight" if config.max_concurrency else ""
    return (
        f"bench: {n} {config.dataset_name} requests to {model}, {when}{limit}; "
        f"long = prompt > {threshold} tokens"
    )
