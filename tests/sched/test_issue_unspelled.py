"""``DecodeLanes.issue_unspelled`` leaves the lanes as ``issue`` does (it keeps
empty lists instead of making new ones), and ``grow_moved`` as ``grow_all``
and the crossers' ``del`` do: twins through the same joins, leaves, issues,
growth and returns, one spelling the batches, compared after every step and
through the next spelled batch."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from medha_sched import AffineCostModel
from medha_sched.config import CacheConfig
from medha_sched.decode_set import ZERO_TOKENS, DecodeLanes
from medha_sched.kv_memory import KVBlockManager
from medha_sched.request import Request

MODEL = AffineCostModel(base=1e-3, per_token=1e-5, per_attn=1e-9)


def lanes_of(ids: bool) -> DecodeLanes:
    cache = CacheConfig(
        block_size=4, num_blocks_per_group=80, max_tokens_per_group=4 * 64, block_ids=ids
    )
    return DecodeLanes(MODEL, KVBlockManager(cache, num_groups=1))


def state(lanes: DecodeLanes, made: list) -> tuple:
    memory = lanes.memory
    return (
        [
            (
                lane.issued,
                lane.shared,
                list(lane.parents),
                list(lane.joined),
                list(lane.left),
                [m.request.request_id for m in lane.members],
                sorted((k, [m.seq for m in v]) for k, v in lane.cross_at.items()),
                lane in lanes.ready,
            )
            for lane in made
        ],
        list(lanes._retired_parents),
        list(lanes._retired_left),
        memory.free_blocks(),
        {rid: (memory.block_table(rid), dict(memory._entries[rid].pending)) for rid in lanes.where},
    )


@settings(max_examples=100, deadline=None)
@given(ids=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_unspelled_issue_and_growth_leave_the_spelled_state(ids: bool, seed: int) -> None:
    rng = random.Random(seed)
    twins = [lanes_of(ids), lanes_of(ids)]  # [0] spells every batch, [1] does not
    made: list[list] = [[], []]
    seq = 0
    for step in range(120):
        op = rng.choice("jjliiiIg")
        tokens = rng.randint(1, 30)
        live = sorted(twins[0].where)
        gone = rng.choice(live) if live else None
        spelled = []
        for k, lanes in enumerate(twins):
            memory = lanes.memory
            if op == "j" and memory.admit(f"r{seq}", tokens):
                r = Request(f"r{seq}", 0.0, tokens, 50)
                r._scheduled = r._stage0 = r._computed = tokens
                lane = lanes.ready[0] if lanes.ready else lanes.new_lane()
                if lane not in made[k]:
                    made[k].append(lane)
                lanes.join(lane, seq, r)
            elif op == "l" and gone is not None:
                lane = lanes.where[gone]
                lanes.leave(lane.index[gone].request)
                memory.free(gone)
            elif op in "iI" or op == "g":
                lane = lanes.ready[0] if lanes.ready else None
                crossers = None if lane is None else lane.cross_at.get(lane.issued)
                if op == "g" and crossers:
                    if k == 0:
                        ok = lanes.grow_all(lane, crossers) is not None
                        if ok:
                            del lane.cross_at[lane.issued]
                    else:
                        ok = lanes.grow_moved(lane, crossers)
                    spelled.append(ok)
                    continue
                if op == "g":
                    continue
                if op == "I" or k == 0:  # "I": both spell it; the batches must agree
                    b = lanes.issue(lane, step, [])
                    spelled.append((b.count, b.parents, b.left) if op == "I" else None)
                else:
                    lanes.issue_unspelled(lane, step)
                    spelled.append(None)
                if lane is not None:
                    for m in lane.members:  # every member has room for its token
                        memory.ensure_capacity(m.request.request_id, m.request.num_tokens + 1)
                    lanes.returned(lane, ZERO_TOKENS, set())
        if op == "j":
            seq += 1
        assert spelled[: len(spelled) // 2] == spelled[len(spelled) // 2 :]
        assert state(twins[0], made[0]) == state(twins[1], made[1])
