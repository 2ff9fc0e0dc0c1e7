"""``KVPCommunicator.merger`` through the native ``publish_merge_states`` (one call a merge).

Two gloo ranks (forkserver, ``file://``), the shared-memory merge. Where the native
extension builds, the merger a decode's later layers call is
:meth:`medha_parallel.shm.ShmAllGather.merger`'s closure; its merges, with a peer
that arrives within the native spin, one 30 ms late (past the spin: the early rank
sleeps on the futex and the late one's native call wakes it), and plain ``merge``
calls between them (the two paths share the exchange's sequence), are bit for bit
what ``merge`` gives and within twice plain torch's fp32 error of float64; a call
the native op refuses publishes nothing (the ranks' merges stay paired).
"""

from __future__ import annotations

import time

import pytest
import torch

from medha_kernels import native
from medha_parallel import shm

from .dist import launch
from .merge_checks import assert_merged_like_merge, decode_states, shm_kvp

pytestmark = pytest.mark.skipif(
    not (shm.supported() and native.supports_device(torch.device("cpu"))),
    reason="needs the shared-memory exchange and the native extension",
)


def _worker(rank: int, world: int, init: str) -> dict[str, object]:
    comm = shm_kvp(rank, world, init)
    outs, lses = decode_states(0)
    comm.merge(outs[rank], lses[rank], active=2)
    merger = comm.merger(outs[rank], lses[rank], active=2)
    assert merger is not None
    before = comm._shm._seq
    try:  # a state of another shape: refused before anything is published
        merger(outs[rank][:, :2], lses[rank][:, :2])
        refused = False
    except RuntimeError:
        refused = True
    unchanged = comm._shm._seq == before
    got, seqs = [], []
    for i in range(1, 7):
        outs, lses = decode_states(i)
        if i == 3 and rank == 1:
            time.sleep(0.03)  # past the native spin: rank 0 sleeps, rank 1 wakes it
        fast = tuple(t.clone() for t in merger(outs[rank], lses[rank]))
        fast_cache, comm._fast = comm._fast, {}  # merge's checked path, not the closure
        checked = tuple(t.clone() for t in comm.merge(outs[rank], lses[rank], active=2))
        comm._fast = fast_cache
        got.append((fast, checked, outs, lses))
        seqs.append(comm._shm._seq)
    return {
        "name": merger.__qualname__,
        "refused": (refused, unchanged),
        "got": got,
        "seqs": seqs,
    }


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, object]]:
    return launch(_worker, 2)


def test_the_merger_is_the_native_one(ranks) -> None:
    for res in ranks:
        assert res["name"] == "ShmAllGather.merger.<locals>.exchange_merge"
        # a refused call leaves the exchange's sequence alone, so the ranks stay paired;
        # each round: one exchange in the merger, one in merge (the first merge: 1)
        assert res["refused"] == (True, True)
        assert res["seqs"] == [1 + 2 * i for i in range(1, 7)]


def test_native_merges_are_merge_bit_for_bit(ranks) -> None:
    for res in ranks:
        assert len(res["got"]) == 6
        assert_merged_like_merge(res["got"])
    for (a, _, _, _), (b, _, _, _) in zip(ranks[0]["got"], ranks[1]["got"], strict=True):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])  # both ranks agree
