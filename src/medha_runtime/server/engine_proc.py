"""The engine process: owns the :class:`~medha_runtime.engine.LLMEngine`, never serves HTTP.

The HTTP process talks to it over two ZeroMQ PUSH/PULL sockets on ``ipc://``
paths, with the plain dataclasses of :mod:`medha_runtime.server.messages`
(heartbeats and pulses every ``HEARTBEAT_S``). This module imports no torch
at its top (the HTTP process imports it to start the engine process); the
engine is imported inside :func:`engine_main`.

The loop: drain incoming messages, run one ``step()`` when there is work,
send every request's new tokens. A request's text is held back by the
longest stop string minus one character so streamed text never has to be
taken back when a stop string completes.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from medha_runtime.config import EngineConfig
from medha_runtime.server.messages import (
    AbortRequest,
    AddAccepted,
    AddFailed,
    AddRequest,
    Alive,
    EngineFailed,
    EngineReady,
    EngineStopped,
    Heartbeat,
    ModelInfo,
    RequestDelta,
    Shutdown,
    TokenizerData,
)
from medha_runtime.server.pulse import Pulse

__all__ = [
    "AbortRequest",
    "AddAccepted",
    "AddFailed",
    "AddRequest",
    "Alive",
    "EngineArgs",
    "EngineFailed",
    "EngineReady",
    "Heartbeat",
    "RequestDelta",
    "Shutdown",
    "engine_main",
]

#: seconds between heartbeats
HEARTBEAT_S = 0.25


@dataclass(frozen=True, kw_only=True)
class EngineArgs:
    """What the engine process builds: an :class:`~medha_runtime.config.EngineConfig`
    (validated when made) plus the server's admission mode.

    ``engine.distributed`` (multi-node or torchrun) makes the engine process
    rank 0 of a ``torch.distributed`` world of ``tp * spp * kvp`` ranks.
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    #: "accept" runs every request; "reject" refuses requests predicted to miss their TTFT SLO
    admission: str = "accept"

    def __post_init__(self) -> None:
        if not isinstance(self.engine, EngineConfig):
            raise ValueError(f"engine must be an EngineConfig, got {self.engine!r}")
        if self.admission not in ("accept", "reject"):
            raise ValueError(f"admission must be 'accept' or 'reject', got {self.admission!r}")

    @property
    def model(self) -> str:
        return self.engine.model


# --------------------------------------------------------------------- loop
@dataclass
class _Track:
    num_prompt_tokens: int
    holdback: int
    tokens_sent: int = 0
    chars_sent: int = 0
    first_sent: bool = False


def engine_main(args: EngineArgs, in_addr: str, out_addr: str, parent_pid: int) -> None:
    """Entry point of the engine process (started with the spawn method)."""
    import zmq

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the HTTP process decides when to stop
    stopping = False

    def _on_term(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _on_term)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(in_addr)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(out_addr)

    def send(msg: object) -> None:
        push.send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    engine = None
    pulse = None
    dead = False
    try:
        from medha_runtime.engine import LLMEngine

        try:
            engine = LLMEngine(args.engine)
        except BaseException as exc:
            send(EngineFailed(_start_failure(exc)))
            return
        send(
            EngineReady(
                model=args.model,
                max_model_len=engine.max_model_len,
                pid=os.getpid(),
                dtype=engine.dtype,
                layout=str(engine.layout),
                info=_model_info(engine),
                tokenizer=_tokenizer_data(engine.tokenizer),
            )
        )
        pulse = Pulse(ctx, out_addr, Alive(), period_s=HEARTBEAT_S)
        taker = _snapshot_taker(engine) if args.admission == "reject" else None
        _loop(engine, pull, send, parent_pid, lambda: stopping, taker)
        if stopping:  # SIGTERM, not the HTTP process's Shutdown: it must stop too
            send(EngineStopped())
    except _EngineDead as exc:  # the workers are gone: one line, no traceback
        print(f"medha-runtime engine: {exc}", file=sys.stderr, flush=True)
        dead = True
    except BaseException:
        with contextlib.suppress(Exception):
            send(EngineFailed(traceback.format_exc()))
        raise
    finally:
        if pulse is not None:
            pulse.stop()
        if engine is not None:
            with contextlib.suppress(Exception):
                engine.shutdown()
        pull.close(linger=0)
        push.close(linger=500)
        ctx.term()
    # everything is shut down and saved: skip the interpreter's teardown, which takes
    # seconds once torch is loaded (the server must stop within a few seconds)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if dead else 0)


