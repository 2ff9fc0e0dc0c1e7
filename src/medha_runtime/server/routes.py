"""The OpenAI endpoints: validate a request, submit it, answer it (JSON or SSE).

:class:`Frontend` holds what the handlers share (the engine client, the
metrics, the tokenizer the engine sent, the served name); the shapes of the
answers come from :mod:`medha_runtime.server.formatting` and the following
of engine requests from :mod:`medha_runtime.server.streams`.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from medha_runtime.sampling_params import (
    SamplingParams,
    check_allowed_tokens,
    check_token_ids,
    resolve_bad_words,
    truncate_prompt,
)
from medha_runtime.server import formatting as fmt
from medha_runtime.server.admission import AdmissionGate
from medha_runtime.server.client import EngineClient
from medha_runtime.server.logs import access_line, logger
from medha_runtime.server.metrics import ServerMetrics
from medha_runtime.server.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    RefusedField,
    check_messages,
    check_request,
    check_text,
    error_body,
    unknown_fields,
)
from medha_runtime.server.streams import Prompt, Run, Sub
from medha_runtime.server.tokens import LONG_TEXT_CHARS, FrontTokenizer
from medha_runtime.tokenizer import ChatTemplateError, join_text_parts, template_variables


async def off_loop(chars: int, fn: Any, *args: Any) -> Any:
    """``fn(*args)``: here for a short input, on a worker thread for one of more than
    ``LONG_TEXT_CHARS`` characters (its tokenizing releases the GIL): a 4 MB prompt
    takes seconds, and on the event loop every other request's stream stood still."""
    if chars <= LONG_TEXT_CHARS:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


async def _settled(run: Run, wait: Any) -> None:
    """Await ``wait`` (the run's accept or its whole answer); an :class:`APIError` it
    raises ends the run with its status (the run writes the access line) and goes on."""
    try:
        await wait
    except APIError as exc:
        run.finish(exc.status)
        exc.logged = True
        raise


def _token_ids_in(vocab: int, param: str, where: str, ids: Any) -> None:
    """A 400 naming ``param`` for the first of ``ids`` outside the vocabulary."""
    try:
        check_token_ids(where, ids, vocab)
    except ValueError as exc:
        raise APIError(str(exc), 400, param) from None


