"""The engine: a ``medha_sched.Scheduler`` driving an executor, plus sampling and stops.

One :meth:`LLMEngine.step`:

1. ``scheduler.schedule(now)`` forms a batch (decodes and prefill chunks);
2. the batch becomes a :class:`~medha_runtime.plan.StepPlan` (block-table
   deltas, a :class:`~medha_runtime.sampling.SampleSpec` per sampled row)
   that the executor runs on every rank;
3. each sampled token is appended to its request, detokenized incrementally
   and checked against the stop conditions (EOS unless ``ignore_eos``, stop
   token ids, stop strings; none before ``min_tokens``); a row the sampler could
   not sample (``Sampled.error``) ends its request with ``finish_reason="error"``;
4. ``scheduler.on_batch_end`` gets the tokens and the requests the engine
   stopped; ``max_tokens`` is the scheduler's (``finish_reason="length"``).

Stream pipelining: with ``spp > 1`` up to ``spp`` batches are in flight (see
:meth:`LLMEngine.step`); the engine calls ``scheduler.on_stage_end`` when a
batch clears stage 0 and forms the next batch then, while the earlier one runs
on the later stages. :attr:`LLMEngine.pipeline_depth` = 1 runs one batch at a
time (the old pipeline). With async scheduling a running decode is issued
once the batch before it cleared stage 0, before its token is back: the last
stage sends that token straight to stage 0 (``RunnerSpec.pending_tokens``).

The cost model learns: by default (``cost_model=None`` or ``"online"``) the
start-up calibration seeds an :class:`~medha_sched.cost.online.OnlineCostModel`
that every executed step updates (:mod:`medha_runtime.cost_feedback`, which
also keeps each step's prediction error); ``cost_model_out`` saves it at
shutdown.

KV memory: every KVP group has a pool of ``kv_cache_tokens`` tokens
(``num_blocks_per_group`` blocks of ``block_size``); one request holds at most
``G`` tokens on one group (``kvp_group_tokens``; by default the context
divided by ``kvp``), so its context is at most ``kvp * G`` tokens.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import statistics
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from medha_parallel.tokens import return_slots
from medha_runtime.config import EngineConfig
from medha_runtime.cost_feedback import CostFeedback
from medha_runtime.executor import StepDone, WorkerError, make_executor
from medha_runtime.model import ModelConfig, load_config
from medha_runtime.model.errors import MissingFileError
from medha_runtime.model.names import resolve_model
from medha_runtime.model.random_weights import random_config_path
from medha_runtime.outputs import CompletionOutput, RequestOutput
from medha_runtime.plan import PlannedChunk, StepPlan
from medha_runtime.sampling import (
    Penalties,
    PromptLogprobs,
    PromptLogprobSpec,
    Sampled,
    SampleSpec,
    SamplingParams,
)
from medha_runtime.sampling_params import (
    check_allowed_tokens,
    check_token_ids,
    resolve_bad_words,
    stop_tokens,
    truncate_prompt,
)
from medha_runtime.step_log import StepLog, initial_model_path
from medha_runtime.tokenizer import DetokenizeState, Tokenizer
from medha_sched import (
    PENDING_TOKEN,
    BatchResult,
    BatchWork,
    CostModel,
    Request,
    RequestStatus,
    RequestWork,
    Scheduler,
    SchedulerError,
    parse_cost_model_spec,
)
from medha_sched.cost.online import OnlineCostModel

logger = logging.getLogger(__name__)

#: the iteration-time budget when none is given (raised for slow devices, see LLMEngine)
DEFAULT_TARGET_TIME = 0.05
#: steps between looks at a learning model for a new automatic budget T
BUDGET_EVERY = 32
#: a re-derived T within this fraction of the current one is not applied
BUDGET_BAND = 0.2
#: T follows the model only while the median relative prediction error of its
#: last ``BUDGET_EVERY`` steps is at most this (a model that has lost the
#: device, e.g. under a CPU hog, can run off; T following it would run off too)
BUDGET_TRUST = 0.2
#: one change moves T by at most this factor, up or down
BUDGET_STEP = 2.0


class RequestProgress(NamedTuple):
    """An unfinished request's output so far, and its absolute TTFT deadline."""

    output_ids: list[int]
    text: str
    logprobs: list | None
    deadline: float
    #: per prompt token after the first, ``{token id: logprob}`` (None unless asked)
    prompt_logprobs: list | None = None


