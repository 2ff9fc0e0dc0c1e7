"""``_PrefillQueue.renew``, ``first`` and ``ahead_of_not_long`` as one call each
(the prefill turns call them at every turn) against the calls they fuse:
``PrefillQueue.renew`` then ``_classify``, ``PrefillQueue.first``, and the list
of live classes.

Twin queues, one with the fused methods and one with the composed ones, go
through the same random operations (new prompts, renewals with progress, a
prompt with a decode lane's issued tokens, a priority class changed, removals,
takes, one or several classes): every answer must be the same, and after each
operation the queues must be in the same state (index slots, winners,
certificates, free lists, keys, the short and not-long counts, the tie-break
sequence), so every later order is too. (``renew`` is the composed calls again
since the final read of 2026-11-26: fusing it saved ~0.5% of a simulation and
wrote ``PrefillQueue.renew`` a second time; the twin still pins it.)
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from types import SimpleNamespace

import pytest

from medha_sched.policies import get_policy
from medha_sched.queue import PrefillQueue
from medha_sched.request import Request
from medha_sched.scheduler import _PrefillQueue
from tests.sched.test_queue_take import _LONG, _SHORT, _queue_state


class _Composed(_PrefillQueue):
    """The calls the fused methods stand for, as they were composed."""

    def renew(self, request: Request) -> None:
        if self._out:
            self._flush()
        PrefillQueue.renew(self, request)
        self._classify(request)

    def _classify(self, request: Request) -> None:
        """The not-long count as ``_PrefillQueue`` kept it before the base
        class noted it with the short prompts (``PrefillQueue._note``)."""
        if request.num_prefill_tokens < self._long_min:
            self._not_long.add(request.request_id)
        else:
            self._not_long.discard(request.request_id)

    def first(self, now: float) -> Request | None:
        if self._out:
            self._flush()
        return PrefillQueue.first(self, now)

    def ahead_of_not_long(self, request_ids: Iterable[str], now: float) -> int:
        if self._out:
            self._flush()
        live = [index for index in self._classes.values() if len(index)]
        if len(live) != 1:
            return 0
        return live[0].count_ahead(request_ids, self._not_long, now)


def _run(seed: int, policy: str, classes: int, steps: int) -> dict[str, int]:
    rng = random.Random(seed)
    fused = _PrefillQueue(get_policy(policy), short_below=_SHORT, long_min=_LONG)
    composed = _Composed(get_policy(policy), short_below=_SHORT, long_min=_LONG)
    twins = (fused, composed)
    requests: dict[str, Request] = {}
    counts = {
        "renew": 0,
        "moved_class": 0,
        "lane": 0,
        "first": 0,
        "first_none": 0,
        "at_bound": 0,
        "ahead": 0,
    }
    now = 0.0
    n = 0

    def both(name: str, *args):
        got = [getattr(q, name)(*args) for q in twins]
        assert got[0] is got[1] or got[0] == got[1], (name, args, got)
        return got[0]

    for _ in range(steps):
        now += rng.uniform(0.0, 0.05)
        op = rng.random()
        queued = [rid for rid in requests if rid in fused]
        if op < 0.2 or len(queued) < 2:
            n += 1
            prompt = rng.choice([rng.randint(8, 900), rng.randint(_LONG, 60_000)])
            r = Request(f"r{n}", now, prompt, 4, priority=rng.randrange(classes))
            r.deadline = now + rng.uniform(0.5, 50.0)
            r.total_work = r.remaining_work = prompt * rng.uniform(1e-5, 1e-4)
            requests[r.request_id] = r
            both("push", r)
        elif op < 0.7:  # a turn: progress, then the renewal
            r = requests[rng.choice(queued)]
            left = r.num_prefill_tokens - r.num_scheduled_tokens
            if rng.random() < 0.1 and left > _SHORT:  # at the short bound exactly
                r.num_scheduled_tokens = r.num_prefill_tokens - _SHORT - rng.randint(0, 1)
                counts["at_bound"] += 1
            else:
                r.num_scheduled_tokens += min(rng.choice([1, 16, 256, 2048]), max(left - 1, 0))
            r.remaining_work = r.total_work * (1.0 - r.num_scheduled_tokens / r.num_prefill_tokens)
            if rng.random() < 0.1:  # the lane's issued tokens count as scheduled
                scheduled = r.num_scheduled_tokens
                r._lane = SimpleNamespace(issued=rng.randint(0, 3))
                r.num_scheduled_tokens = scheduled
                counts["lane"] += 1
            if classes > 1 and rng.random() < 0.05:
                r.priority = rng.randrange(classes)
                counts["moved_class"] += 1
            both("renew", r)
            r._lane = None
            counts["renew"] += 1
        elif op < 0.8:
            both("remove", rng.choice(queued))
        elif op < 0.88:
            ids = rng.sample(queued, min(len(queued), rng.randint(1, 3)))
            for q in twins:
                q.take(list(ids))
        if queued and rng.random() < 0.3:
            ids = rng.sample(queued, min(len(queued), rng.randint(1, 8)))
            counts["ahead"] += both("ahead_of_not_long", ids, now) > 0
        got = both("first", now)
        counts["first"] += 1
        counts["first_none"] += got is None
        assert _queue_state(fused) == _queue_state(composed)
        if rng.random() < 0.1:
            assert [r.request_id for r in fused.iter_sorted(now)] == [
                r.request_id for r in composed.iter_sorted(now)
            ]
    return counts


@pytest.mark.parametrize("policy", ["lars", "lars-mp", "edf"])
@pytest.mark.parametrize("classes", [1, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_fused_renew_and_first_match_the_composed_calls(policy: str, classes: int, seed: int):
    counts = _run(seed, policy, classes, 1_500)
    assert counts["renew"] > 500
    assert counts["lane"] > 20
    assert counts["at_bound"] > 20
    if classes == 1:  # (with several classes, mostly 0: more than one is live)
        assert counts["ahead"] > 20
    if classes > 1:
        assert counts["moved_class"] > 5
