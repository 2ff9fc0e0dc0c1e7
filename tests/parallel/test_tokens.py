"""TokenBroadcast: one rank's token ids reach every rank of the world (gloo, 2-3 ranks),
through gloo and through shared memory."""

from __future__ import annotations

import mmap

import pytest
import torch.distributed as dist

from medha_parallel import ParallelLayout, ParallelState, TokenBroadcast, TokenReturn, shm
from medha_parallel.errors import CommunicationError
from medha_parallel.tokens import _SLOT, RETURN_SLOTS, SHM_MAX_IDS, _ShmTokens

from .dist import launch

IDS = [[5, 0, 49151, 7], [2**40, -3], [11]]  # int64 range, any order; one launch sends each


def _worker(rank: int, world_size: int, init: str, shared_memory: bool = False) -> dict:
    state = ParallelState.initialize(
        ParallelLayout(kvp=3), backend="gloo", init_method=init, rank=rank, world_size=world_size
    )
    res: dict = {}
    for src in (0, 1, 2):
        tokens = TokenBroadcast(state, src=src, shared_memory=shared_memory)
        assert tokens.uses_shared_memory == shared_memory
        got = []
        for ids in IDS:
            got.append(tokens.broadcast(ids if rank == src else None, len(ids)))
        got.append(tokens.broadcast([] if rank == src else None, 0))
        res[src] = got
        if rank == src:
            with pytest.raises(ValueError, match=f"rank {src} sends 3 token ids, got 2"):
                tokens.broadcast([1, 2], 3)
    # a receiver that expects another count than the sender's is told, not fed garbage
    if rank == 1:
        with pytest.raises(CommunicationError, match="rank 1 expects 4 token ids, rank 2 sent 3"):
            tokens.broadcast(None, 4)
    else:
        res["mismatch"] = tokens.broadcast([7, 8, 9] if rank == 2 else None, 3)
    with pytest.raises(ValueError, match=r"src must be a rank in \[0, 3\), got 3"):
        TokenBroadcast(state, src=3)
    for bad in (0, -1.0, float("inf"), True, "1"):
        with pytest.raises(ValueError, match="timeout_s must be a positive number of seconds"):
            TokenBroadcast(state, src=0, timeout_s=bad)
    res["repr"] = repr(tokens)
    return res


NEEDS_SHM = pytest.mark.skipif(not shm.supported(), reason="shared memory needs Linux x86-64")


@pytest.mark.parametrize(
    "shared_memory", [False, pytest.param(True, marks=NEEDS_SHM)], ids=["gloo", "shm"]
)
def test_every_rank_gets_the_source_ids(shared_memory: bool) -> None:
    results = launch(_worker, 3, shared_memory)
    for rank, res in enumerate(results):
        for src in (0, 1, 2):
            assert res[src] == [*IDS, []], (rank, src)
        assert res.get("mismatch") == (None if rank == 1 else [7, 8, 9])
        assert res["repr"] == f"TokenBroadcast(rank={rank}, src=2, world_size=3)"


def _shm_worker(rank: int, world_size: int, init: str) -> dict:
    state = ParallelState.initialize(
        ParallelLayout(kvp=2), backend="gloo", init_method=init, rank=rank, world_size=world_size
    )
    tokens = TokenBroadcast(state, src=0)  # the default: shared memory on this host
    res: dict = {"shm": tokens.uses_shared_memory, "runs": []}
    # the sender does not wait for the receiver: two broadcasts ahead fill both buffers
    first, second = [1, 2, 3], [9, 8]
    if rank == 0:
        res["sent"] = [tokens.broadcast(first, 3), tokens.broadcast(second, 2)]
        dist.barrier()
    else:
        dist.barrier()  # the receiver reads only after both were written
        res["sent"] = [tokens.broadcast(None, 3), tokens.broadcast(None, 2)]
    # many in a row (each buffer reused), lengths varying, and one past the shared
    # buffer's capacity (gloo for it, on both ranks)
    for step in range(50):
        n = 1 + (step * 37) % 300
        ids = [step * 1000 + i for i in range(n)]
        res["runs"].append(tokens.broadcast(ids if rank == 0 else None, n) == ids)
    big = list(range(-5, SHM_MAX_IDS + 5))
    res["big"] = tokens.broadcast(big if rank == 0 else None, len(big)) == big
    res["after"] = tokens.broadcast([2**40] if rank == 0 else None, 1)
    tokens.close()
    tokens.close()
    res["closed"] = tokens.uses_shared_memory
    with pytest.raises(ValueError, match="broadcast after close"):
        tokens.broadcast([1] if rank == 0 else None, 1)
    return res


@NEEDS_SHM
def test_shared_memory_broadcast_order_and_capacity() -> None:
    results = launch(_shm_worker, 2)
    for rank, res in enumerate(results):
        assert res["shm"] is True, rank
        assert res["sent"] == [[1, 2, 3], [9, 8]], rank
        assert res["runs"] == [True] * 50, rank
        assert res["big"] is True, rank
        assert res["after"] == [2**40], rank
        assert res["closed"] is False, rank


