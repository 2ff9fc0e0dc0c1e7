"""medha_runtime: run Llama-family models with Medha's scheduler.

The offline API follows vLLM::

    from medha_runtime import LLM, SamplingParams

    with LLM("tiny") as llm:  # the built-in model: random weights, gibberish text
        out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))
        print(out[0].outputs[0].text)

Pieces: :mod:`medha_runtime.model` (the Llama model, loading, the tiny
model), :mod:`medha_runtime.tokenizer`, :mod:`medha_runtime.sampling`,
:mod:`medha_runtime.engine` (scheduler loop), :mod:`medha_runtime.executor`
and :mod:`medha_runtime.runner` (workers: TP, SPP, KVP),
:mod:`medha_runtime.profile` (``medha-runtime profile``).
"""

from medha_runtime.llm import LLM as LLM
from medha_runtime.outputs import CompletionOutput as CompletionOutput
from medha_runtime.outputs import RequestOutput as RequestOutput
from medha_runtime.sampling import SamplingParams as SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
