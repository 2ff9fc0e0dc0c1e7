"""Policies, deadlines and the scheduler's packing rules, on hand-built cases.

Most cases use an affine cost model without attention cost, so a chunk of
``n`` tokens alone costs ``base + per_token * n`` and every expected chunk
size can be derived by hand (see the comments).
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import medha_sched.policies as policies_mod
from medha_sched import (
    AffineCostModel,
    BatchResult,
    CacheConfig,
    ParallelDegrees,
    Request,
    RequestStatus,
    RequestTooLongError,
    Scheduler,
    SchedulerConfig,
    SchedulerError,
    available_policies,
    get_policy,
    register_policy,
)
from medha_sched.policies import Policy, relative_slack, slack

from .models import PolyCostModel

ALL_POLICIES = {"fcfs", "edf", "lrs", "lars", "lars-mp", "srpt"}


def linear_model(per_token: float = 1e-5, **layout: int) -> AffineCostModel:
    """Chunk of n tokens alone: 1e-3 + per_token * n seconds."""
    return AffineCostModel(
        base=1e-3, per_token=per_token, per_attn=0.0, layout=ParallelDegrees(**layout)
    )


def finish(sched: Scheduler, out) -> tuple[str, ...]:
    sampled = {c.request_id: 1 for c in out.chunks if c.samples}
    return sched.on_batch_end(out.batch_id, BatchResult(sampled_token_ids=sampled))


def ids(out) -> list[str]:
    return [c.request_id for c in out.chunks]


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


# -------------------------------------------------------------------- registry
def test_registry_has_exactly_the_shipped_policies() -> None:
    assert set(available_policies()) == ALL_POLICIES
    assert len(available_policies()) == len(ALL_POLICIES)
    for name in ALL_POLICIES:
        policy = get_policy(name)
        assert isinstance(policy, Policy)
        assert policy.name == name
        assert get_policy(name) is not policy  # a new instance each time
    assert get_policy("lars-mp").space_sharing
    assert not any(get_policy(n).space_sharing for n in ALL_POLICIES - {"lars-mp"})


def test_unknown_policy_lists_known_names() -> None:
    with pytest.raises(ValueError, match="'nope'") as info:
        get_policy("nope")
    for name in ALL_POLICIES:
        assert name in str(info.value)
    with pytest.raises(ValueError, match="nope"):
        Scheduler(SchedulerConfig(policy="nope"), linear_model())


def test_custom_policy_can_be_registered_and_used(monkeypatch) -> None:
    monkeypatch.setattr(policies_mod, "_REGISTRY", dict(policies_mod._REGISTRY))

    @register_policy
    class NewestFirst(Policy):
        name = "newest-first"

        def line(self, request):
            return -request.arrival_time, 0.0

    assert "newest-first" in available_policies()
    assert isinstance(get_policy("newest-first"), NewestFirst)
    assert register_policy(NewestFirst) is NewestFirst  # same class again: fine

    class Impostor(Policy):
        name = "newest-first"

        def line(self, request):
            return 0.0, 0.0

    with pytest.raises(ValueError, match="newest-first"):
        register_policy(Impostor)

    class FakeLars(Policy):
        name = "lars"

        def line(self, request):
            return 0.0, 0.0

    with pytest.raises(ValueError, match="lars"):
        register_policy(FakeLars)

    sched = Scheduler(SchedulerConfig(policy="newest-first"), linear_model())
    sched.add_request(Request("old", 0.0, 6000, 1))
    sched.add_request(Request("new", 1.0, 6000, 1))
    out = sched.schedule(1.0)
    assert ids(out)[0] == "new"


# ------------------------------------------------------------------------ keys
@st.composite
def random_requests(draw):
    arrival = draw(st.floats(0.0, 1000.0))
    r = Request("r", arrival, draw(st.integers(1, 10_000)), 1)
    r.deadline = arrival + draw(st.floats(0.01, 100.0))
    r.total_work = draw(st.floats(1e-3, 100.0))
    r.remaining_work = r.total_work * draw(st.floats(0.0, 1.0))
    return r


def tol(*values: float) -> float:
    return 1e-9 * max(1.0, *(abs(v) for v in values))


@settings(max_examples=200, deadline=None)
@given(r=random_requests(), now=st.floats(0.0, 2000.0), later=st.floats(0.0, 2000.0))
def test_policy_keys_match_their_definitions(r: Request, now: float, later: float) -> None:
    a, d_abs, w_rem, w_tot = r.arrival_time, r.deadline, r.remaining_work, r.total_work
    s = a + (d_abs - a) - now - w_rem
    assert math.isclose(slack(r, now), s, rel_tol=1e-9, abs_tol=tol(d_abs, now, w_rem))
    rho = s / w_tot
    assert math.isclose(
        relative_slack(r, now), rho, rel_tol=1e-9, abs_tol=tol(d_abs, now, w_rem) / w_tot
    )
    expected = {
        "fcfs": a,
        "edf": d_abs,
        "lrs": s,
        "lars": rho,
        "lars-mp": rho,
        "srpt": w_rem,
    }
    for name, value in expected.items():
        policy = get_policy(name)
        intercept, slope = policy.line(r)
        scale = tol(d_abs, now, w_rem) / (w_tot if name.startswith("lars") else 1.0)
        for t, want in ((now, value), (later, None)):
            key = policy.key(r, t)
            assert math.isclose(key, intercept + slope * t, rel_tol=1e-9, abs_tol=scale), name
            if want is not None:
                assert math.isclose(key, want, rel_tol=1e-9, abs_tol=scale), (name, key, want)
        # The line is a function of the request alone, never of the clock.
        assert policy.line(r) == (intercept, slope)
    # Static keys do not move; slack keys fall at rate 1 (LRS) or 1/w_total (LARS).
    assert get_policy("fcfs").line(r)[1] == get_policy("edf").line(r)[1] == 0.0
    assert get_policy("srpt").line(r)[1] == 0.0
    assert get_policy("lrs").line(r)[1] == -1.0
    assert math.isclose(get_policy("lars").line(r)[1], -1.0 / w_tot)


# ------------------------------------------------------------------- deadlines
def deadline_sched(m: float, min_deadline: float) -> Scheduler:
    # per_token=1e-4, T=0.05: a chunk fits iff 1e-3 + 1e-4*n <= 0.05, i.e. n <= 490 -> 480.
    config = SchedulerConfig(
        target_batch_time=0.05, token_grid=32, deadline_multiplier=m, min_deadline=min_deadline
    )
    return Scheduler(config, linear_model(per_token=1e-4))


def test_deadline_multiplier_wins() -> None:
    # P=1000: chunks 480 + 480 + 40 -> p = 0.049 + 0.049 + 0.005 = 0.103 s.
    # m*p = 1.03 > min_deadline = 0.5, so D = 1.03. The vidur bug computed
    # max(p, min_deadline) = 0.5, ignoring m.
    sched = deadline_sched(m=10.0, min_deadline=0.5)
    p = sched.prefill_times.remaining_time(1000, 0)
    assert close(p, 0.103)
    r = Request("a", 2.0, 1000, 4)
    sched.add_request(r)
    assert close(r.deadline, 2.0 + 10.0 * p)
    assert close(r.deadline, 3.03)
    assert not close(r.deadline, 2.0 + max(p, 0.5))
    assert r.total_work == r.remaining_work == p


def test_min_deadline_wins() -> None:
    # P=100: one chunk, p = 1e-3 + 1e-2 = 0.011; m*p = 0.022 < 0.5 -> D = 0.5.
    sched = deadline_sched(m=2.0, min_deadline=0.5)
    p = sched.prefill_times.remaining_time(100, 0)
    assert close(p, 0.011)
    r = Request("a", 1.0, 100, 4)
    sched.add_request(r)
    assert close(r.deadline, 1.5)


def test_ttft_slo_overrides_derived_deadline() -> None:
    sched = deadline_sched(m=10.0, min_deadline=0.5)
    r = Request("a", 2.0, 1000, 4, ttft_slo=0.3)  # below both m*p and min_deadline
    sched.add_request(r)
    assert r.deadline == 2.3
    assert close(r.total_work, 0.103)


def test_deadline_fixed_through_progress_and_preemption() -> None:
    # 40 blocks of 4 tokens per group: two 70-token prompts fit (18 blocks
    # each), but both growing to 110 tokens needs 56 blocks, so one of them is
    # preempted by recompute while decoding.
    cache = CacheConfig(block_size=4, num_blocks_per_group=40, watermark=0.01)
    sched = Scheduler(SchedulerConfig(), linear_model(per_token=1e-4), cache=cache)
    reqs = [Request("a", 0.0, 70, 40), Request("b", 0.0, 70, 40)]
    for r in reqs:
        sched.add_request(r)
    deadlines = {r.request_id: r.deadline for r in reqs}
    first_work = {r.request_id: r.total_work for r in reqs}
    done: set[str] = set()
    now = 0.0
    preempted: list[str] = []
    for _ in range(1000):
        out = sched.schedule(now)
        preempted.extend(out.preempted)
        now += max(out.predicted_time, 1e-3)
        if out.chunks:
            done.update(finish(sched, out))
        for r in reqs:
            assert r.deadline == deadlines[r.request_id], f"deadline of {r.request_id} moved"
        if len(done) == 2:
            break
    assert done == {"a", "b"}
    assert preempted, "the tiny cache should have forced a preemption"
    victim = next(r for r in reqs if r.request_id == preempted[0])
    assert victim.num_preemptions >= 1
    # Its work was re-estimated for the longer recompute prompt; the deadline was not.
    assert victim.total_work > first_work[victim.request_id]
    assert sched.memory.usage() == 0.0


def test_deadline_fixed_after_chunk_progress() -> None:
    sched = deadline_sched(m=1.5, min_deadline=0.5)
    r = Request("a", 0.0, 1000, 4)
    sched.add_request(r)
    d, w = r.deadline, r.remaining_work
    out = sched.schedule(0.0)
    sched.on_stage_end(out.batch_id)
    assert r.deadline == d
    assert r.remaining_work < w


# ---------------------------------------------------------- paper's scenario
# Section 4.1: r_L (w=10, d=16) arrives at 0; r_S1, r_S2 (w=0.5, d=1) at 5.
# Scaled to our model: p_L, p_S are the predicted prefill times; D_L = 1.6 p_L,
# D_S = 2 p_S, and the shorts arrive at t_a = 0.5 p_L. With no progress yet:
#   rho_L(t) = (1.6 p_L - t - p_L) / p_L = 0.6 - t / p_L      -> 0.1 at t_a
#   rho_S(t) = (t_a + 2 p_S - t - p_S) / p_S                  -> 1.0 at t_a
# so at t_a LARS serves r_L first while EDF (d_S = t_a + 2 p_S < 1.6 p_L)
# serves the shorts; the lines cross at t* = (t_a + p_S - 0.6 p_S) / (1 - p_S / p_L)
# (solving 0.6 - t/p_L = (t_a + p_S - t)/p_S), after which LARS serves the
# shorts too. FCFS always serves r_L (it arrived first).
P_LONG, P_SHORT = 40_000, 2_000


def scenario(policy: str) -> tuple[Scheduler, float, float]:
    sched = Scheduler(SchedulerConfig(policy=policy, target_batch_time=0.05), linear_model())
    p_l = sched.prefill_times.remaining_time(P_LONG, 0)
    p_s = sched.prefill_times.remaining_time(P_SHORT, 0)
    t_a = 0.5 * p_l
    sched.add_request(Request("L", 0.0, P_LONG, 1, ttft_slo=1.6 * p_l))
    sched.add_request(Request("S1", t_a, P_SHORT, 1, ttft_slo=2 * p_s))
    sched.add_request(Request("S2", t_a, P_SHORT, 1, ttft_slo=2 * p_s))
    return sched, p_l, p_s


def first_prefill(policy: str, at) -> tuple[str, list[str]]:
    sched, p_l, p_s = scenario(policy)
    now = at(p_l, p_s)
    order = [r.request_id for r in sched._queue.iter_sorted(now)]
    out = sched.schedule(now)
    assert out.chunks and out.chunks[0].start == 0
    return out.chunks[0].request_id, order


def crossing(p_l: float, p_s: float) -> float:
    t_a = 0.5 * p_l
    return (t_a + p_s - 0.6 * p_s) / (1 - p_s / p_l)


def test_scenario_numbers() -> None:
    sched, p_l, p_s = scenario("lars")
    # 40000 tokens = 8 chunks of 4896 + 832; 2000 tokens = one chunk.
    assert close(p_l, 8 * (1e-3 + 4896e-5) + 1e-3 + 832e-5)
    assert close(p_s, 1e-3 + 2000e-5)
    assert p_s < 0.1 * p_l  # so the shorts become more urgent than r_L before d_L
    long, short = sched.get_request("L"), sched.get_request("S1")
    t_a = 0.5 * p_l
    assert close(relative_slack(long, t_a), 0.1)
    assert close(relative_slack(short, t_a), 1.0)
    assert t_a < crossing(p_l, p_s) < 0.6 * p_l
    t_star = crossing(p_l, p_s)
    assert close(relative_slack(long, t_star), relative_slack(short, t_star))


@pytest.mark.parametrize(
    "policy,at_arrival,later",
    [("lars", "L", "S1"), ("edf", "S1", "S1"), ("fcfs", "L", "L"), ("lrs", "S1", "S1")],
)
def test_scenario_schedule_order(policy: str, at_arrival: str, later: str) -> None:
    first, order = first_prefill(policy, lambda p_l, p_s: 0.5 * p_l)
    assert first == at_arrival
    assert order[0] == at_arrival
    first, order = first_prefill(policy, lambda p_l, p_s: 0.6 * p_l)
    assert first == later
    assert order[0] == later


def test_lars_flips_exactly_at_the_crossing() -> None:
    eps = 1e-6
    before, _ = first_prefill("lars", lambda p_l, p_s: crossing(p_l, p_s) * (1 - eps))
    after, order = first_prefill("lars", lambda p_l, p_s: crossing(p_l, p_s) * (1 + eps))
    assert before == "L"
    assert after == "S1"
    assert order == ["S1", "S2", "L"]


# -------------------------------------------------------------- space sharing
def sharing_sched(policy: str, **kw) -> Scheduler:
    config = SchedulerConfig(
        policy=policy, target_batch_time=0.05, token_grid=32, long_prefill_threshold=1024, **kw
    )
    return Scheduler(config, linear_model())


@pytest.mark.parametrize(
    "slo_factor,rho_used,chunk",
    [
        # rho = 0.3: budget 0.05 * 0.7 = 0.035 -> n <= 3400 -> 3392.
        (1.3, 0.3, 3392),
        # rho = 9, clamped to rho_max = 0.4: budget 0.03 -> n <= 2900 -> 2880.
        (10.0, 0.4, 2880),
        # rho = -0.5 (already late), clamped to 0: the full T -> n <= 4900 -> 4896.
        (0.5, 0.0, 4896),
    ],
)
def test_long_prefill_yields_budget_under_lars_mp(slo_factor, rho_used, chunk) -> None:
    for policy in ("lars-mp", "lars"):
        sched = sharing_sched(policy, max_space_share=0.4)
        p = sched.prefill_times.remaining_time(8000, 0)
        long = Request("long", 0.0, 8000, 1, ttft_slo=slo_factor * p)
        sched.add_request(long)
        sched.add_request(Request("short", 0.0, 500, 1))
        rho = relative_slack(long, 0.0)
        assert close(rho, slo_factor - 1.0)
        out = sched.schedule(0.0)
        assert out.chunks[0].request_id == "long"
        got = out.chunks[0].num_tokens
        if policy == "lars-mp":
            assert got == chunk
            long_time = 1e-3 + 1e-5 * got
            assert long_time <= 0.05 * (1 - min(0.4, max(0.0, rho))) + 1e-12
            assert 1e-3 + 1e-5 * (got + 32) > 0.05 * (1 - rho_used)
        else:
            assert got == 4896  # plain LARS packs up to T
        assert out.predicted_time <= 0.05 + 1e-12
        # The yielded room goes to the short prefill (it is too small under LARS).
        if policy == "lars-mp" and rho_used > 0:
            assert ids(out) == ["long", "short"]
            assert out.chunks[1].num_tokens == 500
        if policy == "lars":
            assert ids(out) == ["long"]


@pytest.mark.parametrize("policy", ["lars", "lars-mp"])
def test_one_long_prefill_per_kvp_group(policy: str) -> None:
    # Chunks are capped at 512 tokens (6.12 ms), so budget is left for the
    # second long request; only the one-long-per-group rule keeps it out.
    sched = sharing_sched(policy, max_chunk_tokens=512)
    for rid in ("long1", "long2"):
        sched.add_request(Request(rid, 0.0, 4000, 1))
    sched.add_request(Request("short", 0.0, 300, 1))
    out = sched.schedule(0.0)
    got = ids(out)
    assert sum(rid.startswith("long") for rid in got) == 1, got
    assert "short" in got
    assert out.predicted_time <= 0.05


@pytest.mark.parametrize("policy", ["lars", "lars-mp"])
def test_two_long_prefills_on_different_kvp_groups(policy: str) -> None:
    config = SchedulerConfig(
        policy=policy, target_batch_time=0.05, long_prefill_threshold=1024, max_chunk_tokens=512
    )
    sched = Scheduler(config, linear_model(kvp=2))
    for rid in ("long1", "long2", "long3"):
        sched.add_request(Request(rid, 0.0, 4000, 1))
    out = sched.schedule(0.0)
    longs = [c for c in out.chunks if c.request_id.startswith("long")]
    assert len(longs) == 2  # one per group, not three
    assert {c.kvp_groups for c in longs} == {(0,), (1,)}


# ------------------------------------------------------ decodes over budget
def test_decodes_alone_over_budget_still_run_and_block_prefills() -> None:
    # Each decode at KV 100 costs c*100 = 0.01 s (plus a*1); five of them plus
    # the base cost 0.05105 s > T = 0.05. Their prefills were cheap (KV 0).
    model = PolyCostModel(base=1e-3, a=1e-5, b=0.0, c=1e-4, d=0.0, e=0.0)
    sched = Scheduler(SchedulerConfig(target_batch_time=0.05), model)
    for i in range(5):
        sched.add_request(Request(f"d{i}", 0.0, 100, 10))
    out = sched.schedule(0.0)
    assert sorted(ids(out)) == [f"d{i}" for i in range(5)]
    finish(sched, out)
    sched.add_request(Request("new", 0.0, 64, 1))
    for step in range(3):
        out = sched.schedule(0.01 * (step + 1))
        assert sorted(ids(out)) == [f"d{i}" for i in range(5)], "every decode, no prefill"
        assert all(c.num_tokens == 1 for c in out.chunks)
        assert out.predicted_time > out.target_time == 0.05
        assert sched.get_request("new").status is RequestStatus.WAITING
        assert "new" not in sched.memory
        finish(sched, out)


# --------------------------------------------------------------- fixed chunks
def test_fixed_chunk_budget_counts_decodes() -> None:
    sched = Scheduler(SchedulerConfig(chunk_size=64), linear_model())
    for i in range(3):
        sched.add_request(Request(f"d{i}", 0.0, 10, 50))
    out = sched.schedule(0.0)
    assert out.num_tokens == 30
    finish(sched, out)
    sched.add_request(Request("long", 0.0, 500, 1))
    cursor, now = 0, 0.0
    for _ in range(20):
        now += 0.01
        out = sched.schedule(now)
        assert out.num_tokens <= 64
        chunk = next((c for c in out.chunks if c.request_id == "long"), None)
        if chunk is None:
            break
        assert chunk.start == cursor
        assert chunk.num_tokens == min(61, 500 - cursor)  # 64 minus three decodes
        cursor += chunk.num_tokens
        finish(sched, out)
    assert cursor == 500


def test_no_chunking_sends_whole_prompt() -> None:
    sched = Scheduler(SchedulerConfig(chunk_size=0, max_chunk_tokens=8192), linear_model())
    sched.add_request(Request("big", 0.0, 10_000, 1))
    sched.add_request(Request("small", 0.0, 100, 1))
    out = sched.schedule(0.0)
    assert [(c.request_id, c.start, c.num_tokens) for c in out.chunks] == [("big", 0, 10_000)]
    assert out.chunks[0].samples
    finish(sched, out)
    out = sched.schedule(1.0)
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("small", 100)]


# ------------------------------------------------------------------------ SPP
def test_spp_next_chunk_waits_for_stage_zero() -> None:
    sched = Scheduler(SchedulerConfig(target_batch_time=0.05), linear_model(spp=2))
    sched.add_request(Request("long", 0.0, 20_000, 1))
    b0 = sched.schedule(0.0)
    assert [(c.request_id, c.start, c.num_tokens) for c in b0.chunks] == [("long", 0, 4896)]
    b1 = sched.schedule(0.01)
    assert "long" not in ids(b1), "next chunk issued before chunk 1 cleared stage 0"
    sched.on_stage_end(b0.batch_id)
    b2 = sched.schedule(0.02)
    assert [(c.request_id, c.start) for c in b2.chunks] == [("long", 4896)]
    r = sched.get_request("long")
    assert r.num_scheduled_tokens == 4896 + b2.chunks[0].num_tokens
    assert r.num_computed_tokens == 0  # nothing has left the pipeline yet
    assert finish(sched, b0) == ()
    assert r.num_computed_tokens == 4896


# ---------------------------------------------------------------------- abort
def test_abort_idle_request_frees_kv() -> None:
    sched = Scheduler(SchedulerConfig(), linear_model())
    sched.add_request(Request("a", 0.0, 100, 5))
    sched.add_request(Request("w", 0.0, 100, 5))
    finish(sched, sched.schedule(0.0))
    assert sched.memory.usage() > 0
    sched.abort_request("a")
    sched.abort_request("w")
    assert sched.memory.usage() == 0.0
    assert sched.get_request("a") is None and sched.get_request("w") is None
    assert not sched.has_unfinished_requests()
    assert sched.schedule(1.0).chunks == ()
    sched.abort_request("a")  # unknown id: a no-op


def test_abort_in_flight_request_frees_kv_at_batch_end() -> None:
    sched = Scheduler(SchedulerConfig(), linear_model())
    r = Request("a", 0.0, 100, 5)
    sched.add_request(r)
    out = sched.schedule(0.0)
    sched.abort_request("a")
    assert sched.memory.usage() > 0, "blocks of an in-flight batch must not be freed yet"
    assert "a" not in ids(sched.schedule(0.001))
    assert finish(sched, out) == ("a",)
    assert r.status is RequestStatus.FINISHED_ABORTED
    assert r.num_output_tokens == 0
    assert sched.memory.usage() == 0.0
    assert not sched.has_unfinished_requests()


def test_abort_with_two_spp_chunks_in_flight() -> None:
    sched = Scheduler(SchedulerConfig(target_batch_time=0.05), linear_model(spp=2))
    sched.add_request(Request("long", 0.0, 20_000, 1))
    b0 = sched.schedule(0.0)
    sched.on_stage_end(b0.batch_id)
    b1 = sched.schedule(0.01)
    sched.abort_request("long")
    assert finish(sched, b0) == ()
    assert sched.memory.usage() > 0
    assert finish(sched, b1) == ("long",)
    assert sched.memory.usage() == 0.0


# ------------------------------------------------------------------ bad input
def test_duplicate_request_id() -> None:
    sched = Scheduler(SchedulerConfig(), linear_model())
    sched.add_request(Request("dup", 0.0, 10, 1))
    with pytest.raises(SchedulerError, match="'dup'"):
        sched.add_request(Request("dup", 1.0, 20, 1))


def test_time_going_backwards() -> None:
    sched = Scheduler(SchedulerConfig(), linear_model())
    sched.schedule(2.5)
    with pytest.raises(SchedulerError, match=r"1\.25"):
        sched.schedule(1.25)
    sched.schedule(2.5)  # equal time is fine


def test_unknown_batch_id() -> None:
    sched = Scheduler(SchedulerConfig(), linear_model())
    sched.add_request(Request("a", 0.0, 10, 2))
    out = sched.schedule(0.0)
    with pytest.raises(SchedulerError, match="4242"):
        sched.on_batch_end(4242, BatchResult())
    with pytest.raises(SchedulerError, match="4242"):
        sched.on_stage_end(4242)
    finish(sched, out)
    with pytest.raises(SchedulerError, match=str(out.batch_id)):
        sched.on_batch_end(out.batch_id, BatchResult(sampled_token_ids={"a": 1}))


def test_missing_sampled_token() -> None:
    sched = Scheduler(SchedulerConfig(), linear_model())
    sched.add_request(Request("needs-token", 0.0, 10, 2))
    out = sched.schedule(0.0)
    assert out.chunks[0].samples
    with pytest.raises(SchedulerError, match="'needs-token'"):
        sched.on_batch_end(out.batch_id, BatchResult(sampled_token_ids={"other": 3}))


def test_too_long_request() -> None:
    cache = CacheConfig(block_size=16, num_blocks_per_group=64)  # 1024 tokens per group
    sched = Scheduler(SchedulerConfig(), linear_model(), cache=cache)
    assert sched.max_context_tokens == 1024
    with pytest.raises(RequestTooLongError, match=r"'huge'.*1030"):
        sched.add_request(Request("huge", 0.0, 1000, 30))
    # The prompt alone fits the context but not the watermark-reduced memory.
    assert sched.max_prompt_tokens == (64 - 1) * 16
    with pytest.raises(RequestTooLongError, match=r"'wide'.*1010"):
        sched.add_request(Request("wide", 0.0, 1010, 1))
    assert sched.get_request("huge") is None and sched.get_request("wide") is None