def load_model_info(model: str) -> tuple[ModelConfig, Tokenizer | None]:
    """The model's config and tokenizer (None if a directory has no ``tokenizer.json``).

    ``model`` is any name :func:`~medha_runtime.model.names.resolve_model` accepts.
    """
    resolved = resolve_model(model)
    if resolved.kind == "tiny":
        from medha_runtime.model.tiny import tiny_config, tiny_tokenizer

        return tiny_config(), tiny_tokenizer()
    if resolved.kind == "gguf":
        from medha_runtime.model.gguf import open_gguf
        from medha_runtime.model.gguf_tokenizer import build_gguf_tokenizer

        checkpoint = open_gguf(resolved.path)
        return checkpoint.config(), build_gguf_tokenizer(checkpoint)
    config = load_config(resolved.path)
    spec_config = random_config_path(resolved.path)  # a random: model's tokenizer sits beside
    try:
        tokenizer = Tokenizer.from_pretrained_dir(
            spec_config.parent if spec_config else resolved.path
        )
    except MissingFileError:
        tokenizer = None
    return config, tokenizer


@dataclass
class EngineStats:
    """Counters since the engine started.

    Attributes:
        steps: batches run.
        prefill_tokens: prompt (or recomputed) tokens run in prefill chunks.
        decode_tokens: decode steps run.
        sharded_chunks: chunks whose request spanned more than one KVP group.
        preemptions: requests preempted by recompute.
        max_in_flight: the most batches that were in flight at once (stream pipelining).
    """

    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    sharded_chunks: int = 0
    preemptions: int = 0
    max_in_flight: int = 0


@dataclass
class _InFlight:
    """A batch the executor runs: its schedule, and when it was formed and shipped."""

    out: Any  # the ScheduleOutput
    start: float  # engine clock at scheduling
    scheduled: float  # perf_counter before scheduling
    submitted: float  # perf_counter once shipped
    cleared: float | None = None  # perf_counter when it left stage 0


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    sched: Request
    detok: DetokenizeState | None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0
    #: per prompt token after the first (None unless ``prompt_logprobs``)
    prompt_logprobs: list[dict[int, float]] | None = None
    #: prompt positions whose logprobs a shipped chunk asks for (answered or
    #: in flight: with async scheduling or SPP the next chunk is planned
    #: before the previous chunk's logprobs are back)
    prompt_logprobs_asked: int = 0
    #: whether the sampler got the token history (penalties, bad words of more
    #: than one token)
    history_sent: bool = False
    #: ``params.bad_words`` as token sequences (resolved once, in add_request)
    bad_words: tuple[tuple[int, ...], ...] = ()
    #: prompt tokens the first admission found in the prefix cache (None until
    #: admitted): a recompute after preemption may hit the request's own KV,
    #: which was computed for it, so later admissions do not change it
    cached_tokens: int | None = None
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    #: why the request ended with ``finish_reason="error"`` (its token could not be sampled)
    error: str | None = None


