"""The offline API, shaped like vLLM's ``LLM``::

    from medha_runtime import LLM, SamplingParams

    with LLM("tiny") as llm:
        outputs = llm.generate(["Hello", "The sky"], SamplingParams(temperature=0, max_tokens=8))
        print(outputs[0].outputs[0].text, outputs[0].outputs[0].token_ids)

With ``tp * spp * kvp == 1`` the model runs in the calling process; otherwise
one worker process per rank (see :mod:`medha_runtime.executor`). Workers stop
on :meth:`LLM.shutdown`, on leaving a ``with`` block, when the object is
garbage-collected, and at interpreter exit. Scripts that use several ranks
need the usual ``if __name__ == "__main__":`` guard (workers are started
with the forkserver method).
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, cast

from medha_runtime.config import OFFLINE_THROUGHPUT_CHUNK, EngineConfig
from medha_runtime.engine import LLMEngine
from medha_runtime.outputs import RequestOutput
from medha_runtime.sampling import SamplingParams
from medha_runtime.tokenizer import (
    Tokenizer,
    join_text_parts,
    read_chat_template,
    template_variables,
)

Prompt = str | Sequence[int] | Mapping[str, Any]


class LLM:
    """Generate from a Llama-family model with Medha's scheduler.

    ``LLM(model, **engine_args)`` or ``LLM(EngineConfig(...))``: every keyword is
    a field of :class:`~medha_runtime.config.EngineConfig`, which documents them
    (``dtype``, ``tp``, ``spp``, ``kvp``, ``kvp_group_tokens``, ``policy``,
    ``target_batch_time``, ``chunk_size``, ``throughput_chunk``, ``token_grid``,
    ``max_batch_requests``, ``max_model_len``, ``kv_cache_tokens``, ``block_size``, ``seed``,
    ``cost_model``, ``cost_model_out``, ``device``, ``timeout_s``,
    ``attention_backend``, ``num_threads``, ``enable_prefix_caching``,
    ``step_log``, ``distributed``, ``async_scheduling``, ``cuda_graphs``,
    ``chat_template``, ``generation_config``). An unknown
    keyword is refused.

    Offline generation favours throughput: unless ``throughput_chunk`` is
    given, the automatic budget fits a prefill chunk of
    :data:`~medha_runtime.config.OFFLINE_THROUGHPUT_CHUNK` tokens (the server
    keeps the 50 ms default). Pass ``throughput_chunk=None`` for the server's
    latency-bounded budget, or ``target_batch_time`` to set it.

    Args:
        model: a local Hugging Face model directory, a ``.gguf`` file,
            ``"smollm2"`` (SmolLM2-135M-Instruct, fetched once into the Medha
            cache), a hub id in the local Hugging Face cache, ``"tiny"``
            (the built-in model with RANDOM weights: its text is gibberish),
            or a whole :class:`~medha_runtime.config.EngineConfig`.
        num_threads: torch CPU threads per rank (default: cores divided by
            the ranks on this node; with one rank, torch's current setting).
    """

    def __init__(
        self, model: str | os.PathLike[str] | EngineConfig = "tiny", **engine_args: Any
    ) -> None:
        if not isinstance(model, EngineConfig):  # offline: favour throughput
            engine_args.setdefault("throughput_chunk", OFFLINE_THROUGHPUT_CHUNK)
        self.engine = LLMEngine(EngineConfig.build(model, **engine_args))
        self._finalizer = weakref.finalize(self, LLMEngine.shutdown, self.engine)

    # --------------------------------------------------------------- lifecycle
    def shutdown(self) -> None:
        """Stop the workers (idempotent)."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        e = self.engine
        return (
            f"LLM(model={e.model!r}, dtype={e.dtype!r}, tp={e.layout.tp}, spp={e.layout.spp}, "
            f"kvp={e.layout.kvp}, max_model_len={e.max_model_len})"
        )

    # ------------------------------------------------------------------ queries
    def get_tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    # ------------------------------------------------------------------ generate
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
    ) -> list[RequestOutput]:
        """Complete every prompt; one :class:`RequestOutput` per prompt, in order.

        Args:
            prompts: a string, a list of token ids, a list of either, or
                ``{"prompt": str}`` / ``{"prompt_token_ids": [...]}`` dicts; a
                dict's ``"cache_salt"`` (a non-empty string, vLLM's key) lets
                the prompt hit only prefix-cache blocks of prompts with the
                same salt.
            sampling_params: one for all prompts, one per prompt, or None
                (:meth:`get_default_sampling_params`: ``SamplingParams()``,
                temperature 1 and 16 tokens, with the model's generation
                config's defaults).
            use_tqdm: a progress bar on stderr as requests finish, with the
                input and output tokens per second (vLLM's); or a callable that
                makes the bar (``tqdm``'s arguments); False for none.
        """
        if self._finalizer.alive is False:
            raise RuntimeError("this LLM was shut down")
        items = _normalize_prompts(prompts)
        params = self._params(sampling_params, len(items))
        engine = self.engine
        encoded = []
        for text, ids, salt in items:
            encoded.append((text, engine.encode(text) if ids is None else ids, salt))
        rids: list[str] = []  # every engine request, in order
        groups: list[list[str]] = []  # each prompt's n requests
        try:
            for (text, ids, salt), p in zip(encoded, params, strict=True):
                groups.append([])
                for sub in _completions(p):
                    rids.append(engine.add_request(ids, sub, prompt=text, cache_salt=salt))
                    groups[-1].append(rids[-1])
            done = self._run(rids, use_tqdm)
            return [_merge([done[rid] for rid in group]) for group in groups]
        except BaseException:
            for rid in rids:
                if engine.dead is None:
                    engine.abort_request(rid)
            raise

    def _run(
        self, rids: Sequence[str], use_tqdm: bool | Callable[..., Any]
    ) -> dict[str, RequestOutput]:
        """Step the engine until every one of ``rids`` finished; their outputs by id.

        Outputs of other requests are dropped: those of an earlier call that was
        interrupted, aborted while in flight, finish (``"abort"``) in a later step.
        """
        wanted, done = set(rids), {}
        with _Progress(use_tqdm, len(wanted)) as progress:
            while len(done) < len(wanted):
                for out in self.engine.step():
                    if out.request_id in wanted:
                        done[out.request_id] = out
                        progress.finished(out)
        return done

    def _params(self, given: object, count: int) -> list[SamplingParams]:
        """``generate``'s sampling params, one per prompt (ValueError naming a bad one)."""
        if given is None:
            return [self.get_default_sampling_params()] * count
        if isinstance(given, SamplingParams):
            return [given] * count
        if isinstance(given, Mapping) or not isinstance(given, Sequence):
            _check_params(given)
        params = list(given)  # type: ignore[call-overload]
        for p in params:
            _check_params(p)
        if len(params) != count:
            raise ValueError(
                f"got {len(params)} sampling params for {count} prompts; pass one, "
                "or one per prompt"
            )
        return params

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the fields the model's generation config sets
        (``EngineConfig.generation_config``; vLLM's method of the same name)."""
        return SamplingParams(**self.engine.resolved.sampling_defaults)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them (the model's chat template,
        or ``chat_template``: a Jinja file's path or the Jinja text, as ``EngineConfig``'s).

        A message is ``{"role": str, "content": str}``; ``content`` may also be a
        list of OpenAI text parts (``{"type": "text", "text": str}``), joined one per
        line, as the server and vLLM join them.
        Other keys (``name``...) go to the template as they are.
        ``continue_final_message`` (with ``add_generation_prompt=False``) ends the
        prompt after the last message's content, so the model continues it;
        ``chat_template_kwargs`` are extra template variables (``enable_thinking``...).
        Each output's ``prompt`` is the rendered template text (vLLM's).
        """
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError(f"model {self.engine.model!r} has no tokenizer: chat needs one")
        if chat_template is not None:
            tokenizer = tokenizer.with_chat_template(read_chat_template(chat_template))
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise ValueError(
                "chat takes a conversation (a list of {'role': ..., 'content': ...} messages) "
                f"or a list of them, got {messages!r}; generate() takes plain prompts"
            )
        if messages and isinstance(messages[0], Mapping):
            conversations = [messages]
        else:
            conversations = list(messages)  # type: ignore[arg-type]
        prompts: list[Prompt] = []
        for i, conv in enumerate(conversations):
            text = cast(
                str,
                tokenizer.apply_chat_template(
                    _conversation(conv, i),
                    add_generation_prompt=add_generation_prompt,
                    tokenize=False,
                    continue_final_message=continue_final_message,
                    **template_variables(chat_template_kwargs),
                ),
            )
            # templates emit BOS themselves: no special tokens added (as tokenize=True)
            ids = tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)


def _check_params(p: object) -> None:
    """A ValueError unless ``p`` is a SamplingParams (a dict is named as one)."""
    if isinstance(p, Mapping):
        raise ValueError(
            f"sampling params must be SamplingParams, got a dict ({dict(p)!r}): "
            "pass SamplingParams(**it)"
        )
    if not isinstance(p, SamplingParams):
        raise ValueError(f"sampling params must be SamplingParams, got {p!r}")


def _completions(params: SamplingParams) -> list[SamplingParams]:
    """One engine request's params per completion (:meth:`SamplingParams.completion`)."""
    return [params.completion(i) for i in range(params.n)]


