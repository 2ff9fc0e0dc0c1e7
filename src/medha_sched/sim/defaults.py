"""Default options of ``medha-sim`` runs and sweeps (no numpy: the parser reads them)."""

from __future__ import annotations

DEFAULT_COST_MODEL = "roofline:model=llama3-8b,gpu=a100"
DEFAULT_KV_CACHE_TOKENS = 1 << 23
DEFAULT_TARGET_BATCH_TIME = 0.05
#: ``medha-sim compare``'s policy variants and loads
DEFAULT_VARIANTS = "fcfs@0,fcfs@512,fcfs@2048,edf,lrs,lars,lars-mp"
DEFAULT_QPS = "0.25,0.75,1.25,1.75"
