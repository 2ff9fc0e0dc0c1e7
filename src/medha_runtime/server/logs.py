"""The server's log, as ``vllm serve`` writes one.

- :func:`setup_logging`: ``LEVEL MM-DD HH:MM:SS.mmm [module] message`` lines on
  stderr for the ``medha_runtime`` loggers, at ``--log-level``;
- :func:`startup_summary`: one block once the engine is ready: model, dtype,
  device, layout, policy, cost model, T, the KV pool in tokens, how decode
  steps run (CUDA graphs, async scheduling), the address;
- :func:`access_line`: one line per request: id, route, status, prompt and
  output tokens, TTFT, end-to-end time, finish reason(s)
  (``--disable-log-requests`` turns them off);
- :class:`StatsLogger`: every ``interval_s`` while the engine is busy, the
  running and waiting requests, prompt and generation throughput, KV usage
  and the median step-time prediction error (from the engine's heartbeats).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from medha_runtime.server.messages import EngineReady, Heartbeat, ModelInfo

logger = logging.getLogger("medha_runtime.server")

LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def setup_logging(level: str) -> None:
    """Send ``medha_runtime`` log records to stderr at ``level`` (uvicorn's names)."""
    lvl = logging.DEBUG if level == "trace" else getattr(logging, level.upper())
    root = logging.getLogger("medha_runtime")
    root.setLevel(lvl)
    if not any(getattr(h, "_medha", False) for h in root.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(
            logging.Formatter(
                "%(levelname)s %(asctime)s.%(msecs)03d [%(module)s] %(message)s",
                datefmt="%m-%d %H:%M:%S",
            )
        )
        handler._medha = True  # type: ignore[attr-defined]
        root.addHandler(handler)
        root.propagate = False


def startup_summary(ready: EngineReady, *, served_name: str, address: str) -> list[str]:
    """The start-up block's lines."""
    lines = [f"model {ready.model} (served as {served_name!r}), dtype {ready.dtype}"]
    info = ready.info
    if info is not None:
        lines += [
            f"device {info.device}, layout {_layout(ready.layout)}, policy {info.policy}",
            f"cost model {info.cost_model}, T (target batch time) "
            f"{info.target_batch_time * 1e3:.1f} ms",
            f"KV pool {info.kv_pool_tokens:,} tokens per KVP group "
            f"({info.kv_pool_tokens // info.block_size:,} blocks of {info.block_size}), "
            f"at most {info.kvp_group_tokens:,} tokens of a request per group, "
            f"max model len {ready.max_model_len:,}",
            _execution(info),
        ]
        if info.sampling_defaults:
            pairs = ", ".join(f"{k}={v}" for k, v in info.sampling_defaults)
            lines.append(f"default sampling from the model's generation config: {pairs}")
    else:
        lines.append(f"layout {ready.layout}, max model len {ready.max_model_len:,}")
    lines.append(f"engine process pid {ready.pid}; serving on {address}")
    return lines


def _execution(info: ModelInfo) -> str:
    """How steps run: CUDA graphs for decodes or not, async scheduling or not."""
    n = info.cuda_graph_max_batch
    graphs = f"CUDA graphs for decode batches up to {n}" if n else "no CUDA graphs"
    return f"decode steps: {graphs}; async scheduling {'on' if info.async_scheduling else 'off'}"


def _layout(text: str) -> str:
    """``ParallelDegrees(tp=1, spp=2, kvp=1)`` -> ``tp=1 spp=2 kvp=1``."""
    inner = text[text.find("(") + 1 : text.rfind(")")] if "(" in text else text
    return inner.replace(",", "")


def access_line(
    *,
    request_id: str,
    route: str,
    status: int,
    prompt_tokens: int | None,
    output_tokens: int | None,
    ttft_s: float | None,
    e2e_s: float,
    finish: str | None,
) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.1f}ms"

    def n(x: int | None) -> str:
        return "-" if x is None else str(x)

    return (
        f"{request_id} {route} {status} prompt_tokens={n(prompt_tokens)}"
        f" output_tokens={n(output_tokens)} ttft={ms(ttft_s)} e2e={ms(e2e_s)}"
        f" finish={finish or '-'}"
    )


class StatsLogger:
    """Logs the engine's statistics every ``interval_s`` while it is busy."""

    def __init__(self, interval_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self.beat: Heartbeat | None = None
        self._last: tuple[float, int, int] | None = None

    def on_heartbeat(self, beat: Heartbeat) -> None:
        self.beat = beat
        if self._last is None:  # the first beat is the baseline of the first line
            self._last = (time.monotonic(), beat.prefill_tokens, beat.decode_tokens)

    def line(self, now: float) -> str | None:
        """The statistics since the previous call, or None when there was nothing to say."""
        beat = self.beat
        if beat is None:
            return None
        last, self._last = self._last, (now, beat.prefill_tokens, beat.decode_tokens)
        if last is None:
            return None
        dt = max(now - last[0], 1e-9)
        prompt = (beat.prefill_tokens - last[1]) / dt
        gen = (beat.decode_tokens - last[2]) / dt
        busy = beat.num_running or beat.num_waiting or prompt or gen
        if not busy:
            return None
        err = beat.median_prediction_error
        return (
            f"running: {beat.num_running} reqs, waiting: {beat.num_waiting} reqs, "
            f"prompt throughput: {prompt:.1f} tokens/s, generation throughput: {gen:.1f} "
            f"tokens/s, KV cache usage: {beat.kv_cache_usage * 100:.1f}%, median step-time "
            f"prediction error: {'-' if err is None else f'{err * 100:.1f}%'}"
        )

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            text = self.line(time.monotonic())
            if text is not None:
                logger.info(text)


def log_lines(lines: list[str], level: int = logging.INFO, **kw: Any) -> None:
    for text in lines:
        logger.log(level, text, **kw)