def _timeout_worker(rank: int, world_size: int, init: str) -> str:
    state = ParallelState.initialize(
        ParallelLayout(kvp=2),
        backend="gloo",
        init_method=init,
        rank=rank,
        world_size=world_size,
        timeout_s=60.0,  # the gloo start-up: it may take seconds on a loaded machine
    )
    tokens = TokenBroadcast(state, src=0, timeout_s=1.0)
    if rank == 0:
        return "sent nothing"
    with pytest.raises(CommunicationError) as err:
        tokens.broadcast(None, 4)  # rank 0 never sends
    return str(err.value)


@NEEDS_SHM
def test_shared_memory_wait_times_out_naming_the_operation() -> None:
    message = launch(_timeout_worker, 2)[1]
    assert message == (
        "broadcast_tokens on the world group failed: rank 0 of the shared-memory group "
        "did not arrive within 1 s"
    )


@NEEDS_SHM
def test_sequence_flags_wrap_around_int32() -> None:
    """The int32 flags wrap after 2**31 - 1 broadcasts; broadcasts go on."""
    mm = mmap.mmap(-1, 2 * shm._FLAG_STRIDE + 2 * _SLOT)
    send = _ShmTokens(mm, size=2, index=0, src=0, timeout_s=1.0)
    recv = _ShmTokens(mm, size=2, index=1, src=0, timeout_s=1.0)
    start = 2**31 - 3
    send._seq = recv._seq = start
    send._flags[0].value, recv._flags[1].value = start, start
    got = []
    for k in range(6):
        send.broadcast([k, k + 1], 2)
        got.append(recv.broadcast(None, 2))
    assert send._flags[0].value < 0  # wrapped
    assert got == [[k, k + 1] for k in range(6)]
    send.close()
    recv.close()


def _mixed_worker(rank: int, world_size: int, init: str) -> tuple:
    if rank == 1:
        shm.supported = lambda: False  # as on a host without shared-memory support
    state = ParallelState.initialize(
        ParallelLayout(kvp=2), backend="gloo", init_method=init, rank=rank, world_size=world_size
    )
    tokens = TokenBroadcast(state, src=0)
    return tokens.uses_shared_memory, tokens.broadcast([1, 2, 3] if rank == 0 else None, 3)


def test_ranks_that_cannot_all_map_shared_memory_fall_back_to_gloo_together() -> None:
    assert launch(_mixed_worker, 2) == [(False, [1, 2, 3]), (False, [1, 2, 3])]


def _return_worker(rank: int, world_size: int, init: str) -> dict:
    state = ParallelState.initialize(
        ParallelLayout(spp=2, kvp=2),
        backend="gloo",
        init_method=init,
        rank=rank,
        world_size=world_size,
    )
    # rank 3 sends to ranks 0 and 1; rank 2 takes no part (an inactive channel)
    ret = TokenReturn(state, src=3, dst=[0, 1], max_ids=8)
    res: dict = {"repr": repr(ret), "got": [], "early": None}
    messages = [[i, -i, 2**40 + i][: i % 4] for i in range(3 * RETURN_SLOTS)]
    if rank == 3:
        with pytest.raises(ValueError, match="at most 8 token ids, got 9"):
            ret.send(list(range(9)))
        # RETURN_SLOTS messages go without any receiver reading: no wait
        for ids in messages[:RETURN_SLOTS]:
            ret.send(ids)
        dist.barrier()
        for ids in messages[RETURN_SLOTS:]:  # each waits for a buffer read back
            ret.send(ids)
        dist.barrier()
        ret.send([7, 8, 9])
    elif rank in (0, 1):
        with pytest.raises(ValueError, match="is not the sender"):
            ret.send([1])
        dist.barrier()  # every one of the first RETURN_SLOTS is there: none blocks
        res["early"] = [ret.arrived()]
        for ids in messages:
            res["got"].append(ret.recv(len(ids)))
        res["early"].append(ret.arrived())  # nothing more yet
        dist.barrier()
        with pytest.raises(CommunicationError, match=r"rank \d expects 2 token ids in message"):
            ret.recv(2)
    else:
        with pytest.raises(ValueError, match="is not a receiver"):
            ret.recv(1)
        dist.barrier()
        dist.barrier()
    with pytest.raises(ValueError, match=r"dst must be distinct ranks other than src=1"):
        TokenReturn(state, src=1, dst=[1, 2])
    ret.close()
    ret.close()
    return res


@NEEDS_SHM
def test_token_return_reaches_stage_zero_in_order() -> None:
    results = launch(_return_worker, 4)
    messages = [[i, -i, 2**40 + i][: i % 4] for i in range(3 * RETURN_SLOTS)]
    for rank in (0, 1):
        assert results[rank]["got"] == messages
        assert results[rank]["early"] == [True, False]
    assert results[2]["got"] == []
    assert results[3]["repr"] == "TokenReturn(rank=3, src=3, dst=[0, 1])"
