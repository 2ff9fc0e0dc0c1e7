"""``KVPCommunicator.merger``: a decode step's later merges, resolved once, merge exactly.

Two gloo ranks (forkserver, ``file://``). The truth is the float64 merge of both
ranks' states; the baseline plain torch's fp32 merge (``merge_partials``); the
merger's result must be within twice the baseline's error, and bit for bit what
:meth:`KVPCommunicator.merge` gives for the same states.
"""

from __future__ import annotations

import time

import pytest
import torch

from medha_parallel import ParallelLayout, ParallelState, shm
from medha_parallel.kvp import KVPCommunicator

from .dist import launch
from .merge_checks import assert_merged_like_merge


def _states(seed: int, num_q: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Both ranks' states: ``[2, num_q, 4, 16]`` outputs and ``[2, num_q, 4]`` LSEs (fp32),
    with a head that saw no key on one rank (LSE -inf)."""
    gen = torch.Generator().manual_seed(seed)
    outs = torch.randn(2, num_q, 4, 16, generator=gen)
    lses = 3 * torch.randn(2, num_q, 4, generator=gen)
    lses[seed % 2, 0, seed % 4] = float("-inf")
    return outs, lses


def _worker(rank: int, world: int, init: str) -> dict[str, object]:
    state = ParallelState.initialize(
        ParallelLayout(kvp=world), init_method=init, rank=rank, world_size=world, device="cpu"
    )
    comm = KVPCommunicator(state, shared_memory=True)
    res: dict[str, object] = {}
    outs, lses = _states(0)
    mine = (outs[rank], lses[rank])
    res["before"] = comm.merger(*mine, active=2)
    first = comm.merge(*mine, active=2)
    res["first"] = (first, outs, lses)
    res["shm"] = comm.uses_shared_memory  # set up by the first whole-group merge
    merger = comm.merger(*mine, active=2)
    res["found"] = merger is not None
    res["other_shape"] = comm.merger(outs[rank, :, :2], lses[rank, :, :2], active=2)
    res["other_strategy"] = comm.merger(*mine, active=2, strategy="ag_lse_ar")
    got = []
    if merger is not None:
        # new states each time (a step's later layers); odd ones non-contiguous (copy_,
        # not memmove); in repeats 2 and 3 one rank arrives 20 ms late (the other sleeps)
        for i in range(1, 7):
            if i in (2, 3) and rank == i % 2:
                time.sleep(0.02)
            outs, lses = _states(i)
            out = outs[rank]
            if i % 2:
                out = out.transpose(1, 2).contiguous().transpose(1, 2)
                assert not out.is_contiguous()
            fast = tuple(t.clone() for t in merger(out, lses[rank]))
            fast_cache, comm._fast = comm._fast, {}  # merge's checked path, not the closure
            checked = tuple(t.clone() for t in comm.merge(out, lses[rank], active=2))
            comm._fast = fast_cache
            got.append((fast, checked, outs, lses))
    res["got"] = got
    gloo = KVPCommunicator(state, shared_memory=False)
    gloo.merge(*mine, active=2)
    res["gloo"] = gloo.merger(*mine, active=2)
    return res


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, object]]:
    return launch(_worker, 2)


def test_merger_is_found_only_after_a_shared_memory_merge_of_those_arguments(ranks) -> None:
    for res in ranks:
        assert res["before"] is None  # nothing merged yet
        assert res["other_shape"] is None and res["other_strategy"] is None
        assert res["gloo"] is None  # the process group's merge is not remembered
        assert res["found"] == res["shm"]
    assert [res["found"] for res in ranks] == [shm.supported()] * 2


def test_merger_merges_each_calls_own_states_like_merge(ranks) -> None:
    for res in ranks:
        if not res["shm"]:
            continue
        assert len(res["got"]) == 6
        assert_merged_like_merge(res["got"])
    (a, _, _, _), (b, _, _, _) = ranks[0]["got"][0], ranks[1]["got"][0]
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])  # both ranks agree
