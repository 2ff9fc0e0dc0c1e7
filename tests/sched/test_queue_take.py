"""``_PrefillQueue.take``: the scan's chosen chunks leave the queue, and their
removal from the index waits for the next queue operation, which is most
often the ``push`` of one of them (its batch cleared stage 0), done then as
one in-place renewal (``KineticIndex.renew``).

Twin queues, one removing at once (``remove_many``, the plain path) and one
taking, go through the same random operations: every answer must be the
same, and whenever nothing is deferred the indexes must be in the same
state (slots, winners, certificates, free lists, open pages), so every
later order is too. Whole simulations with ``take`` against the same ones
with ``take`` removing at once: every record, batch and float the same.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from medha_sched.policies import get_policy
from medha_sched.priority_index import KineticIndex
from medha_sched.request import Request
from medha_sched.scheduler import _PrefillQueue
from medha_sched.sim.runner import RunSpec
from medha_sched.sim.workload import WorkloadSpec, generate
from tests.sched.test_remove_many import _state
from tests.sim.same import assert_same_results, simulate

_LONG = 1_000  # long_min of the twins
_SHORT = 64  # short_below


def _index_state(index: KineticIndex) -> tuple:
    """What decides every later answer of an index (not versions or counters)."""
    return (*_state(index), index._b, index._m)


def _queue_state(queue: _PrefillQueue) -> tuple:
    return (
        {p: _index_state(i) for p, i in queue._classes.items()},
        sorted(queue._where.items()),
        sorted(queue._short.items()),
        sorted(queue._not_long),
        queue._seq,
    )


class _Twins:
    """A plain queue (``take`` is ``remove_many``) and a taking one, driven alike."""

    def __init__(self, rng: random.Random, policy: str, classes: int) -> None:
        self.rng = rng
        self.classes = classes
        self.plain = _PrefillQueue(get_policy(policy), short_below=_SHORT, long_min=_LONG)
        self.lazy = _PrefillQueue(get_policy(policy), short_below=_SHORT, long_min=_LONG)
        self.requests: dict[str, Request] = {}
        self.taken: list[str] = []  # taken, not pushed back yet
        self.now = 0.0
        self.n = 0
        self.renewed = 0  # pushes the taking queue did in place
        self.refused = 0  # pushes of a taken request done as remove then push
        renew_taken = self.lazy._renew_taken

        def counting(request: Request) -> bool:
            done = renew_taken(request)
            self.renewed += done
            self.refused += not done
            return done

        self.lazy._renew_taken = counting  # type: ignore[method-assign]

    def both(self, name: str, *args):
        got = [getattr(q, name)(*args) for q in (self.plain, self.lazy)]
        assert got[0] == got[1], (name, args, got)
        return got[0]

    def _new(self) -> None:
        rng = self.rng
        self.n += 1
        prompt = rng.choice([rng.randint(8, 900), rng.randint(_LONG, 60_000)])
        r = Request(f"r{self.n}", self.now, prompt, 4, priority=rng.randrange(self.classes))
        r.deadline = self.now + rng.uniform(0.5, 50.0)
        r.total_work = r.remaining_work = prompt * rng.uniform(1e-5, 1e-4)
        self.requests[r.request_id] = r
        self.both("push", r)

    def _progress(self, r: Request) -> None:
        left = r.num_prefill_tokens - r.num_scheduled_tokens
        step = self.rng.choice([1, 16, 256, 2048])
        r.num_scheduled_tokens += min(step, max(left - 1, 0))
        done = r.num_scheduled_tokens / r.num_prefill_tokens
        r.remaining_work = r.total_work * (1.0 - done)

    def take(self) -> None:
        """A scan: the first few queued requests in order (or any few), taken."""
        self.flush_taken()
        queued = [r.request_id for r in self.plain.iter_sorted(self.now)]
        self.lazy_sorted()
        if not queued:
            return
        k = min(len(queued), self.rng.choice([1, 1, 2, 2, 3, 4]))
        if self.rng.random() < 0.8:
            ids = queued[:1] + self.rng.sample(queued[1:], k - 1)  # the first, then any
        else:
            ids = self.rng.sample(queued, k)
        self.plain.remove_many(list(ids))
        self.lazy.take(list(ids))
        self.taken = list(ids)

    def lazy_sorted(self) -> None:
        assert [r.request_id for r in self.lazy.iter_sorted(self.now)] == [
            r.request_id for r in self.plain.iter_sorted(self.now)
        ]

    def push_back(self) -> None:
        """Stage 0 cleared: some of the taken come back (in order, or not)."""
        if not self.taken:
            return
        back = [rid for rid in self.taken if self.rng.random() < 0.85]
        if self.rng.random() < 0.2:
            self.rng.shuffle(back)
        self.taken = []
        for rid in back:
            r = self.requests[rid]
            self._progress(r)
            self.both("push", r)

    def flush_taken(self) -> None:
        self.taken = []

    def step(self) -> None:
        rng = self.rng
        op = rng.random()
        if op < 0.22 or len(self.plain) < 3:
            self._new()
        elif op < 0.45:
            self.take()
            if rng.random() < 0.6:  # the next operation is the stage-0 clearing
                self.push_back()
        elif op < 0.7:
            self.push_back()
        elif op < 0.76:
            self.now += rng.uniform(0.0, 2.0)
            self.both("first", self.now)
        elif op < 0.8:
            rid = rng.choice(list(self.requests))
            self.both("remove", rid)
            self.flush_taken()
        elif op < 0.83:
            queued = [rid for rid in self.requests if rid in self.plain]
            if queued:
                r = self.requests[rng.choice(queued)]
                self._progress(r)
                self.both("renew", r)
        elif op < 0.86:
            self.both("has_remaining_below", rng.choice([1, 16, 64]))
        elif op < 0.89:
            assert self.lazy.num_not_long == self.plain.num_not_long
        elif op < 0.91:
            ids = list(self.requests)
            self.both("ahead_of_not_long", rng.sample(ids, min(5, len(ids))), self.now)
        elif op < 0.93:
            self.both("count_pushes", rng.randint(1, 3))
        else:
            rid = rng.choice(list(self.requests))
            self.both("__contains__", rid)
        self.both("__len__")
        for rid in rng.sample(list(self.requests), min(3, len(self.requests))):
            self.both("__contains__", rid)
        if not self.lazy._out:
            assert _queue_state(self.lazy) == _queue_state(self.plain)
        for index in self.lazy._classes.values():
            index._check_leaves()  # with the count_ahead bounds covering every live line


@pytest.mark.parametrize(
    ("policy", "classes", "seed", "in_place"),
    [
        ("lars", 1, 0, 400),
        ("lars", 1, 1, 400),
        ("lars-mp", 1, 2, 400),
        ("edf", 2, 3, 50),  # flat lines: the slope's page is mostly another one
        ("srpt", 1, 4, 10),
    ],
)
def test_taking_goes_through_the_states_of_removing_at_once(
    policy, classes, seed, in_place
) -> None:
    rng = random.Random(seed)
    twins = _Twins(rng, policy, classes)
    for _ in range(60):  # a long queue first: indexes of many pages
        twins._new()
    for _ in range(3_000):
        twins.step()
    twins.lazy_sorted()
    assert _queue_state(twins.lazy) == _queue_state(twins.plain)
    for index in twins.lazy._classes.values():
        index.check()
    assert twins.renewed > in_place and twins.refused > 100  # both paths were taken often


def test_a_small_queue_renews_in_place_only_the_last_taken() -> None:
    """One page of leaves: a push after several removals takes the last slot
    freed, so only the last taken may be renewed in place."""
    queue = _PrefillQueue(get_policy("lars"), short_below=_SHORT, long_min=_LONG)
    reqs = []
    for i in range(5):
        r = Request(f"r{i}", 0.0, 2_000 + i, 4)
        r.deadline, r.total_work, r.remaining_work = 10.0, 0.2, 0.2
        queue.push(r)
        reqs.append(r)
    index = queue._classes[0]
    slots = dict(index._slot)
    queue.take(["r0", "r1"])
    assert len(queue) == 3 and "r0" not in queue and "r2" in queue
    queue.push(reqs[0])  # r1 was freed after it: removed at once, r0 takes r1's slot
    assert queue._out == [] and index._slot["r0"] == slots["r1"]
    queue.take(["r2", "r3"])
    queue.push(reqs[3])  # the last taken: in place, r2 still deferred
    assert queue._out == ["r2"] and index._slot["r3"] == slots["r3"]
    assert "r2" not in queue and len(queue) == 3
    assert queue.num_not_long == 0  # (r2 leaves the index here)
    assert queue._out == [] and "r2" not in index
    index.check()


# ------------------------------------------------------------- whole simulations


def _remove_at_once(self, request_ids) -> None:
    self.remove_many(request_ids)


@pytest.mark.parametrize(
    ("policy", "spp", "qps", "long_fraction", "seed"),
    [
        ("lars-mp", 2, 2.0, 0.3, 2),
        ("lars", 4, 1.5, 0.2, 5),
        ("edf", 2, 2.5, 0.1, 1),
        ("fcfs", 1, 2.0, 0.2, 3),
    ],
)
def test_simulations_match_removing_at_once(
    monkeypatch, policy, spp, qps, long_fraction, seed
) -> None:
    trace = generate(
        WorkloadSpec(qps=qps, num_requests=160, long_fraction=long_fraction, seed=seed)
    )
    spec = RunSpec(
        policy=policy,
        cost_model="roofline:model=llama3-8b,gpu=a100",
        tp=8,
        spp=spp,
        target_batch_time=0.05,
    )
    counts = {"in_place": 0}
    renew_taken = _PrefillQueue._renew_taken

    def counting(self, request):
        done = renew_taken(self, request)
        counts["in_place"] += done
        return done

    monkeypatch.setattr(_PrefillQueue, "_renew_taken", counting)
    # the scan's batches through schedule() (not as turns): the queue takes them
    fast = simulate(trace, spec, turn_scans=False)
    assert all(r.finish_s is not None for r in fast.records)
    assert counts["in_place"] > 100
    monkeypatch.setattr(_PrefillQueue, "take", _remove_at_once)
    assert_same_results(fast, simulate(trace, spec, turn_scans=False))


def test_a_pickled_scheduler_keeps_what_it_took() -> None:
    """A scheduler pickled between a scan and the stage-0 clearing carries the
    deferred removals and goes on as the original."""
    import pickle

    spec = RunSpec(policy="lars-mp", tp=8, spp=2)
    config, model, cache = spec.build()
    from medha_sched.scheduler import Scheduler

    s = Scheduler(dataclasses.replace(config), model, cache=cache)
    for i in range(6):
        s.add_request(Request(f"r{i}", 0.0, 30_000 + 100 * i, 2))
    out = s.schedule(0.0)
    taken = [c.request_id for c in out.chunks]
    assert taken and s._queue._out == taken
    copy = pickle.loads(pickle.dumps(s))
    for sched in (s, copy):
        sched.on_stage_end(out.batch_id)
    assert [c.request_id for c in s.schedule(0.01).chunks] == [
        c.request_id for c in copy.schedule(0.01).chunks
    ]
    assert _queue_state(s._queue) == _queue_state(copy._queue)
