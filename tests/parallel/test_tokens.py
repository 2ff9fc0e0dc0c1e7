"""TokenBroadcast: one rank's token ids reach every rank of the world (gloo, 2 ranks)."""

from __future__ import annotations

import pytest

from medha_parallel import ParallelLayout, ParallelState, TokenBroadcast

from .dist import launch

IDS = [[5, 0, 49151, 7], [2**40, -3], [11]]  # int64 range, any order; one launch sends each


def _worker(rank: int, world_size: int, init: str) -> dict:
    state = ParallelState.initialize(
        ParallelLayout(kvp=2), backend="gloo", init_method=init, rank=rank, world_size=world_size
    )
    res: dict = {}
    for src in (0, 1):
        tokens = TokenBroadcast(state, src=src)
        got = []
        for ids in IDS:
            got.append(tokens.broadcast(ids if rank == src else None, len(ids)))
        got.append(tokens.broadcast([] if rank == src else None, 0))
        res[src] = got
        if rank == src:
            with pytest.raises(ValueError, match=f"rank {src} sends 3 token ids, got 2"):
                tokens.broadcast([1, 2], 3)
    with pytest.raises(ValueError, match=r"src must be a rank in \[0, 2\), got 2"):
        TokenBroadcast(state, src=2)
    res["repr"] = repr(tokens)
    return res


def test_every_rank_gets_the_source_ids() -> None:
    results = launch(_worker, 2)
    for rank, res in enumerate(results):
        for src in (0, 1):
            assert res[src] == [*IDS, []], (rank, src)
        assert res["repr"] == f"TokenBroadcast(rank={rank}, src=1, world_size=2)"