def text_chars(value: Any) -> int:
    """Characters of text in a prompt or a chat's messages (token ids count none)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return text_chars(value.get("text"))
    if isinstance(value, (list, tuple)):
        return sum(text_chars(v) for v in value) if value and not isinstance(value[0], int) else 0
    content = getattr(value, "content", None)
    return text_chars(content) if content is not None else 0


ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "BadRequestError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


#: unknown request field names warned about once each; past this many, no more are
#: remembered (a client sending new names in every request grew the set without bound)
MAX_WARNED_FIELDS = 256


class Frontend:
    """State shared by the endpoints. ``tokenizer`` is set once the engine is ready."""

    def __init__(
        self,
        client: EngineClient,
        metrics: ServerMetrics,
        admission: AdmissionGate,
        *,
        model_name: str,
        log_requests: bool = True,
    ) -> None:
        self.client, self.metrics, self.admission = client, metrics, admission
        self.model_name = model_name
        self.log_requests = log_requests
        self.tokenizer: FrontTokenizer | None = None
        self.shutting_down = False
        self._warned: set[str] = set()

    # ------------------------------------------------------------- checks
    @property
    def max_model_len(self) -> int:
        ready = self.client.ready
        return ready.max_model_len if ready is not None else 0

    @property
    def vocab_size(self) -> int | None:
        ready = self.client.ready
        return ready.info.vocab_size if ready is not None and ready.info is not None else None

    @property
    def max_prompt_tokens(self) -> int | None:
        """The longest prompt the engine's KV memory admits (None: not known yet)."""
        ready = self.client.ready
        return ready.info.max_prompt_tokens if ready is not None and ready.info else None

    @property
    def sampling_defaults(self) -> dict[str, float]:
        """The model's defaults for the sampling fields a request leaves unset."""
        ready = self.client.ready
        info = ready.info if ready is not None else None
        return dict(info.sampling_defaults) if info is not None else {}

    def check_text(self, body: Any) -> None:
        """A 400 for a string that is not Unicode text (a lone surrogate), before it is
        echoed in an answer or a log line, or tokenized."""
        try:
            check_text(body)
        except RefusedField as exc:
            raise APIError(str(exc), 400, exc.param) from None

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(
                f"The model `{name}` does not exist: this server serves `{self.model_name}`.",
                404,
                "model",
            )

    def check_alive(self) -> None:
        c = self.client
        if self.shutting_down:
            raise APIError("the server is shutting down", 503)
        if c.dead is not None or c.ready is None:
            raise APIError(f"the engine is not available: {c.dead or 'starting'}", 503)

    def check_fields(self, body: Any, chat: bool) -> None:
        try:
            check_request(body, chat=chat)
        except RefusedField as exc:
            raise APIError(str(exc), 400, exc.param) from None
        for name in unknown_fields(body):
            if name in self._warned or len(self._warned) > MAX_WARNED_FIELDS:
                continue
            self._warned.add(name)
            if len(self._warned) > MAX_WARNED_FIELDS:
                logger.warning(
                    "more than %d unknown request field names: no more are logged",
                    MAX_WARNED_FIELDS,
                )
                continue
            logger.warning(
                "request field %r is not known to Medha and is ignored (as vLLM does); "
                "this warning is logged once per field name",
                name,
            )

    def need_tokenizer(self) -> FrontTokenizer:
        if self.client.ready is None:  # the tokenizer comes with the engine
            self.check_alive()
        if self.tokenizer is None:
            raise APIError(f"model {self.model_name!r} has no tokenizer: pass prompts as token ids")
        return self.tokenizer

    def token_text(self, as_ids: bool = False) -> fmt.TokenText:
        tok = self.tokenizer
        if as_ids or tok is None:
            return fmt.TokenText.as_ids()
        return fmt.TokenText(tok.token_str, tok.token_bytes)

    def chat_ids(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        *,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        try:
            check_messages(messages)
        except RefusedField as exc:
            raise APIError(str(exc), 400, exc.param) from None
        if continue_final_message and add_generation_prompt:
            raise APIError(
                "continue_final_message=true needs add_generation_prompt=false: the final "
                "message is continued, no new turn is started",
                400,
                "continue_final_message",
            )
        try:
            variables = template_variables(template_kwargs)
        except ChatTemplateError as exc:
            raise APIError(str(exc), 400, "chat_template_kwargs") from None
        tok = self.need_tokenizer()
        conv = []
        for m in messages:
            content = m.content
            if isinstance(content, list):
                content = join_text_parts(content)
            turn: dict[str, Any] = {"role": m.role, "content": content}
            if m.name is not None:
                turn["name"] = m.name
            conv.append(turn)
        try:
            return list(
                tok.apply_chat_template(
                    conv,
                    add_generation_prompt=add_generation_prompt,
                    tokenize=True,
                    continue_final_message=continue_final_message,
                    **variables,
                )
            )
        except ChatTemplateError as exc:
            raise APIError(str(exc), 400, "messages") from None

    def chat_ids_of(self, body: Any) -> list[int]:
        """A chat or tokenize request's conversation as token ids (its template options)."""
        return self.chat_ids(
            body.messages,
            body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            template_kwargs=body.chat_template_kwargs,
        )

    def truncated(self, body: Any, ids: list[int]) -> list[int]:
        """The prompt's last ``truncate_prompt_tokens`` tokens (-1: as many as the context
        and the KV memory take with one token to generate); all of it when unset."""
        keep, admit = body.truncate_prompt_tokens, self.max_prompt_tokens
        try:
            return truncate_prompt(ids, keep, self.max_model_len, admit)
        except ValueError as exc:
            raise APIError(str(exc), 400, "truncate_prompt_tokens") from None

    def check_lengths(self, n: int, max_tokens: int | None) -> None:
        limit = self.max_model_len
        if n >= limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, your "
                f"request has {n} input tokens. Please reduce the length of the input messages.",
                400,
                "input_tokens",
            )
        admit = self.max_prompt_tokens
        if admit is not None and n > admit:
            # refused here, not by the engine, so a stream gets a 400 too (not a 200 and
            # an error event)
            raise APIError(
                f"your request has {n} input tokens, but the longest prompt this server "
                f"can take is {admit} tokens (its KV cache, --kv-cache-tokens, with the "
                "scheduler's reserve of free blocks left; the context limit is "
                f"{limit} tokens). Please reduce the length of the input messages.",
                400,
                "input_tokens",
            )
        if max_tokens is not None and n + max_tokens > limit:
            raise APIError(
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This "
                f"model's maximum context length is {limit} tokens and your request has {n} "
                f"input tokens ({max_tokens} > {limit} - {n}).",
                400,
                "max_tokens",
            )

    def check_vocab(self, body: Any, prompts: list[Prompt]) -> None:
        """Refuse token ids outside the vocabulary (in a prompt, ``logit_bias``,
        ``stop_token_ids`` or ``allowed_token_ids``) with a 400
        before anything is submitted, so a stream gets the 400 too, not a 200 with an
        error event (the engine checks them again)."""
        vocab = self.vocab_size
        if vocab is None:
            return
        for p in prompts:
            _token_ids_in(vocab, "prompt", "", p.ids)
        bad = [k for k in body.logit_bias or () if int(k) >= vocab]  # keys checked: digits
        if bad:
            raise APIError(
                f"logit_bias: token id {int(bad[0])} is outside the model's vocabulary "
                f"(0..{vocab - 1})",
                400,
                "logit_bias",
            )
        # (a stop id the model never draws would be ignored)
        for name in ("stop_token_ids", "allowed_token_ids"):
            _token_ids_in(vocab, name, f"{name}: ", getattr(body, name) or ())

    async def sampling(
        self, body: Any, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None
    ) -> SamplingParams:
        d = self.sampling_defaults
        try:
            params = SamplingParams(
                temperature=(
                    d.get("temperature", 1.0) if body.temperature is None else body.temperature
                ),
                top_p=d.get("top_p", 1.0) if body.top_p is None else body.top_p,
                top_k=int(d.get("top_k", 0)) if body.top_k is None else body.top_k,
                min_p=d.get("min_p", 0.0) if body.min_p is None else body.min_p,
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=(
                    d.get("repetition_penalty", 1.0)
                    if body.repetition_penalty is None
                    else body.repetition_penalty
                ),
                logit_bias=body.logit_bias,
                allowed_token_ids=body.allowed_token_ids,
                bad_words=body.bad_words,
                seed=body.seed,
                max_tokens=max_tokens,
                min_tokens=body.min_tokens,
                stop=() if body.stop is None else body.stop,
                stop_token_ids=tuple(body.stop_token_ids or ()),
                ignore_eos=body.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=body.skip_special_tokens,
                include_stop_str_in_output=body.include_stop_str_in_output,
            )
            tok = self.tokenizer
            stops = tok.tokenizer.stop_token_ids if tok is not None else ()
            check_allowed_tokens(params, stops)
            if params.bad_words and tok is not None:  # checked here for a 400; the engine
                front = tok  # reads them again (token ids are its own business)
                encode = lambda word: front.encode(word, add_special_tokens=False)  # noqa: E731
                chars = text_chars(params.bad_words)  # many words: off the loop too
                await off_loop(chars, resolve_bad_words, params, encode, stops, self.vocab_size)
            return params
        except ValueError as exc:
            message = str(exc)  # it starts with the field's name ("min_tokens=20 must ...")
            raise APIError(message, 400, re.split(r"\W", message, maxsplit=1)[0]) from None

    # ---------------------------------------------------------------- runs
    def access(self, run: Run, status: int) -> None:
        if not self.log_requests:
            return
        reasons = sorted({s.finish_reason for s in run.subs if s.finish_reason})
        logger.info(
            access_line(
                request_id=run.id,
                route=run.route,
                status=status,
                prompt_tokens=run.prompt_tokens,
                output_tokens=run.completion_tokens,
                ttft_s=None if run.first_token is None else run.first_token - run.arrival,
                e2e_s=time.monotonic() - run.arrival,
                finish=",".join(reasons) or None,
            )
        )

    def access_error(self, route: str, status: int, message: str) -> None:
        if self.log_requests:
            logger.info("- %s %d error=%s", route, status, message)

    async def start(
        self,
        request: Request,
        body: Any,
        prompts: list[Prompt],
        params: SamplingParams,
        *,
        chat: bool,
    ) -> Run:
        self.check_alive()
        self.admission.check(body.ttft_slo_ms, [len(p.ids) for p in prompts])
        run = Run(
            self.client,
            self.metrics,
            route=request.url.path,
            prefix="chatcmpl-" if chat else "cmpl-",
            access=self.access,
        )

        def make(i: int, sub: Sub) -> dict[str, Any]:
            return {
                "params": params.completion(i),
                "ttft_slo_s": None if body.ttft_slo_ms is None else body.ttft_slo_ms / 1e3,
                "tpot_slo_s": None if body.tpot_slo_ms is None else body.tpot_slo_ms / 1e3,
                "priority": body.priority,
                "cache_salt": body.cache_salt,
                "ack": bool(body.stream),  # a stream waits for the engine's accept
            }

        await run.submit(prompts, body.n, make)
        run.watch(request.receive)
        return run

    async def answer(self, run: Run, body: Any, chat: bool) -> Any:
        """The JSON response, or a streaming one (once the engine took the request: a
        refusal, such as a prompt only the scheduler can judge too long, is then a
        plain 400 error, streamed or not)."""
        if body.stream:
            await _settled(run, run.accepted())
            return StreamingResponse(
                self.stream(run, body, chat),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        await _settled(run, run.collect())
        run.finish(200)
        if run.disconnected:
            return None
        tt = self.token_text(body.return_tokens_as_token_ids)
        if chat:
            return self.chat_response(run, body, tt)
        return self.completion_response(run, body, tt)

    # ------------------------------------------------------------ responses
    def completion_choice(self, s: Sub, body: Any, tt: fmt.TokenText) -> dict[str, Any]:
        text, ids, entries, pieces = s.text, list(s.tokens), list(s.logprobs), s.pieces
        if body.echo:
            prompt = self.prompt_text(s)
            text = prompt + text
            ids = s.prompt_ids + ids
            entries = list(s.prompt_logprobs or [None] * len(s.prompt_ids)) + entries
            if body.logprobs is not None:
                pieces = self.prompt_pieces(s, prompt) + pieces
        c: dict[str, Any] = {"index": s.index, "text": text, "logprobs": None}
        if body.logprobs is not None:
            c["logprobs"] = fmt.completion_logprobs(
                ids, entries, tt, top=body.logprobs, pieces=pieces
            )
        c["finish_reason"], c["stop_reason"] = s.finish_reason, s.stop_reason
        if body.prompt_logprobs is not None and s.prompt_logprobs is not None:
            c["prompt_logprobs"] = fmt.prompt_logprobs(
                s.prompt_logprobs, tt, top=body.prompt_logprobs
            )
        return c

    def prompt_text(self, s: Sub) -> str:
        if s.prompt_text is not None:
            return s.prompt_text
        return self.need_tokenizer().decode(s.prompt_ids, skip_special_tokens=False)

    def prompt_pieces(self, s: Sub, text: str) -> list[str]:
        """Per prompt token, the text it adds to the echoed prompt ``text`` (a special
        token the prompt's own text lacks adds ""; a token whose character a later one
        completes adds "" and shares that one's offset)."""
        tok = self.need_tokenizer().tokenizer
        state = tok.detokenizer(skip_special_tokens=s.prompt_text is not None)
        pieces = [state.add((t,)) for t in s.prompt_ids]
        if pieces:
            pieces[-1] += state.flush()
        return fmt.fit_pieces(pieces, text)

    def completion_response(self, run: Run, body: Any, tt: fmt.TokenText) -> dict[str, Any]:
        return {
            "id": run.id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [self.completion_choice(s, body, tt) for s in run.subs],
            "usage": fmt.usage(run.prompt_tokens, run.completion_tokens, run.cached_tokens),
        }

    def chat_response(self, run: Run, body: Any, tt: fmt.TokenText) -> dict[str, Any]:
        choices = []
        for s in run.subs:
            c: dict[str, Any] = {
                "index": s.index,
                "message": {"role": "assistant", "content": s.text},
                "logprobs": None,
                "finish_reason": s.finish_reason,
                "stop_reason": s.stop_reason,
            }
            if body.logprobs:
                c["logprobs"] = fmt.chat_logprobs(
                    s.tokens, s.logprobs, tt, top=body.top_logprobs or 0
                )
            choices.append(c)
        out = {
            "id": run.id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": fmt.usage(run.prompt_tokens, run.completion_tokens, run.cached_tokens),
        }
        first = run.subs[0]
        if body.prompt_logprobs is not None and first.prompt_logprobs is not None:
            out["prompt_logprobs"] = fmt.prompt_logprobs(
                first.prompt_logprobs, tt, top=body.prompt_logprobs
            )
        return out

    # ------------------------------------------------------------ streaming
    def chunk_choice(
        self, s: Sub, new_text: str, new_ids: list[int], new_lps: list[Any], body: Any,
        chat: bool, tt: fmt.TokenText,
    ) -> dict[str, Any]:  # fmt: skip
        first = not s.sent_first
        if chat:
            d: dict[str, Any] = {"role": "assistant"} if first else {}
            d["content"] = new_text
            c: dict[str, Any] = {"index": s.index, "delta": d, "logprobs": None}
            if body.logprobs and new_lps:
                c["logprobs"] = fmt.chat_logprobs(new_ids, new_lps, tt, top=body.top_logprobs or 0)
        else:
            offset, generated = s.emitted, len(new_ids)
            prompt = ""
            if body.echo and first:
                prompt = self.prompt_text(s)
                new_text = prompt + new_text
                new_ids = s.prompt_ids + new_ids
                new_lps = list(s.prompt_logprobs or [None] * len(s.prompt_ids)) + new_lps
            c = {"index": s.index, "text": new_text, "logprobs": None}
            if body.logprobs is not None and new_ids and len(new_lps) == len(new_ids):
                pieces = s.pieces[len(s.pieces) - generated :]
                if body.echo and first:
                    pieces = self.prompt_pieces(s, prompt) + pieces
                c["logprobs"] = fmt.completion_logprobs(
                    new_ids, new_lps, tt, top=body.logprobs, pieces=pieces, text_offset=offset
                )
            s.emitted += len(new_text)
        c["finish_reason"] = None
        if first and body.prompt_logprobs is not None and s.prompt_logprobs is not None:
            c["prompt_logprobs"] = fmt.prompt_logprobs(
                s.prompt_logprobs, tt, top=body.prompt_logprobs
            )
        s.sent_first = True
        return c

    async def stream(self, run: Run, body: Any, chat: bool) -> AsyncIterator[str]:
        tt = self.token_text(body.return_tokens_as_token_ids)
        obj = "chat.completion.chunk" if chat else "text_completion"
        base = {"id": run.id, "object": obj, "created": int(time.time()), "model": self.model_name}
        opts = body.stream_options
        # usage in every chunk only with include_usage as well (vLLM's rule)
        continuous = bool(opts and opts.include_usage and opts.continuous_usage_stats)
        status = 499  # until the stream ends: the client left (the generator was closed)
        try:
            async for s, delta, before in run.deltas():
                if not delta.new_token_ids and not delta.new_text and delta.finish_reason is None:
                    continue  # a prefill chunk: nothing generated yet
                # a token whose text is held back (part of a character, or of a possible
                # stop string) still gets a chunk, with empty text, as vLLM sends it
                choice = self.chunk_choice(
                    s, delta.new_text, s.tokens[before:], list(delta.logprobs or []), body, chat, tt
                )
                if delta.finish_reason is not None:
                    choice["finish_reason"] = delta.finish_reason
                    choice["stop_reason"] = delta.stop_reason
                chunk: dict[str, Any] = {**base, "choices": [choice]}
                if continuous:
                    chunk["usage"] = fmt.usage(s.num_prompt_tokens, len(s.tokens), s.cached_tokens)
                yield fmt.sse(chunk)
            if run.disconnected:
                return
            if opts and opts.include_usage:
                u = fmt.usage(run.prompt_tokens, run.completion_tokens, run.cached_tokens)
                yield fmt.sse({**base, "choices": [], "usage": u})
            status = 200
            yield fmt.SSE_DONE
        except APIError as exc:
            status = exc.status
            yield fmt.sse(error_body(exc.message, ERROR_TYPES.get(status, "APIError"), status))
            yield fmt.SSE_DONE
        finally:
            run.finish(status)

    # ------------------------------------------------------------- endpoints
    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        self.check_text(body)
        self.check_model(body.model)
        self.check_alive()
        self.check_fields(body, chat=False)
        prompts = await off_loop(text_chars(body.prompt), self.completion_prompts, body)
        if body.truncate_prompt_tokens is not None:  # a prompt cut short loses its text
            cut = [(p, self.truncated(body, p.ids)) for p in prompts]
            prompts = [p if len(ids) == len(p.ids) else Prompt(None, ids) for p, ids in cut]
        for p in prompts:
            self.check_lengths(len(p.ids), body.max_tokens)
        self.check_vocab(body, prompts)
        score_only = body.echo and body.max_tokens == 0
        max_tokens = self.completion_max_tokens(body, score_only)
        want = [body.prompt_logprobs]
        if body.echo and body.logprobs is not None:
            want.append(body.logprobs)  # echoed prompt tokens get their logprobs too
        pl = max((w for w in want if w is not None), default=None)
        params = await self.sampling(body, max_tokens, body.logprobs, pl)
        run = await self.start(request, body, prompts, params, chat=False)
        run.drop_output = score_only
        return await self.answer(run, body, chat=False)

    def completion_max_tokens(self, body: CompletionRequest, score_only: bool) -> int:
        """The engine's ``max_tokens``: OpenAI's 16 when unset, lowered by the generation
        config's (vLLM). Scoring (``echo`` with ``max_tokens`` 0, OpenAI's and vLLM's
        meaning) runs one token for the prompt's logprobs; the answer drops it."""
        if score_only and body.min_tokens > 0:
            raise APIError(
                f"min_tokens={body.min_tokens} must not exceed max_tokens=0 (echo with "
                "max_tokens 0 scores the prompt and generates nothing)",
                400,
                "min_tokens",
            )
        if body.max_tokens is None:
            return min(16, int(self.sampling_defaults.get("max_tokens", 16)))
        return 1 if score_only else body.max_tokens

    def completion_prompts(self, body: CompletionRequest) -> list[Prompt]:
        p = body.prompt
        if isinstance(p, str):
            raw: list[Any] = [p]
        elif p and isinstance(p[0], int):  # validated: the list is of one kind throughout
            raw = [list(p)]
        else:
            raw = list(p)
        if not raw:
            raise APIError("prompt must not be empty", 400, "prompt")
        prompts = []
        for x in raw:
            if isinstance(x, str):
                if not x:
                    raise APIError("the prompt is an empty string", 400, "prompt")
                tok = self.need_tokenizer()
                prompts.append(Prompt(x, tok.encode(x, add_special_tokens=body.add_special_tokens)))
            else:
                prompts.append(Prompt(None, list(x)))
        for q in prompts:
            if not q.ids:
                raise APIError("the prompt is empty: it needs at least one token", 400, "prompt")
        return prompts

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Any:
        self.check_text(body)
        self.check_model(body.model)
        self.check_alive()
        self.check_fields(body, chat=True)
        chars = text_chars(body.messages)
        ids = self.truncated(body, await off_loop(chars, self.chat_ids_of, body))
        mt = body.max_completion_tokens
        if mt is None:
            mt = body.max_tokens
        elif mt < 1:  # named as sent (the sampling check names max_tokens)
            raise APIError(
                f"max_completion_tokens must be an integer >= 1, got {mt}",
                400,
                "max_completion_tokens",
            )
        self.check_lengths(len(ids), mt)
        self.check_vocab(body, [Prompt(None, ids)])
        if mt is None:  # the room left, at most the model's generation config's
            room = self.max_model_len - len(ids)
            max_tokens = min(room, int(self.sampling_defaults.get("max_tokens", room)))
        else:
            max_tokens = mt
        lp = (body.top_logprobs or 0) if body.logprobs else None
        params = await self.sampling(body, max_tokens, lp, body.prompt_logprobs)
        run = await self.start(request, body, [Prompt(None, ids)], params, chat=True)
        return await self.answer(run, body, chat=True)
