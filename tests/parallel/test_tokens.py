"""TokenBroadcast: one rank's token ids reach every rank of the world (gloo, 3 ranks)."""

from __future__ import annotations

import pytest

from medha_parallel import CommunicationError, ParallelLayout, ParallelState, TokenBroadcast

from .dist import launch

IDS = [[5, 0, 49151, 7], [2**40, -3], [11]]  # int64 range, any order; one launch sends each


def _worker(rank: int, world_size: int, init: str) -> dict:
    state = ParallelState.initialize(
        ParallelLayout(kvp=3), backend="gloo", init_method=init, rank=rank, world_size=world_size
    )
    res: dict = {}
    for src in (0, 1, 2):
        tokens = TokenBroadcast(state, src=src)
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
    res["repr"] = repr(tokens)
    return res


def test_every_rank_gets_the_source_ids() -> None:
    results = launch(_worker, 3)
    for rank, res in enumerate(results):
        for src in (0, 1, 2):
            assert res[src] == [*IDS, []], (rank, src)
        assert res.get("mismatch") == (None if rank == 1 else [7, 8, 9])
        assert res["repr"] == f"TokenBroadcast(rank={rank}, src=2, world_size=3)"
