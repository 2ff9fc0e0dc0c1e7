"""ParallelState creates every group on every rank (gloo, forkserver, file:// init)."""

from __future__ import annotations

from medha_parallel import ParallelLayout, ParallelState

from .dist import launch


def _groups(rank, world_size, init, tp, spp, kvp):
    import torch
    import torch.distributed as dist

    state = ParallelState.initialize(
        ParallelLayout(tp=tp, spp=spp, kvp=kvp),
        init_method=init,
        rank=rank,
        world_size=world_size,
        timeout_s=30,
    )
    out = {"coords": tuple(state.coords), "ranks": state.ranks}
    x = torch.tensor([float(rank)])
    dist.all_reduce(x, group=state.tp_group)
    out["tp_sum"] = x.item()
    return out


def test_every_rank_sees_its_groups_on_four_ranks() -> None:
    results = launch(_groups, 4, 2, 1, 2)
    layout = ParallelLayout(tp=2, spp=1, kvp=2)
    for rank, res in enumerate(results):
        assert res["coords"] == tuple(layout.coords(rank))
        assert rank in res["ranks"]["tp"] and rank in res["ranks"]["kvp"]
        assert res["tp_sum"] == sum(res["ranks"]["tp"])
    assert results[0]["ranks"]["kvp2"] == [0, 2]