def _model_info(engine: Any) -> ModelInfo:
    """The start-up summary's facts about a built engine."""
    cache = engine.cache
    return ModelInfo(
        device=str(engine.spec.device),
        policy=str(engine.scheduler_config.policy),
        cost_model=type(engine.cost_model).__name__,
        target_batch_time=float(engine.scheduler_config.target_batch_time),
        kv_pool_tokens=int(cache.num_blocks_per_group * cache.block_size),
        kvp_group_tokens=int(cache.max_tokens_per_group),
        block_size=int(cache.block_size),
        vocab_size=int(engine.config.vocab_size),
        cuda_graph_max_batch=int(engine.spec.cuda_graph_max_batch),
        async_scheduling=bool(engine.scheduler_config.async_decodes),
        sampling_defaults=tuple(engine.resolved.sampling_defaults.items()),
        max_prompt_tokens=int(engine.scheduler.max_admit_tokens),
    )


def _tokenizer_data(tokenizer: Any) -> TokenizerData | None:
    """The engine's tokenizer as plain data for the HTTP process (None: the model has none)."""
    if tokenizer is None:
        return None
    return TokenizerData(
        json=tokenizer.tokenizer.to_str(),
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
        chat_template=tokenizer.chat_template,
        stop_token_ids=tuple(tokenizer.stop_token_ids),
    )


class _EngineDead(RuntimeError):
    """The engine cannot go on (its workers failed); every request was ended."""


def _loop(engine: Any, pull: Any, send: Any, parent_pid: int, stop: Any, taker: Any = None) -> None:
    import zmq

    from medha_runtime.executor import WorkerError

    tracks: dict[str, _Track] = {}
    last_beat = 0.0
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    while not stop():
        busy = engine.has_unfinished_requests()
        events = dict(poller.poll(0 if busy else 20))
        if pull in events:
            while True:
                try:
                    raw = pull.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                msg = pickle.loads(raw)
                if isinstance(msg, Shutdown):
                    return
                if isinstance(msg, AddRequest):
                    _add(engine, msg, tracks, send)
                elif isinstance(msg, AbortRequest):
                    tracks.pop(msg.request_id, None)
                    engine.abort_request(msg.request_id)
        now = time.monotonic()
        if now - last_beat >= HEARTBEAT_S:
            last_beat = now
            if os.getppid() != parent_pid:  # the HTTP process is gone
                return
            failed = engine.worker_failure()  # one that died while idle is seen here
            if failed is not None and stop():
                return  # SIGTERM to the whole process group: the workers stopped with us
            if failed is not None:
                _fail_all(engine, tracks, send, f"the workers failed: {failed}")
                raise _EngineDead(f"the workers failed: {failed}")
            taker = _current_taker(engine, taker)
            send(_heartbeat(engine, taker=taker, tracks=tracks))
        if not engine.has_unfinished_requests():
            continue
        try:
            finished = {o.request_id: o for o in engine.step()}
        except Exception as exc:
            if isinstance(exc, WorkerError) and stop():
                # SIGTERM to the whole process group (systemctl stop, kill -TERM -PGID): it
                # reached this process before its workers died of it, so this is a stop
                return
            _fail_all(engine, tracks, send, f"engine step failed: {type(exc).__name__}: {exc}")
            if isinstance(exc, WorkerError):
                raise _EngineDead(f"engine step failed: {exc}") from None
            raise
        _emit(engine, tracks, finished, send)


def _fail_all(engine: Any, tracks: dict[str, _Track], send: Any, message: str) -> None:
    """End every request with ``message`` and tell the HTTP process the engine is dead."""
    for rid, t in tracks.items():
        send(RequestDelta(rid, [], "", t.num_prompt_tokens, 0, "abort", error=message))
    tracks.clear()
    send(_heartbeat(engine, error=message))


def _add(engine: Any, msg: AddRequest, tracks: dict[str, _Track], send: Any) -> None:
    kw: dict[str, Any] = {
        "prompt": msg.prompt,
        "request_id": msg.request_id,
        "ttft_slo": msg.ttft_slo_s,
        "tpot_slo": msg.tpot_slo_s,
        "priority": msg.priority,
        "cache_salt": msg.cache_salt,
    }
    try:
        engine.add_request(msg.prompt_token_ids, msg.params, **kw)
    except ValueError as exc:
        send(AddFailed(msg.request_id, str(exc)))
        return
    except Exception as exc:
        send(AddFailed(msg.request_id, f"{type(exc).__name__}: {exc}", bad_request=False))
        return
    if msg.ack:
        send(AddAccepted(msg.request_id))
    hold = max((len(s) for s in msg.params.stop), default=1) - 1
    tracks[msg.request_id] = _Track(len(msg.prompt_token_ids), hold)


