"""``KVPCommunicator.contributor``: a rank's part of a merge whose result it drops.

Two gloo ranks (forkserver, ``file://``), the shared-memory merge. Rank 1 feeds
some merges through its contributor (it publishes its state and returns without
waiting, :meth:`medha_parallel.shm.ShmAllGather.publish`) while rank 0 merges as
usual, through the merger and through ``merge``'s checked path, with either rank
arriving late: rank 0's merged states are bit for bit what a full merge of both
states gives, rank 1's later merges get rank 0's states, and a write after a
publish waits for the peer to reach it (no buffer is rewritten while the peer may
still read it).
"""

from __future__ import annotations

import time

import pytest
import torch

from medha_parallel import shm
from medha_parallel.merge import merge_partials

from .dist import launch
from .merge_checks import decode_states, shm_kvp

pytestmark = pytest.mark.skipif(not shm.supported(), reason="needs the shared-memory exchange")

#: per round, whether rank 1 only contributes, and which rank arrives 20 ms late
ROUNDS = [(True, None), (False, 1), (True, 0), (True, 1), (False, None), (True, None)] * 2


def _worker(rank: int, world: int, init: str) -> dict[str, object]:
    comm = shm_kvp(rank, world, init)
    outs, lses = decode_states(0)
    assert comm.contributor(outs[rank], lses[rank], active=2) is None  # nothing resolved yet
    comm.merge(outs[rank], lses[rank], active=2)
    merger = comm.merger(outs[rank], lses[rank], active=2)
    contribute = comm.contributor(outs[rank], lses[rank], active=2)
    assert merger is not None and contribute is not None
    shared = comm._shm
    got, peer_seen = [], []
    for i, (drop, late) in enumerate(ROUNDS, start=1):
        outs, lses = decode_states(i)
        if late == rank:
            time.sleep(0.02)
        if rank == 1 and drop:
            contribute(outs[rank], lses[rank])
            got.append(None)
            # the next write waits for rank 0 to reach this exchange
            shared.next_parity()
            peer_seen.append(shm._reached(shared._flags[0].value, shared._seq))
        elif i % 2:
            got.append(tuple(t.clone() for t in merger(outs[rank], lses[rank])))
        else:  # merge's checked path, not the closures
            fast, comm._fast = comm._fast, {}
            got.append(tuple(t.clone() for t in comm.merge(outs[rank], lses[rank], active=2)))
            comm._fast = fast
    return {"got": got, "peer_seen": peer_seen, "seq": shared._seq}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, object]]:
    return launch(_worker, 2)


def test_every_merge_of_the_peer_gets_the_contributed_state(ranks) -> None:
    r0, r1 = ranks
    assert r0["seq"] == r1["seq"] == len(ROUNDS) + 1  # the same exchanges, in order
    for i, (drop, _) in enumerate(ROUNDS, start=1):
        outs, lses = decode_states(i)
        want = merge_partials(outs, lses)
        mine = r0["got"][i - 1]
        torch.testing.assert_close(mine[0], want[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(mine[1], want[1], rtol=1e-6, atol=1e-6)
        theirs = r1["got"][i - 1]
        if drop:
            assert theirs is None
        else:  # rank 1's own merges are the same merge, bit for bit
            assert torch.equal(theirs[0], mine[0]) and torch.equal(theirs[1], mine[1])


def test_a_write_after_a_publish_waits_for_the_peer(ranks) -> None:
    assert ranks[1]["peer_seen"] == [True] * sum(d for d, _ in ROUNDS)
