"""A scheduler's queue of mixed prompts, for the chunk-sizing comparisons."""

from __future__ import annotations

import random

from medha_sched.request import Request
from medha_sched.scheduler import Scheduler


def add_mixed_requests(sched: Scheduler, rng: random.Random, n: int = 40) -> list[Request]:
    """``n`` requests added to ``sched``: every third a long prompt (40K-200K tokens),
    the rest 20-8,000 tokens, arriving over 2 s, 1-50 output tokens each."""
    reqs = []
    for i in range(n):
        prompt = rng.randint(40_000, 200_000) if i % 3 == 0 else rng.randint(20, 8_000)
        r = Request(f"r{i}", rng.uniform(0.0, 2.0), prompt, rng.randint(1, 50))
        sched.add_request(r)
        reqs.append(r)
    return reqs