class LLMEngine:
    """Requests in, finished :class:`~medha_runtime.outputs.RequestOutput` s out.

    Built from one :class:`~medha_runtime.config.EngineConfig` (which documents
    every argument), or from a model and that config's keyword arguments:
    ``LLMEngine("tiny", kvp=2)`` is ``LLMEngine(EngineConfig(model="tiny", kvp=2))``.
    The config is resolved once (:attr:`resolved`: context length, KV sizing,
    scheduler config, runner spec).
    """

    def __init__(
        self, model: str | os.PathLike[str] | EngineConfig = "tiny", **kwargs: Any
    ) -> None:
        config = EngineConfig.build(model, **kwargs)
        self.engine_config = config
        self.model = config.model
        # resolved once (a smollm2 fetch, a hub cache lookup); ranks get the path
        path = resolve_model(config.model).path
        self.config, self.tokenizer = load_model_info(path)
        r = self.resolved = config.resolve(self.config, model_path=path)
        if r.chat_template is not None:
            if self.tokenizer is None:
                raise ValueError(
                    f"chat_template: model {config.model!r} has no tokenizer to chat with"
                )
            self.tokenizer = self.tokenizer.with_chat_template(r.chat_template)
        self.layout, self.dtype, self.max_model_len = r.layout, r.dtype, r.max_model_len
        self.cache, self.scheduler_config, self.spec = r.cache, r.scheduler_config, r.spec
        if r.num_threads is not None and r.layout.world_size == 1:
            torch.set_num_threads(r.num_threads)  # in-process: this process is the rank
        online = config.cost_model is None or config.cost_model == "online"
        cost = None if online else self._resolve_cost_model(config.cost_model)  # type: ignore[arg-type]
        self._step_log = None if config.step_log is None else StepLog(config.step_log)
        try:
            self.executor = make_executor(self.spec, distributed=config.distributed)
        except BaseException:
            if self._step_log is not None:
                self._step_log.close()
            raise
        try:
            if cost is None:
                from medha_runtime.profile import calibrate_affine

                cost = calibrate_affine(
                    self.executor,
                    self.layout,
                    vocab_size=self.config.vocab_size,
                    probes=self._budget_probes(),
                )
                if online:
                    cost = OnlineCostModel.from_model(cost)
            self.cost_model = cost
            if self._step_log is not None and isinstance(cost, OnlineCostModel):
                # the model the log's first step is priced with, to replay the log from
                cost.save(initial_model_path(self._step_log.path))
            self.cost_feedback = CostFeedback(
                cost, group_limit=self.cache.group_token_limit, save_to=config.cost_model_out
            )
            if config.target_batch_time is None:
                self.scheduler_config = dataclasses.replace(
                    self.scheduler_config, target_batch_time=self._auto_target_time(cost)
                )
            self.scheduler = Scheduler(self.scheduler_config, cost, cache=self.cache)
            # the automatic budget follows a learning model (see _follow_budget)
            self._budget_follows = config.target_batch_time is None and hasattr(cost, "revision")
            self._budget_revision = getattr(cost, "revision", 0)
            self._budget_steps = 0
            #: times the automatic budget T was re-derived and changed
            self.budget_changes = 0
        except BaseException:
            self.shutdown()
            raise
        self.seed = config.seed
        self._serial = itertools.count()
        self._requests: dict[str, _RequestState] = {}
        self._pending_free: list[str] = []
        self._pending_finished: list[str] = []
        self._clock0 = time.monotonic()
        self._idle_steps = 0
        tok = self.tokenizer
        self.eos_token_ids: frozenset[int] = frozenset(
            tok.stop_token_ids if tok is not None else self.config.eos_token_ids
        )
        self.dead: str | None = None
        self.stats = EngineStats()
        self._inflight: OrderedDict[int, _InFlight] = OrderedDict()  # batches, oldest first
        self._depth: int | None = None  # pipeline_depth (None: spp)
        self._text_backlog: list[tuple[_RequestState, int]] = []  # tokens not yet detokenized
        self._specs: dict[str, SampleSpec] = {}  # sampling specs that no longer change
        #: async scheduling (EngineConfig.async_scheduling): batch N+1 is formed and
        #: shipped right after batch N, before N's tokens are back
        self._async = self.spec.pending_tokens  # resolved (None: on with spp > 1)
        #: async scheduling with one stage: a shipped batch has cleared stage 0
        self._async_one_stage = self._async and self.layout.spp == 1
        #: async: request id -> the newest batch id in flight when it finished;
        #: its rows in batches up to that one (decodes issued ahead) are dropped
        self._dropped: dict[str, int] = {}

    # ------------------------------------------------------------------ setup
    def _resolve_cost_model(self, cost_model: CostModel | str) -> CostModel:
        if isinstance(cost_model, str):
            return parse_cost_model_spec(cost_model, layout=self.layout)
        layout = getattr(cost_model, "layout", None)
        if layout is None or not hasattr(cost_model, "predict"):
            raise ValueError(f"cost_model must be a CostModel or a spec string, got {cost_model!r}")
        if layout != self.layout:
            if not dataclasses.is_dataclass(cost_model):
                raise ValueError(f"cost_model was made for {layout}, the engine runs {self.layout}")
            cost_model = dataclasses.replace(cost_model, layout=self.layout)  # type: ignore[type-var]
        return cost_model

    def _auto_target_time(self, cost: CostModel) -> float:
        """The default budget: 50 ms, or more if one grid chunk at the end of the
        context needs more than half of it (slow devices, long contexts), or if
        ``throughput_chunk`` tokens at the start of a prompt need more (offline)."""
        floor = DEFAULT_TARGET_TIME
        first = self._throughput_first()
        if first is not None:
            groups = [() for _ in range(self.layout.kvp)]
            groups[0] = (RequestWork(first, 0, tail=True),)
            floor = max(floor, 1.1 * cost.predict(BatchWork(tuple(groups))))
        return max(floor, self._end_chunk_time(cost))

    def _budget_probes(self) -> dict[tuple[int, int], float]:
        """The single-request steps ``(query tokens, KV tokens)`` the automatic
        budget is priced from, each with the factor :meth:`_auto_target_time`
        applies to its time, for the start-up calibration to measure: one
        grid chunk at the end of the context (2x) and, offline, a
        ``throughput_chunk`` first chunk (1.1x). The calibration cuts them to
        one KVP shard (with KVP > 1 the end chunk's slowest group is a full
        shard)."""
        grid = min(self.scheduler_config.token_grid, self.max_model_len)
        probes = {(grid, self.max_model_len - grid): 2.0}
        first = self._throughput_first()
        if first is not None:
            probes[(first, 0)] = max(1.1, probes.get((first, 0), 0.0))
        return probes

    def _throughput_first(self) -> int | None:
        """The ``throughput_chunk`` first chunk the automatic budget must fit, cut to
        the longest prompt and one KVP group (None: unset, or a fixed ``chunk_size``)."""
        want = self.engine_config.throughput_chunk
        if want is None or self.scheduler_config.chunk_size is not None:
            return None
        return min(want, self.max_model_len - 1, self.cache.group_token_limit)

    def _follow_budget(self) -> None:
        """Re-derive the automatic budget T from the learning cost model.

        Called once per executed step; does nothing unless T is automatic
        and the model learns (has a ``revision``). Every ``BUDGET_EVERY``
        steps, if the model's ``revision`` moved since the last look, T is
        priced again as at start-up (:meth:`_auto_target_time`, a few
        predictions) and handed to the scheduler
        (:meth:`~medha_sched.Scheduler.set_target_batch_time`, which rebuilds
        its prefill-time table) when it differs from the current T by more
        than ``BUDGET_BAND`` (hysteresis: no flapping on noise), moved by at
        most a factor ``BUDGET_STEP``, and only while the model's median
        relative error over the last ``BUDGET_EVERY`` steps is at most
        ``BUDGET_TRUST``.
        """
        if not self._budget_follows:
            return
        self._budget_steps += 1
        if self._budget_steps < BUDGET_EVERY:
            return
        self._budget_steps = 0
        cost = self.cost_model
        revision = cost.revision  # type: ignore[attr-defined]
        if revision == self._budget_revision:
            return
        recent = list(self.cost_feedback.recent)[-BUDGET_EVERY:]
        if len(recent) < BUDGET_EVERY or statistics.median(recent) > BUDGET_TRUST:
            return  # not trusted now: looked at again in BUDGET_EVERY steps
        current = self.scheduler_config.target_batch_time
        target = self._auto_target_time(cost)
        if abs(target - current) <= BUDGET_BAND * current:
            self._budget_revision = revision
            return
        step = min(max(target, current / BUDGET_STEP), current * BUDGET_STEP)
        if step == target:  # reached: the next look waits for a new revision
            self._budget_revision = revision
        target = step
        self.scheduler.set_target_batch_time(target)
        self.scheduler_config = self.scheduler.config
        self.budget_changes += 1

    def _end_chunk_time(self, cost: CostModel) -> float:
        """Twice the predicted time of one grid chunk at the end of the context."""
        grid = min(self.scheduler_config.token_grid, self.max_model_len)
        kv = self.max_model_len - grid  # the chunk's position: its tail shard is kv // g
        g = self.cache.group_token_limit
        tail = kv // g
        groups: list[tuple[RequestWork, ...]] = [() for _ in range(self.layout.kvp)]
        for shard in range(tail):  # full earlier shards only attend
            groups[shard] = (RequestWork(grid, g, tail=False),)
        groups[tail] = (RequestWork(grid, kv - tail * g, tail=True),)
        return 2.0 * cost.predict(BatchWork(tuple(groups)))

    # --------------------------------------------------------------- requests
    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(
                f"model {self.model!r} has no tokenizer.json: pass prompts as token ids"
            )
        return self.tokenizer.encode(prompt)

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        request_id: str | None = None,
        ttft_slo: float | None = None,
        tpot_slo: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> str:
        """Queue a request; returns its id. Raises ValueError for a bad prompt or params.

        ``ttft_slo`` and ``tpot_slo`` (seconds) and ``priority`` (lower runs
        first) go to the scheduler: the TTFT deadline orders prefills under
        deadline-aware policies, and a TPOT target lowers the batch budget
        while the request decodes. ``cache_salt`` (a non-empty string, vLLM's)
        lets the prompt hit only prefix-cache blocks of prompts with the same salt.
        """
        self._check_alive()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {params!r}")
        if params.n != 1:
            raise ValueError(
                f"n={params.n}: LLMEngine.add_request runs one completion per request; add "
                "one request per completion (LLM.generate does, with seed + i)"
            )
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise ValueError("the prompt is empty: it needs at least one token")
        ids = truncate_prompt(
            ids,
            params.truncate_prompt_tokens,
            self.max_model_len,
            self.scheduler.max_admit_tokens,
        )
        self._check_vocab("", ids)
        self._check_vocab("logit_bias: ", [t for t, _ in params.logit_bias])
        self._check_vocab("allowed_token_ids: ", params.allowed_token_ids or ())
        self._check_vocab("stop_token_ids: ", params.stop_token_ids)
        check_allowed_tokens(params, self.eos_token_ids)
        n, limit = len(ids), self.max_model_len
        if n >= limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens. However, your request "
                f"has {n} input tokens. Please reduce the length of the input messages."
            )
        if params.stop and self.tokenizer is None:
            raise ValueError(f"model {self.model!r} has no tokenizer.json: stop strings need one")
        bad_words = self._bad_words(params)
        serial = next(self._serial)
        rid = str(serial) if request_id is None else request_id
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        max_tokens = limit - n if params.max_tokens is None else min(params.max_tokens, limit - n)
        sched = Request.from_tokens(
            rid,
            self._now(),
            ids,
            max_output_tokens=max_tokens,
            ttft_slo=ttft_slo,
            tpot_slo=tpot_slo,
            priority=priority,
            cache_salt=cache_salt,
            # prompt logprobs need every prompt position run: no cache lookup
            prefix_caching=params.prompt_logprobs is None,
        )
        try:
            self.scheduler.add_request(sched)
        except SchedulerError as exc:
            raise ValueError(f"request cannot be served: {exc}") from None
        seed = params.seed if params.seed is not None else _derive_seed(self.seed, serial)
        detok = None
        if self.tokenizer is not None:
            detok = self.tokenizer.detokenizer(ids, skip_special_tokens=params.skip_special_tokens)
        self._requests[rid] = _RequestState(
            rid,
            prompt,
            ids,
            params,
            seed,
            sched,
            detok,
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=[] if params.prompt_logprobs is not None else None,
            bad_words=bad_words,
        )
        return rid

    def _bad_words(self, params: SamplingParams) -> tuple[tuple[int, ...], ...]:
        """``params.bad_words`` as checked token sequences (see ``resolve_bad_words``)."""
        if not params.bad_words:
            return ()
        tok = self.tokenizer
        if tok is None:
            raise ValueError(f"bad_words: model {self.model!r} has no tokenizer.json to read them")
        return resolve_bad_words(
            params,
            lambda word: tok.encode(word, add_special_tokens=False),
            self.eos_token_ids,
            self.config.vocab_size,
        )

    def _check_vocab(self, where: str, ids: Sequence[int]) -> None:
        """A ValueError naming the first of ``ids`` outside the vocabulary (``where``
        prefixes the message: the field, or nothing for the prompt)."""
        check_token_ids(where, ids, self.config.vocab_size)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request; returns its final output (``finish_reason="abort"``), or None
        if it is unknown or already finished."""
        st = self._requests.get(request_id)
        if st is None:
            return None
        self.scheduler.abort_request(request_id)
        if self.scheduler.get_request(request_id) is not None:
            return None  # its KV is freed when its in-flight batch ends (never here)
        st.finish_reason = "abort"
        return self._retire(request_id)

    def progress(self, request_id: str) -> RequestProgress | None:
        """What an unfinished request has produced so far, or None if it is unknown."""
        st = self._requests.get(request_id)
        if st is None:
            return None
        self._flush_text()
        return RequestProgress(
            st.output_ids, st.text, st.logprobs, st.sched.deadline, st.prompt_logprobs
        )

    def num_cached_tokens(self, request_id: str) -> int:
        """Prompt tokens an unfinished request found in the prefix cache when first
        admitted (0 if unknown or not admitted yet)."""
        st = self._requests.get(request_id)
        return 0 if st is None else st.cached_tokens or 0

    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache at admission, ever."""
        return self.scheduler.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        """Of :attr:`prefix_cache_queries`, tokens found cached (not computed)."""
        return self.scheduler.prefix_cache_hits

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use, 0 to 1."""
        return self.scheduler.memory.usage()

    def now(self) -> float:
        """The engine's clock (seconds), the one deadlines are measured on."""
        return self._now()

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    # ------------------------------------------------------------------- step
    def _now(self) -> float:
        return time.monotonic() - self._clock0

    def worker_failure(self) -> str | None:
        """Why the workers can run no more steps (a dead worker is looked for now), or None."""
        self.executor.check_workers()
        return self.executor.failed

    def _die(self, exc: BaseException) -> None:
        """The executor raised (a failed step, Ctrl-C): the batches in flight are lost,
        so every later call raises WorkerError instead of waiting for them."""
        self.dead = str(exc) if isinstance(exc, WorkerError) else f"{type(exc).__name__}: {exc}"

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise WorkerError(f"the engine is unusable after an earlier failure: {self.dead}")

    def step(self) -> list[RequestOutput]:
        """Advance until the oldest batch in flight ends; return the outputs of the
        requests it finished (``[]`` when there was nothing to run).

        Stream pipelining: up to :attr:`pipeline_depth` batches are in flight.
        A new batch is formed once the newest one cleared pipeline stage 0
        (``Scheduler.on_stage_end``): the next chunk of a prompt enters stage 0
        while the previous chunk runs on the later stages, and the driver forms
        and ships it while the ranks compute. Batches end in the order they were
        issued; their tokens are sampled on the last stage and checked here.
        """
        self._check_alive()
        while True:
            if self._may_issue() and not self._issue() and not self._inflight:
                self._flush_text()
                return self._idle()
            self._flush_text()  # the previous batch's text, while the ranks compute
            try:
                event = self.executor.next_event()
            except BaseException as exc:
                self._die(exc)
                raise
            if isinstance(event, StepDone):
                return self._end_batch(event)
            batch = self._inflight[event.step_id]
            if batch.cleared is None:  # async scheduling cleared it at submit
                batch.cleared = time.perf_counter()
                self.scheduler.on_stage_end(event.step_id)

    @property
    def pipeline_depth(self) -> int:
        """Batches in flight at most: the layout's ``spp`` (1 turns stream pipelining off);
        with async scheduling and spp = 1, 2 (the batch the model runs and the next one)."""
        depth = self._depth
        if depth is None:
            return 2 if self._async_one_stage else self.layout.spp
        return depth

    @pipeline_depth.setter
    def pipeline_depth(self, depth: int) -> None:
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise ValueError(f"pipeline_depth must be an integer >= 1, got {depth!r}")
        spp = self.layout.spp
        if self._async and spp > 1 and depth > return_slots(spp):
            # the last stage would block on a full token ring stage 0 no longer reads
            raise ValueError(
                f"pipeline_depth={depth} with async scheduling and spp={spp} exceeds the "
                f"{return_slots(spp)} batches the token return ring holds"
            )
        self._depth = depth

    def _may_issue(self) -> bool:
        inflight = self._inflight
        if not inflight:
            return True
        if len(inflight) >= self.pipeline_depth:
            return False
        return next(reversed(inflight.values())).cleared is not None

    def _idle(self) -> list[RequestOutput]:
        self._idle_steps += 1
        if self._requests and self._idle_steps % 10 == 0 and self.cost_feedback.rescue():
            return []  # the learned model had priced every chunk out of T
        if self._requests and self._idle_steps > 100:
            raise RuntimeError(
                f"the scheduler formed no batch for {self._idle_steps} steps with "
                f"{len(self._requests)} requests waiting (not enough KV memory?)"
            )
        return []

    def _issue(self) -> bool:
        """Form the next batch and ship it; False if the scheduler formed none."""
        t0 = time.perf_counter()
        start = self._now()
        out = self.scheduler.schedule(start)
        if out.is_empty:
            return False
        self._idle_steps = 0
        plan = self._plan(out)
        t1 = time.perf_counter()
        try:
            self.executor.submit(plan)
        except BaseException as exc:
            self._die(exc)
            raise
        batch = self._inflight[out.batch_id] = _InFlight(out, start, t0, t1)
        note = getattr(self.cost_model, "note_issued", None)
        if note is not None:  # with a batch in flight, the next one priced follows this one
            note(self.cost_feedback.issued(out))
        self.stats.max_in_flight = max(self.stats.max_in_flight, len(self._inflight))
        if self._async_one_stage:
            # The model runs batches in order and all of it is stage 0: once
            # shipped, the next batch may be formed (its decodes go one ahead).
            # With spp > 1 that waits for the batch to really clear stage 0
            # (StageCleared), whose ranks then wait for the last stage's tokens.
            batch.cleared = t1
            self.scheduler.on_stage_end(out.batch_id)
        return True

    def _plan(self, out: Any) -> StepPlan:
        """The batch as every rank's :class:`StepPlan` (counts it in :attr:`stats`)."""
        stats = self.stats
        stats.steps += 1
        stats.preemptions += len(out.preempted)
        chunks: list[PlannedChunk] = []
        append, requests, sample_spec = chunks.append, self._requests, self._sample_spec
        decodes = prefill = sharded = 0
        if out.decodes.count:  # the running decodes first (the scheduler's order)
            specs = self._specs
            for c in out.decodes.chunks:
                rid = c.request_id
                if len(c.token_ids) != 1:
                    raise RuntimeError(f"scheduler decode of {rid!r} carries no token id")
                if len(c.kvp_groups) > 1:
                    sharded += 1
                sample = specs.get(rid) or sample_spec(
                    requests[rid], ahead=int(c.token_ids[0] == PENDING_TOKEN)
                )
                append(PlannedChunk(rid, c.start, c.token_ids, c.kvp_groups, c.new_blocks, sample))
            decodes = len(chunks)
        for c in out.prefill_chunks:
            rid, start, n = c.request_id, c.start, c.num_tokens
            st = requests[rid]
            if len(c.token_ids) != n:
                raise RuntimeError(f"scheduler chunk of {rid!r} carries no token ids")
            if st.cached_tokens is None:  # its first chunk: admitted in this batch
                st.cached_tokens = min(st.sched.num_cached_tokens, st.sched.num_prompt_tokens)
            if len(c.kvp_groups) > 1:
                sharded += 1
            if start >= st.sched.num_prefill_tokens:  # a decode: no prompt logprobs
                decodes += 1
                prompt_spec = None
            else:
                prefill += n
                prompt_spec = self._prompt_spec(st, start, n)
            sample = sample_spec(st) if c.samples else None
            append(
                PlannedChunk(
                    rid, start, c.token_ids, c.kvp_groups, c.new_blocks, sample, prompt_spec
                )
            )
        stats.decode_tokens += decodes
        stats.prefill_tokens += prefill
        stats.sharded_chunks += sharded
        plan = StepPlan(
            out.batch_id,
            tuple(chunks),
            free=tuple(out.preempted) + tuple(self._pending_free),
            finished=tuple(self._pending_finished),
        )
        self._pending_free, self._pending_finished = [], []
        return plan

    def _end_batch(self, event: StepDone) -> list[RequestOutput]:
        """The oldest batch left the pipeline: tokens in, stops checked, finished requests out."""
        t2 = time.perf_counter()
        batch = self._inflight.pop(event.step_id)
        out = batch.out
        sampled = self._take_prompt_logprobs(event.result)
        seconds = t2 - batch.submitted
        # the batch's own execution: with async scheduling it waited behind the
        # previous one after submit; run inline (in submit), the driver then
        # detokenized the previous batch's text before asking for this one
        own = event.stage_s and (
            self._async_one_stage or getattr(self.executor, "inline_step", None) == event.step_id
        )
        if own:
            seconds = event.stage_s[0]
        self.cost_feedback.record(out, seconds, event.stage_s)
        self._follow_budget()
        rows = [c for c in out.chunks if c.samples]
        if len(sampled) != len(rows):
            raise RuntimeError(f"step {out.batch_id}: {len(sampled)} samples for {len(rows)} rows")
        tokens: dict[str, int] = {}
        stopped: set[str] = set()
        dropped = self._dropped
        for c, s in zip(rows, sampled, strict=True):
            rid = c.request_id
            if dropped and dropped.get(rid, -1) >= out.batch_id:
                continue  # finished when an earlier batch ended: a decode issued ahead
            tokens[rid] = s.token_id
            st = self._requests[rid]
            if s.error is not None:  # it ends now, as a stop token would end it
                st.finish_reason, st.error = "error", s.error
                stopped.add(rid)
                logger.warning("request %s failed: %s", rid, s.error)
            elif self._append(st, s):
                stopped.add(rid)
        if dropped:
            for rid in [r for r, b in dropped.items() if b <= out.batch_id]:
                del dropped[rid]
        done = self.scheduler.on_batch_end(out.batch_id, BatchResult(tokens, frozenset(stopped)))
        if self._step_log is not None:
            t3 = time.perf_counter()
            if own:
                # execute_s: the batch's own seconds, then the read-back
                t3, t2 = batch.submitted + seconds + (t3 - t2), batch.submitted + seconds
            marks = (batch.scheduled, batch.submitted, t2, t3)
            # SPP > 1: the stage times the cost model measures itself against
            stages = event.stage_s if len(event.stage_s) > 1 else ()
            if stages and self.cost_feedback.measured(seconds, stages) is None:
                stages = ()
            self._step_log.record(out, marks, batch.start, stages)
        outputs = []
        for rid in done:
            st = self._requests[rid]
            status = st.sched.status
            if st.finish_reason is None:
                if status is RequestStatus.FINISHED_LENGTH:
                    st.finish_reason = "length"
                elif status is RequestStatus.FINISHED_ABORTED:
                    st.finish_reason = "abort"
                else:
                    st.finish_reason = "stop"
            outputs.append(self._retire(rid))
        return outputs

    def _retire(self, rid: str) -> RequestOutput:
        self._flush_text()
        self._specs.pop(rid, None)
        st = self._requests.pop(rid)
        if self._async and self._inflight:
            self._dropped[rid] = next(reversed(self._inflight))  # may hold a decode of it
        if st.detok is not None and not isinstance(st.stop_reason, str):
            st.text += st.detok.flush()  # held-back bytes (a stop string already cut the text)
        self._pending_free.append(rid)
        self._pending_finished.append(rid)
        return self.output(st)

    def output(self, st: _RequestState) -> RequestOutput:
        logprobs = st.params.logprobs is not None
        completion = CompletionOutput(
            index=0,
            text=st.text,
            token_ids=list(st.output_ids),
            cumulative_logprob=st.cumulative_logprob if logprobs else None,
            logprobs=[dict(e) for e in st.logprobs] if st.logprobs is not None else None,
            finish_reason=st.finish_reason,
            stop_reason=st.stop_reason,
            error=st.error,
        )
        prompt_lps = None
        if st.prompt_logprobs is not None:
            prompt_lps = [None, *(dict(e) for e in st.prompt_logprobs)]
        return RequestOutput(
            request_id=st.request_id,
            prompt=st.prompt,
            prompt_token_ids=list(st.prompt_token_ids),
            outputs=[completion],
            finished=st.finish_reason is not None,
            num_preemptions=st.sched.num_preemptions,
            prompt_logprobs=prompt_lps,
            num_cached_tokens=st.cached_tokens or 0,
        )

    def _sample_spec(self, st: _RequestState, ahead: int = 0) -> SampleSpec:
        """The request's sampling for its next token (the same object once it no longer
        changes: past ``min_tokens`` and with the token history sent). ``ahead``:
        tokens of it still in flight (1 for a decode issued ahead), counted
        toward ``min_tokens``."""
        spec = self._specs.get(st.request_id)
        if spec is not None:
            return spec
        p = st.params
        suppress: tuple[int, ...] = ()
        if len(st.output_ids) + ahead < p.min_tokens:
            ids = stop_tokens(p, self.eos_token_ids)
            suppress = tuple(sorted(t for t in ids if t < self.config.vocab_size))
        top_k = p.top_k if p.top_k > 0 else 0
        penalties = history = None
        if p.penalized:
            penalties = Penalties(p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
        needs_history = p.penalized or any(len(w) > 1 for w in st.bad_words)
        if needs_history and not st.history_sent:
            history = (tuple(st.prompt_token_ids), tuple(st.output_ids))
            st.history_sent = True
        spec = SampleSpec(
            st.request_id,
            p.temperature,
            top_k,
            p.top_p,
            st.seed,
            p.logprobs,
            suppress,
            min_p=p.min_p,
            logit_bias=p.logit_bias,
            penalties=penalties,
            history=history,
            allowed=p.allowed_token_ids or (),
            bad_words=st.bad_words,
        )
        if not suppress and history is None:
            self._specs[st.request_id] = spec
        return spec

    def _prompt_spec(self, st: _RequestState, start: int, n: int) -> PromptLogprobSpec | None:
        """The prompt logprobs a chunk ``[start, start + n)`` yields, if still wanted.

        Only a chunk holding the first position not asked for yet asks; a chunk
        wholly before it (answered, or in flight) does not. A recompute after
        preemption may be chunked otherwise: its chunk holding that position
        asks from its own start (the rows a spec answers begin at the chunk's
        first), and :meth:`_take_prompt_logprobs` keeps only the new entries.
        """
        if st.prompt_logprobs is None:
            return None
        last = len(st.prompt_token_ids) - 1  # the last prompt token predicts no prompt token
        if not start <= st.prompt_logprobs_asked < min(start + n, last):
            return None
        end = min(start + n, last)
        st.prompt_logprobs_asked = end
        targets = tuple(st.prompt_token_ids[start + 1 : end + 1])
        return PromptLogprobSpec(st.params.prompt_logprobs or 0, targets)

    def _take_prompt_logprobs(self, results: list) -> list[Sampled]:
        """Record the step's :class:`PromptLogprobs` (they follow the sampled rows)."""
        sampled = []
        for r in results:
            if isinstance(r, PromptLogprobs):
                st = self._requests.get(r.request_id)
                logprobs = None if st is None else st.prompt_logprobs
                if logprobs is not None and r.start <= len(logprobs):
                    logprobs.extend(r.entries[len(logprobs) - r.start :])
            else:
                sampled.append(r)
        return sampled

    def _append(self, st: _RequestState, s: Sampled) -> bool:
        """Record a sampled token; True when it stops the request."""
        p = st.params
        tok = s.token_id
        st.output_ids.append(tok)
        if st.logprobs is not None and s.logprob is not None:
            entry = {tok: s.logprob}
            for alt, lp in s.top:
                entry.setdefault(alt, lp)
            st.logprobs.append(entry)
            st.cumulative_logprob += s.logprob
        checks = len(st.output_ids) >= p.min_tokens
        eos = checks and not p.ignore_eos and tok in self.eos_token_ids
        if eos or (checks and tok in p.stop_token_ids):
            st.finish_reason, st.stop_reason = "stop", None if eos else tok
            # vLLM's rule: a stop token's text is kept only with include_stop_str_in_output
            if p.include_stop_str_in_output and st.detok is not None:
                if p.stop:  # the text is up to date
                    st.text += st.detok.add([tok])
                else:
                    self._text_backlog.append((st, tok))
            return True
        if st.detok is None:
            return False
        if not p.stop:  # no stop string to look for: the text can wait for _flush_text
            self._text_backlog.append((st, tok))
            return False
        new = st.detok.add([tok])
        if not new:
            return False
        st.text += new
        if checks:
            return self._check_stop_strings(st, len(new))
        return False

    def _flush_text(self) -> None:
        """Detokenize the tokens whose text was left for later (the engine does it
        while the model runs the next batch)."""
        backlog = self._text_backlog
        if not backlog:
            return
        self._text_backlog = []
        for st, tok in backlog:
            st.text += st.detok.add([tok])  # type: ignore[union-attr]

    @staticmethod
    def _check_stop_strings(st: _RequestState, new_len: int) -> bool:
        text = st.text
        best: tuple[int, str] | None = None
        for s in st.params.stop:
            begin = max(0, len(text) - new_len - len(s) + 1)
            at = text.find(s, begin)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, s)
        if best is None:
            return False
        at, s = best
        st.text = text[: at + len(s)] if st.params.include_stop_str_in_output else text[:at]
        st.finish_reason, st.stop_reason = "stop", s
        return True

    # --------------------------------------------------------------- shutdown
    def shutdown(self) -> None:
        if self._step_log is not None:
            self._step_log.close()
        feedback = getattr(self, "cost_feedback", None)
        if feedback is not None:
            feedback.save()
        self.executor.shutdown()


def _derive_seed(seed: int, serial: int) -> int:
    """A per-request seed from the engine's seed and the request's serial number."""
    x = (seed * 0x9E3779B97F4A7C15 + serial * 0xBF58476D1CE4E5B9 + 1) & 0xFFFF_FFFF_FFFF_FFFF
    x ^= x >> 31
    return (x * 0x94D049BB133111EB) & 0x7FFF_FFFF_FFFF_FFFF