def _merge(outs: list[RequestOutput]) -> RequestOutput:
    """A prompt's completions (one engine request each) as one output: the first
    request's, with every completion (``index`` 0..n-1) and their preemptions."""
    if len(outs) == 1:
        return outs[0]
    completions = [replace(o.outputs[0], index=i) for i, o in enumerate(outs)]
    preemptions = sum(o.num_preemptions for o in outs)
    return replace(outs[0], outputs=completions, num_preemptions=preemptions)


def _conversation(conv: object, i: int) -> list[dict[str, Any]]:
    """``conv``'s messages checked, text parts joined (ValueError naming the bad one)."""
    if isinstance(conv, (str, bytes, Mapping)) or not isinstance(conv, Sequence):
        raise ValueError(f"conversation {i} must be a list of messages, got {conv!r}")
    out = []
    for j, message in enumerate(conv):
        at = f"conversation {i}, message {j}"
        if not isinstance(message, Mapping):
            raise ValueError(f"{at} must be a dict with 'role' and 'content', got {message!r}")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise ValueError(f"{at}: 'role' must be a non-empty string, got {role!r}")
        if isinstance(content, Sequence) and not isinstance(content, str):
            for k, part in enumerate(content):
                kind = part.get("type") if isinstance(part, Mapping) else None
                if kind != "text" or not isinstance(part.get("text"), str):  # type: ignore[union-attr]
                    raise ValueError(
                        f"{at}: content part {k} must be {{'type': 'text', 'text': str}} "
                        f"(only text is supported), got {part!r}"
                    )
            content = join_text_parts(content)  # type: ignore[arg-type]
        elif not isinstance(content, str):
            raise ValueError(
                f"{at}: 'content' must be a string or a list of text parts, got {content!r}"
            )
        out.append({**message, "content": content})
    return out


