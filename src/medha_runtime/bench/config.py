"""What one ``medha-runtime bench`` run does: a frozen, validated configuration."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

DATASETS = ("trace", "sharegpt", "random", "mixed")
PROMPT_FORMATS = ("tokens", "text")
#: the latency metrics a --goodput SLO may bound (milliseconds)
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchConfig:
    """One benchmark run.

    Attributes:
        base_url: the server, e.g. ``http://127.0.0.1:8000`` (``/v1`` is appended).
        model: model id sent with each request; ``None``: the first of ``GET /v1/models``.
        api_key: sent as ``Authorization: Bearer KEY``.
        dataset_name: ``trace``, ``sharegpt``, ``random`` or ``mixed``.
        dataset_path: the JSONL trace or ShareGPT JSON file.
        num_prompts: requests to send; ``None``: the whole trace, else 100.
        random_input_len, random_output_len, random_range_ratio: the ``random`` lengths,
            uniform in ``[len * (1 - ratio), len * (1 + ratio)]``.
        long_fraction: share of long (Medha-SWE) requests in ``mixed``.
        max_prompt_tokens: mixed: compress lengths to this ceiling; sharegpt: skip
            longer prompts; trace: clip.
        max_output_tokens: clip output lengths (mixed, sharegpt, trace).
        long_threshold: prompts longer than this are "long" in the summary.
        prompt_format: ``tokens`` (token-id lists) or ``text``.
        tokenizer: a local Hugging Face tokenizer directory (``tokenizer.json``).
        request_rate: requests/s; ``inf``: all at once; ``None``: the trace's own
            times (trace) or ``inf``.
        burstiness: gamma shape of the gaps (1: Poisson, smaller: burstier).
        max_concurrency: at most this many requests in flight.
        seed: random seed (arrivals, lengths, prompts).
        ignore_eos, slo_fields, stream_usage: what each request body asks for.
        goodput: ``(metric, limit_ms)`` SLOs, metric in ``ttft``, ``tpot``, ``e2el``.
        percentiles: reported percentiles, in (0, 100).
        result_file, plot: where to write the JSON result and the CDF figure.
        request_timeout_s: per-request limit.
        progress: show a progress bar.
    """

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None
    api_key: str | None = None
    dataset_name: str = "random"
    dataset_path: str | None = None
    num_prompts: int | None = None
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    long_fraction: float = 0.05
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    long_threshold: int | None = None
    prompt_format: str = "tokens"
    tokenizer: str | None = None
    request_rate: float | None = None
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    ignore_eos: bool = True
    slo_fields: bool = True
    stream_usage: bool = True
    goodput: tuple[tuple[str, float], ...] = ()
    percentiles: tuple[float, ...] = (50.0, 90.0, 99.0)
    result_file: str | None = None
    plot: str | None = None
    request_timeout_s: float = 600.0
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")
        self._check_dataset()
        for name in ("random_input_len", "random_output_len"):
            _at_least(name, getattr(self, name), 1)
        for name in ("num_prompts", "max_prompt_tokens", "max_output_tokens", "max_concurrency"):
            if getattr(self, name) is not None:
                _at_least(name, getattr(self, name), 1)
        if self.long_threshold is not None:
            _at_least("long_threshold", self.long_threshold, 0)
        _at_least("seed", self.seed, 0)
        self._check_numbers()
        self._check_goodput()

    def _check_dataset(self) -> None:
        if self.dataset_name not in DATASETS:
            raise ValueError(f"dataset_name must be one of {DATASETS}, got {self.dataset_name!r}")
        if self.dataset_name in ("trace", "sharegpt") and not self.dataset_path:
            raise ValueError(f"the {self.dataset_name} dataset needs --dataset-path")
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(
                f"prompt_format must be one of {PROMPT_FORMATS}, got {self.prompt_format!r}"
            )
        if self.dataset_name == "random" and (self.max_prompt_tokens or self.max_output_tokens):
            raise ValueError(
                "--max-prompt-tokens/--max-output-tokens do not apply to the random dataset; "
                "use --random-input-len and --random-output-len"
            )

    def _check_numbers(self) -> None:
        if not (_number(self.random_range_ratio) and 0 <= self.random_range_ratio < 1):
            ratio = self.random_range_ratio
            raise ValueError(f"random_range_ratio must be in [0, 1), got {ratio!r}")
        if not (_number(self.long_fraction) and 0 <= self.long_fraction <= 1):
            raise ValueError(f"long_fraction must be in [0, 1], got {self.long_fraction!r}")
        rate = self.request_rate
        if rate is not None and not (_number(rate, allow_inf=True) and rate > 0):
            raise ValueError(f"request_rate must be > 0 (or inf), got {rate!r}")
        if not (_number(self.burstiness) and self.burstiness > 0):
            raise ValueError(f"burstiness must be a finite number > 0, got {self.burstiness!r}")
        if not (_number(self.request_timeout_s) and self.request_timeout_s > 0):
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s!r}")
        if not self.percentiles or not all(_number(p) and 0 < p < 100 for p in self.percentiles):
            raise ValueError(f"percentiles must lie in (0, 100), got {self.percentiles!r}")

    def _check_goodput(self) -> None:
        seen = set()
        for metric, limit in self.goodput:
            if metric not in GOODPUT_METRICS:
                raise ValueError(f"goodput metric must be one of {GOODPUT_METRICS}, got {metric!r}")
            if metric in seen:
                raise ValueError(f"goodput metric {metric!r} is given twice")
            if not (_number(limit) and limit > 0):
                raise ValueError(f"goodput limit for {metric} must be > 0 ms, got {limit!r}")
            seen.add(metric)

    def to_json(self) -> dict[str, Any]:
        """The configuration as JSON-safe values (the API key left out, ``inf`` as a string)."""
        out = asdict(self)
        out["api_key"] = "***" if self.api_key else None
        out["goodput"] = {metric: limit for metric, limit in self.goodput}
        out["percentiles"] = list(self.percentiles)
        if self.request_rate is not None and math.isinf(self.request_rate):
            out["request_rate"] = "inf"
        return out


def _number(x: object, *, allow_inf: bool = False) -> bool:
    if not isinstance(x, (int, float)) or isinstance(x, bool) or math.isnan(x):
        return False
    return allow_inf or math.isfinite(x)


def _at_least(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
