"""ParallelState creates every group on every rank (gloo, forkserver, file:// init)."""

from __future__ import annotations

from medha_parallel import ParallelLayout, ParallelState
from medha_parallel.state import MIXED_BACKEND, resolve_backend

from .dist import launch


def _groups(rank, world_size, init, tp, spp, kvp):
    import torch
    import torch.distributed as dist

    state = ParallelState.initialize(
        ParallelLayout(tp=tp, spp=spp, kvp=kvp),
        backend="gloo",
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


def _automatic(rank, world_size, init):
    import torch
    import torch.distributed as dist

    state = ParallelState.initialize(  # no backend, no device: what a user gets by default
        ParallelLayout(tp=2), init_method=init, rank=rank, world_size=world_size, timeout_s=30
    )
    x = torch.tensor([float(rank + 1)])  # a CPU tensor, on a CUDA machine too
    dist.all_reduce(x, group=state.tp_group)
    return {"backend": state.backend, "sum": x.item()}


def test_the_automatic_backend_carries_cpu_tensors_on_any_machine() -> None:
    import torch

    want = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    for res in launch(_automatic, 2):
        assert res == {"backend": want, "sum": 3.0}


def test_resolve_backend() -> None:
    import pytest
    import torch

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_backend(None, None, cuda_available=False) == ("gloo", cpu)
    assert resolve_backend(None, None, cuda_available=True) == (MIXED_BACKEND, cuda)
    assert resolve_backend(None, "cpu", cuda_available=True) == (MIXED_BACKEND, cpu)
    assert resolve_backend("gloo", None, cuda_available=True) == ("gloo", cpu)
    assert resolve_backend("nccl", None, cuda_available=True) == ("nccl", cuda)
    assert resolve_backend(MIXED_BACKEND, "cuda", cuda_available=True)[1] == cuda
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_backend(None, "cuda", cuda_available=False)
    with pytest.raises(ValueError, match="backend 'gloo' has no CUDA"):
        resolve_backend("gloo", "cuda", cuda_available=True)
    with pytest.raises(ValueError, match="device 'cpu' needs a backend that carries CPU tensors"):
        resolve_backend("nccl", "cpu", cuda_available=True)
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda', got 'tpu'"):
        resolve_backend(None, "tpu", cuda_available=False)


def test_initialize_refuses_a_timeout_that_is_not_a_positive_number(tmp_path) -> None:
    """Checked before joining: a negative timeout failed inside gloo ("timeout.count()
    >= 0. Invalid timeout"), NaN as "cannot convert float NaN to integer"."""
    import pytest
    import torch.distributed as dist

    for bad in (-5, float("nan"), float("inf"), 0, "10"):
        with pytest.raises(
            ValueError, match=f"timeout_s must be a finite number of seconds > 0, got {bad!r}"
        ):
            ParallelState.initialize(
                ParallelLayout(),
                backend="gloo",
                init_method=f"file://{tmp_path / 'init'}",
                rank=0,
                world_size=1,
                timeout_s=bad,
            )
    assert not dist.is_initialized()
