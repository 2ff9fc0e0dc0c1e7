"""Prometheus metrics, vLLM's names with a ``medha:`` prefix (one ``model_name`` label).

Latencies are measured in the HTTP process on one monotonic clock: TTFT from
the request's arrival to its first token's arrival from the engine
(preemptions during prefill count), inter-token latency per token, and
end-to-end latency to the last token. The gauges come from the engine's
heartbeats.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from medha_runtime.server.engine_proc import Heartbeat

_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
_ERROR_BUCKETS = (
    0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0,
)  # fmt: skip
_REJECT_BUCKETS = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25,
    0.5, 1.0,
)  # fmt: skip
_E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = reg = CollectorRegistry()
        labels = ["model_name"]
        self.ttft = Histogram(
            "medha:time_to_first_token_seconds",
            "Time to first token in seconds.",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.itl = Histogram(
            "medha:inter_token_latency_seconds",
            "Time between generated tokens in seconds.",
            labels,
            buckets=_ITL_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.e2e = Histogram(
            "medha:e2e_request_latency_seconds",
            "End-to-end request latency in seconds.",
            labels,
            buckets=_E2E_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.running = Gauge(
            "medha:num_requests_running", "Requests in the running set.", labels, registry=reg
        ).labels(model_name)
        self.waiting = Gauge(
            "medha:num_requests_waiting", "Requests waiting for prefill.", labels, registry=reg
        ).labels(model_name)
        self.kv_usage = Gauge(
            "medha:kv_cache_usage_perc",
            "KV-cache usage, 0 to 1 (all KVP groups).",
            labels,
            registry=reg,
        ).labels(model_name)
        self.preemptions = Counter(
            "medha:num_preemptions", "Requests preempted by recompute.", labels, registry=reg
        ).labels(model_name)
        self.prompt_tokens = Counter(
            "medha:prompt_tokens", "Prompt tokens of finished requests.", labels, registry=reg
        ).labels(model_name)
        self.generation_tokens = Counter(
            "medha:generation_tokens", "Generated tokens.", labels, registry=reg
        ).labels(model_name)
        success = Counter(
            "medha:request_success",
            "Finished requests by finish reason.",
            [*labels, "finished_reason"],
            registry=reg,
        )
        reasons = ("stop", "length", "abort", "error")  # vLLM's finish reasons
        self.success = {r: success.labels(model_name, r) for r in reasons}
        deadline = Counter(
            "medha:request_ttft_deadline",
            "Requests whose first token met (or missed) the scheduler's TTFT deadline.",
            [*labels, "outcome"],
            registry=reg,
        )
        self.deadline_met = deadline.labels(model_name, "met")
        self.deadline_missed = deadline.labels(model_name, "missed")
        self.prediction_error = Histogram(
            "medha:step_time_prediction_relative_error",
            "Per step, |predicted - measured| / measured executor time.",
            labels,
            buckets=_ERROR_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.prediction_error_median = Gauge(
            "medha:step_time_prediction_relative_error_median",
            "Median relative step-time prediction error over the last 100 steps.",
            labels,
            registry=reg,
        ).labels(model_name)
        self.admission_rejected = Counter(
            "medha:admission_rejected",
            "Requests refused with 429: predicted to miss their TTFT SLO (--admission reject).",
            labels,
            registry=reg,
        ).labels(model_name)
        self.admission_reject_seconds = Histogram(
            "medha:admission_reject_seconds",
            "Seconds from a request's arrival in the HTTP server (before its body is read) to "
            "its 429 being sent (--admission reject).",
            labels,
            buckets=_REJECT_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.prefix_cache_queries = Counter(
            "medha:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            labels,
            registry=reg,
        ).labels(model_name)
        self.prefix_cache_hits = Counter(
            "medha:prefix_cache_hits",
            "Prompt tokens found in the prefix cache (their KV reused, not computed).",
            labels,
            registry=reg,
        ).labels(model_name)
        self._preemptions_seen = 0
        self._prefix_seen = (0, 0)

    def on_heartbeat(self, beat: Heartbeat) -> None:
        self.running.set(beat.num_running)
        self.waiting.set(beat.num_waiting)
        self.kv_usage.set(beat.kv_cache_usage)
        if beat.num_preemptions > self._preemptions_seen:
            self.preemptions.inc(beat.num_preemptions - self._preemptions_seen)
            self._preemptions_seen = beat.num_preemptions
        queries, hits = self._prefix_seen
        if beat.prefix_cache_queries > queries:
            self.prefix_cache_queries.inc(beat.prefix_cache_queries - queries)
        if beat.prefix_cache_hits > hits:
            self.prefix_cache_hits.inc(beat.prefix_cache_hits - hits)
        self._prefix_seen = (
            max(queries, beat.prefix_cache_queries),
            max(hits, beat.prefix_cache_hits),
        )
        for error in beat.prediction_errors:
            self.prediction_error.observe(error)
        if beat.median_prediction_error is not None:
            self.prediction_error_median.set(beat.median_prediction_error)