def _emit(engine: Any, tracks: dict[str, _Track], finished: dict[str, Any], send: Any) -> None:
    for rid in list(tracks):
        t = tracks[rid]
        out = finished.get(rid)
        if out is not None:
            comp = out.outputs[0]
            ids, text, logprobs = comp.token_ids, comp.text, comp.logprobs
            reason, stop_reason = comp.finish_reason, comp.stop_reason
            visible, error = text, comp.error
        else:
            st = engine.progress(rid)
            if st is None:
                continue
            ids, text, logprobs = st.output_ids, st.text, st.logprobs
            reason = stop_reason = error = None
            visible = text[: len(text) - t.holdback] if t.holdback else text
        new_ids = list(ids[t.tokens_sent :])
        new_text = visible[t.chars_sent :] if len(visible) > t.chars_sent else ""
        if not new_ids and not new_text and reason is None:
            continue  # a prefill chunk: nothing to say yet
        deadline_met = None
        prompt_lps = None
        cached = 0
        if not t.first_sent and new_ids:
            t.first_sent = True
            cached = engine.num_cached_tokens(rid) if out is None else out.num_cached_tokens
            progress = engine.progress(rid)
            if progress is not None:
                deadline_met = engine.now() <= progress.deadline
                if progress.prompt_logprobs is not None:
                    prompt_lps = [None, *(dict(e) for e in progress.prompt_logprobs)]
            elif out is not None:
                prompt_lps = out.prompt_logprobs
        new_lp = None
        if logprobs is not None:
            new_lp = [dict(e) for e in logprobs[t.tokens_sent : len(ids)]]
        t.tokens_sent = len(ids)
        t.chars_sent += len(new_text)
        send(
            RequestDelta(
                rid,
                new_ids,
                new_text,
                t.num_prompt_tokens,
                len(ids),
                reason,
                stop_reason,
                new_lp,
                deadline_met,
                error,
                prompt_logprobs=prompt_lps,
                num_cached_tokens=cached,
            )
        )
        if reason is not None:
            del tracks[rid]


def _heartbeat(
    engine: Any, error: str | None = None, *, taker: Any = None, tracks: Any = None
) -> Heartbeat:
    sched = engine.scheduler
    feedback = engine.cost_feedback
    queue = None
    if taker is not None and tracks is not None:
        requests = [r for r in map(sched.get_request, tracks) if r is not None]
        queue = taker.take(
            requests, now=time.monotonic(), engine_now=engine.now(), overhead=feedback.overhead
        )
    return Heartbeat(
        num_running=sched.num_running,
        num_waiting=sched.num_waiting,
        kv_cache_usage=float(engine.kv_cache_usage),
        num_preemptions=int(engine.stats.preemptions),
        steps=int(engine.stats.steps),
        error=error,
        prediction_errors=feedback.drain(),
        median_prediction_error=feedback.median_error,
        queue=queue,
        prefill_tokens=int(engine.stats.prefill_tokens),
        decode_tokens=int(engine.stats.decode_tokens),
        prefix_cache_queries=int(engine.prefix_cache_queries),
        prefix_cache_hits=int(engine.prefix_cache_hits),
    )


def _snapshot_taker(engine: Any) -> Any:
    """What predictive admission needs from the engine (see :mod:`medha_sched.admission`)."""
    from medha_sched.admission import SnapshotTaker

    cfg = engine.scheduler_config
    return SnapshotTaker(
        engine.cost_model,
        engine.scheduler.prefill_times,
        target_time=cfg.target_batch_time,
        token_grid=cfg.token_grid,
        max_chunk_tokens=cfg.max_chunk_tokens,
        group_token_limit=engine.cache.group_token_limit,
        max_tokens=engine.max_model_len,
    )


def _current_taker(engine: Any, taker: Any) -> Any:
    """``taker``, or a new one if the engine's automatic budget T moved since it was
    built (the scheduler then has a new prefill-time table); None stays None."""
    if taker is None or taker.target_time == engine.scheduler_config.target_batch_time:
        return taker
    return _snapshot_taker(engine)


def _start_failure(exc: BaseException) -> str:
    """One line for the user: a model that cannot be loaded says why in its own words
    (its message names the file); anything else also names the exception's type."""
    from medha_runtime.model.errors import ModelLoadError

    if isinstance(exc, ModelLoadError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