_Item = tuple[str | None, list[int] | None, str | None]


def _normalize_prompts(prompts: Any) -> list[_Item]:
    """``[(text or None, ids or None, cache_salt or None)]`` with text or ids set."""
    single_ids = isinstance(prompts, Sequence) and bool(prompts) and _is_token(prompts[0])
    if isinstance(prompts, (str, Mapping)) or single_ids:
        prompts = [prompts]
    if not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, bytearray)):
        raise ValueError(f"prompts must be a string, token ids, or a list of them, got {prompts!r}")
    if not prompts:
        raise ValueError("no prompts given")
    out: list[_Item] = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            out.append((p, None, None))
        elif isinstance(p, Mapping):
            out.append(_dict_prompt(p, i))
        else:
            out.append((None, _token_list(p, i), None))
    return out


_DICT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")


def _dict_prompt(p: Mapping[str, Any], i: int) -> _Item:
    unknown = sorted(str(k) for k in p if k not in _DICT_KEYS)
    if unknown:  # multi_modal_data, a misspelt key...: refused, not ignored
        raise ValueError(
            f"prompt {i}: unsupported key(s) {', '.join(unknown)}; a dict takes "
            "'prompt' and/or 'prompt_token_ids', and 'cache_salt'"
        )
    salt = p.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"prompt {i}: cache_salt must be a non-empty string, got {salt!r}")
    if "prompt_token_ids" in p:
        return p.get("prompt"), _token_list(p["prompt_token_ids"], i), salt
    if "prompt" in p and not isinstance(p["prompt"], str):
        raise ValueError(f"prompt {i}: 'prompt' must be a string, got {p['prompt']!r}")
    if "prompt" in p:
        return p["prompt"], None, salt
    raise ValueError(f"prompt {i}: a dict needs 'prompt' or 'prompt_token_ids'")


def _is_token(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _token_list(p: object, i: int) -> list[int]:
    if not isinstance(p, Sequence) or isinstance(p, str) or not all(_is_token(t) for t in p):
        raise ValueError(f"prompt {i} must be a string or a list of token ids, got {p!r}")
    return [int(t) for t in p]


class _Progress:
    """``generate``'s progress bar: requests finished, and the input and output tokens
    per second so far (nothing when ``use_tqdm`` is False)."""

    def __init__(self, use_tqdm: bool | Callable[..., Any], total: int) -> None:
        if not (isinstance(use_tqdm, bool) or callable(use_tqdm)):
            raise ValueError(f"use_tqdm must be True, False or a callable, got {use_tqdm!r}")
        self.bar: Any = None
        if use_tqdm:
            make = use_tqdm
            if use_tqdm is True:
                from tqdm import tqdm as make
            self.bar = make(total=total, desc="Processed prompts", dynamic_ncols=True)
        self.start = time.perf_counter()
        self.tokens_in = self.tokens_out = 0

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()

    def finished(self, out: RequestOutput) -> None:
        if self.bar is None:
            return
        self.tokens_in += len(out.prompt_token_ids or ())
        self.tokens_out += sum(len(c.token_ids) for c in out.outputs)
        seconds = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(
            f"est. speed input: {self.tokens_in / seconds:.2f} toks/s, "
            f"output: {self.tokens_out / seconds:.2f} toks/s",
            refresh=False,
        )
        self.bar.update(1)
