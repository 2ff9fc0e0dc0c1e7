"""Predictive admission: TTFT predicted from a queue snapshot, hopeless requests rejected."""

from __future__ import annotations

import pytest

from medha_sched import Request, Scheduler, SchedulerConfig
from medha_sched.admission import AdmissionController, QueuedPrefill, QueueSnapshot, SnapshotTaker
from medha_sched.config import CacheConfig
from medha_sched.cost import AffineCostModel
from medha_sched.cost.online import OnlineCostModel


def _snapshot(queue=(), slowdown=1.0, taken_at=0.0) -> QueueSnapshot:
    # C(L) = 1 ms per token: 1,000 tokens take 1 s alone
    lengths = (0, 1000, 100_000)
    times = tuple(n * 1e-3 for n in lengths)
    return QueueSnapshot(
        taken_at=taken_at,
        queue=tuple(queue),
        lengths=lengths,
        prefill_s=times,
        key_s=times,
        slowdown=slowdown,
    )


def test_empty_queue_predicts_the_prefill_alone_and_rejects_only_hopeless_requests():
    adm = AdmissionController()
    adm.update(_snapshot(slowdown=1.5))
    assert adm.predict(2000, 10.0, now=0.0) == pytest.approx(3.0)
    ok = adm.decide(2000, 3.5, now=0.0)
    assert ok.accept and ok.predicted_ttft == pytest.approx(3.0)
    no = adm.decide(2000, 2.0, now=0.0)
    assert not no.accept and no.predicted_ttft == pytest.approx(3.0)
    assert no.retry_after == pytest.approx(3.0)  # at least its own prefill
    assert adm.decide(10**6, None, now=0.0).accept  # no SLO: always accepted


def test_without_a_snapshot_or_with_reject_off_everything_is_accepted():
    assert AdmissionController().decide(5000, 0.001, now=0.0).accept
    adm = AdmissionController(reject=False)
    adm.update(_snapshot())
    v = adm.decide(5000, 0.001, now=0.0)
    assert v.accept and v.predicted_ttft == pytest.approx(5.0)


def test_only_requests_with_less_relative_slack_are_ahead():
    urgent = QueuedPrefill(remaining_s=2.0, rho0=-0.5, rate=0.1)  # behind schedule: first
    relaxed = QueuedPrefill(remaining_s=50.0, rho0=100.0, rate=0.01)  # plenty of slack: after
    adm = AdmissionController()
    adm.update(_snapshot(queue=[urgent, relaxed]))
    # new: 1,000 tokens (1 s), SLO 3 s -> rho = 2: only ``urgent`` is ahead
    assert adm.predict(1000, 3.0, now=0.0) == pytest.approx(3.0)
    # one second later the engine has done one second of that work
    assert adm.predict(1000, 3.0, now=1.0) == pytest.approx(2.0)


def test_admitted_requests_count_until_a_snapshot_includes_them():
    adm = AdmissionController()
    adm.update(_snapshot())
    assert adm.decide(1000, 2.5, now=0.0).accept
    assert adm.decide(1000, 2.5, now=0.0).predicted_ttft == pytest.approx(2.0)
    third = adm.decide(1000, 2.5, now=0.0)
    assert not third.accept and third.predicted_ttft == pytest.approx(3.0)
    # a more urgent request (less relative slack) goes ahead of both under LARS
    assert adm.predict(1000, 1.2, now=0.0) == pytest.approx(1.0)
    adm.update(_snapshot(taken_at=1.0))  # the engine has them now (they finished)
    assert adm.predict(1000, 5.0, now=1.0) == pytest.approx(1.0)


def test_a_request_that_would_push_an_admitted_one_past_its_deadline_is_refused():
    # 1 s of work left, due 1.5 s from now, but with plenty of relative slack
    admitted = QueuedPrefill(remaining_s=1.0, rho0=5.0, rate=0.1, deadline=1.5)
    adm = AdmissionController()
    adm.update(_snapshot(queue=[admitted]))
    # 1,000 tokens (1 s) due in 1.2 s: LARS runs it first (rho 0.2 < 5) and it
    # meets its SLO, but the admitted request would then finish at 2 s > 1.5 s
    v = adm.decide(1000, 1.2, now=0.0)
    assert v.predicted_ttft == pytest.approx(1.0)
    assert not v.accept
    # a short one fits in the slack of both
    assert adm.decide(400, 1.2, now=0.0).accept
    # without an SLO the queued request has nothing to lose
    free = QueuedPrefill(remaining_s=1.0, rho0=5.0, rate=0.1)
    adm = AdmissionController()
    adm.update(_snapshot(queue=[free]))
    assert adm.decide(1000, 1.2, now=0.0).accept


def _scheduler(model) -> Scheduler:
    cache = CacheConfig(block_size=16, num_blocks_per_group=4096, max_tokens_per_group=65536)
    return Scheduler(SchedulerConfig(target_batch_time=0.05), model, cache=cache)


def test_snapshot_taker_reads_the_scheduler_queue():
    affine = AffineCostModel(base=0.004, per_token=4e-5, per_attn=1e-9)
    sched = _scheduler(affine)
    for i, n in enumerate((4000, 300)):
        sched.add_request(Request(f"r{i}", 0.0, n, 4, ttft_slo=2.0))
    taker = SnapshotTaker(
        affine,
        sched.prefill_times,
        target_time=0.05,
        token_grid=32,
        max_chunk_tokens=8192,
        group_token_limit=65536,
        max_tokens=65536,
    )
    snap = taker.take([sched.get_request("r0"), sched.get_request("r1")], now=10.0, engine_now=0.0)
    assert snap.taken_at == 10.0 and snap.slowdown == 1.0
    got = sorted(q.remaining_s for q in snap.queue)
    want = sorted(sched.prefill_times.remaining_time(n, 0) for n in (4000, 300))
    assert got == pytest.approx(want)
    for n in (16, 300, 4000, 20000):  # the sampled table matches the scheduler's own
        assert snap.prefill_time(n) == pytest.approx(sched.prefill_times.prefill_time(n), rel=0.02)
    adm = AdmissionController()
    adm.update(snap)
    alone = sched.prefill_times.prefill_time(1000)
    assert adm.predict(1000, 100.0, now=10.0) > alone + min(want)


def test_snapshot_follows_a_learning_model():
    online = OnlineCostModel((0.004, 0.0, 4e-5, 0.0, 1e-9))
    sched = _scheduler(online)
    sched.add_request(Request("r", 0.0, 8000, 4, ttft_slo=2.0))
    kw = dict(target_time=0.05, token_grid=32, max_chunk_tokens=8192, group_token_limit=65536)
    taker = SnapshotTaker(online, sched.prefill_times, max_tokens=65536, refresh_s=0.0, **kw)
    before = taker.take([sched.get_request("r")], now=0.0, engine_now=0.0)
    from medha_sched.cost import BatchWork

    batch = BatchWork.single_group((512, 1000))
    for _ in range(30):  # the device turns out twice as slow
        online.observe(batch, 2 * online.predict(batch))
    after = taker.take([sched.get_request("r")], now=1.0, engine_now=0.0)
    assert after.prefill_time(8000) > 1.5 * before.prefill_time(8000)
    assert after.key_time(8000) == before.key_time(8000)  # the scheduler's keys are its own
