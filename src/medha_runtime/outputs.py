"""What ``LLM.generate`` returns: vLLM's ``RequestOutput`` / ``CompletionOutput`` shapes.

``finish_reason`` is ``"stop"`` (EOS, a stop token id or a stop string),
``"length"`` (``max_tokens`` or the context limit), ``"abort"`` or ``"error"``
(its next token could not be sampled, e.g. non-finite logits: ``error`` says
why; the engine goes on serving the other requests); it is None while the
request runs. ``stop_reason`` is the stop string or stop token id that ended
it (None for EOS and for the other reasons).
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: one generated position: the chosen token and any top-k alternatives -> logprob
LogprobsEntry = dict[int, float]


@dataclass
class CompletionOutput:
    """One completion of a prompt.

    Attributes:
        index: the completion's index among its prompt's ``n`` (0 unless ``n > 1``).
        text: the generated text (empty when the model has no tokenizer).
        token_ids: the generated token ids (a final EOS or stop token included).
        cumulative_logprob: sum of the chosen tokens' logprobs (None unless
            ``SamplingParams.logprobs`` is set).
        logprobs: per generated token, ``{token_id: logprob}`` holding the
            chosen token and the top-k alternatives (None unless asked).
        finish_reason: ``"stop"``, ``"length"``, ``"abort"``, ``"error"`` or None.
        stop_reason: the stop string or stop token id that matched, else None.
        error: with ``finish_reason="error"``, why (the exception that sampling
            the request's next token raised); else None.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[LogprobsEntry] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A prompt and its completion(s).

    Attributes:
        request_id: the engine's id for the request (with ``n > 1``, the first
            completion's request).
        prompt: the prompt text (None when token ids were given).
        prompt_token_ids: the prompt as token ids.
        outputs: the completions (one, or ``SamplingParams.n`` from ``LLM``).
        finished: whether generation is over.
        num_preemptions: times the request was preempted (its KV recomputed;
            summed over the ``n`` requests).
        prompt_logprobs: None unless asked; else None for the first prompt
            token, then per prompt token ``{token_id: logprob}`` (that token
            first, then the top-k alternatives) given the tokens before it.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_preemptions: int = 0
    prompt_logprobs: list[LogprobsEntry | None] | None = None
    #: prompt tokens whose KV came from the prefix cache (not computed for this request)
    num_cached_tokens: int = 0
