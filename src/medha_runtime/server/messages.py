"""The plain data the HTTP process and the engine process exchange (no torch here).

The HTTP process talks to the engine process over two ZeroMQ PUSH/PULL
sockets on ``ipc://`` paths (pickled plain dataclasses):

- HTTP -> engine: :class:`AddRequest`, :class:`AbortRequest`, :class:`Shutdown`;
- engine -> HTTP: :class:`EngineReady` (or :class:`EngineFailed`) once, then
  :class:`RequestDelta` s (new token ids and text, finish info),
  :class:`AddFailed` for a request the engine refused (:class:`AddAccepted`
  for one it took, where the request asked: a stream waits for it before its
  200 headers), a :class:`Heartbeat`
  with the scheduler's gauges between steps, and an :class:`Alive` pulse
  from a thread, which a long step cannot delay.

:class:`EngineReady` carries what the front end needs of the model as plain
data (:class:`ModelInfo`, :class:`TokenizerData`), so the HTTP process never
opens the checkpoint nor imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from medha_runtime.sampling_params import SamplingParams


@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    priority: int = 0
    cache_salt: str | None = None
    #: answer :class:`AddAccepted` once the engine took it (streams wait for it)
    ack: bool = False


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class Shutdown:
    pass


@dataclass(frozen=True)
class TokenizerData:
    """A tokenizer as plain data: ``tokenizers``' JSON and its special tokens."""

    json: str
    bos_token: str | None
    eos_token: str | None
    chat_template: str | None
    stop_token_ids: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class ModelInfo:
    """What the start-up summary reports about the engine (plain data)."""

    device: str
    policy: str
    cost_model: str
    target_batch_time: float
    kv_pool_tokens: int
    kvp_group_tokens: int
    block_size: int
    vocab_size: int
    #: decode batches of up to this many requests replay CUDA graphs (0: eager)
    cuda_graph_max_batch: int = 0
    async_scheduling: bool = False
    #: ``(SamplingParams field, value)`` for the fields a request leaves unset: the
    #: model's generation config's (:mod:`medha_runtime.generation_defaults`)
    sampling_defaults: tuple[tuple[str, float], ...] = ()
    #: the longest prompt the scheduler's KV memory admits (None: not known); with a
    #: small pool it is below max_model_len (the scheduler keeps a few blocks free)
    max_prompt_tokens: int | None = None


@dataclass
class EngineReady:
    model: str
    max_model_len: int
    pid: int
    dtype: str
    layout: str
    info: ModelInfo | None = None
    tokenizer: TokenizerData | None = None


@dataclass
class EngineFailed:
    message: str


@dataclass
class EngineStopped:
    """The engine process got SIGTERM and stopped cleanly (a process-group stop, or
    the engine signalled alone): the server stops too, with exit code 0."""

    signal: str = "SIGTERM"


@dataclass
class AddAccepted:
    """The engine took the request (sent before any of its deltas, where asked)."""

    request_id: str


@dataclass
class AddFailed:
    request_id: str
    message: str
    bad_request: bool = True


@dataclass
class RequestDelta:
    """New output of one request since its previous delta."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    #: per new token, ``{token_id: logprob}`` (chosen token first); None unless asked
    logprobs: list[dict[int, float]] | None = None
    #: on the first delta: whether the first token met the scheduler's TTFT deadline
    deadline_met: bool | None = None
    error: str | None = None
    #: on the first delta, when asked: None, then per prompt token ``{token_id: logprob}``
    prompt_logprobs: list[dict[int, float] | None] | None = None
    #: on the first delta: prompt tokens whose KV came from the prefix cache
    num_cached_tokens: int = 0


@dataclass
class Alive:
    """Sent every ``HEARTBEAT_S`` by the engine's pulse thread, even mid-step."""


@dataclass
class Heartbeat:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    steps: int
    error: str | None = None
    #: relative step-time prediction errors of the steps since the last heartbeat
    prediction_errors: list[float] = field(default_factory=list)
    #: median relative prediction error of the last 100 steps
    median_prediction_error: float | None = None
    #: the prefill queue for predictive admission (``admission="reject"`` only)
    queue: Any = None
    #: prompt (prefill) and generated (decode) tokens run since the engine started
    prefill_tokens: int = 0
    decode_tokens: int = 0
    #: prompt tokens looked up in the prefix cache, and of those found, since the start
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
