"""``medha-runtime bench``: an OpenAI-API load generator for any compatible server.

Modules, one concept each: :mod:`~medha_runtime.bench.config` (the run's
settings), :mod:`~medha_runtime.bench.datasets` and
:mod:`~medha_runtime.bench.sharegpt` (workloads by length: the simulator's
traces, random, the short/long mix, ShareGPT), :mod:`~medha_runtime.bench.tokens`
and :mod:`~medha_runtime.bench.prompts` (prompts of a given token length),
:mod:`~medha_runtime.bench.arrivals` (Poisson/gamma send times),
:mod:`~medha_runtime.bench.client` (one timed streaming request),
:mod:`~medha_runtime.bench.runner` (the asyncio load),
:mod:`~medha_runtime.bench.metrics`, :mod:`~medha_runtime.bench.report`,
:mod:`~medha_runtime.bench.result` and :mod:`~medha_runtime.bench.plot` (what
comes out), :mod:`~medha_runtime.bench.session` (one whole run) and
:mod:`~medha_runtime.bench.cli` (the flags).
"""

from medha_runtime.bench.config import BenchConfig as BenchConfig

__all__ = ["BenchConfig"]
