"""TPCommunicator and the column/row parallel linear layers against one process.

All TP2 sub-cases run in one gloo launch (module fixture); each rank returns
its results and the tests compare them with the single-process computation.
The launch ends with a timeout case on groups built with ``timeout_s=3``.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from medha_parallel import CommunicationError, ParallelLayout, ParallelState
from medha_parallel.linear import ColumnParallelLinear, RowParallelLinear
from medha_parallel.tp import TPCommunicator
from tests.numerics import assert_twice_torch

from .dist import launch

TP = 2
DTYPES = (torch.float32, torch.bfloat16)


def _inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    """Every rank's input ``[6, 4]`` (the same on every process)."""
    gen = torch.Generator().manual_seed(1234)
    return [(3 * torch.randn(6, 4, generator=gen)).to(dtype) for _ in range(TP)]


def _mlp() -> tuple[nn.Linear, nn.Linear, torch.Tensor]:
    """A seeded MLP hidden 16 -> ffn 32 -> hidden 16, and an input ``[7, 16]``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        fc1, fc2 = nn.Linear(16, 32), nn.Linear(32, 16)
        x = torch.randn(7, 16)
    return fc1, fc2, x


def _mlp_ref(fc1: nn.Linear, fc2: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return fc2(F.gelu(fc1(x)))


def _tp_worker(rank: int, world_size: int, init: str) -> dict:
    layout = ParallelLayout(tp=TP)
    state = ParallelState.initialize(
        layout, backend="gloo", init_method=init, rank=rank, world_size=world_size, timeout_s=30
    )
    comm = TPCommunicator(state)
    res: dict = {"rank": comm.rank, "world_size": comm.world_size}
    for dtype in DTYPES:
        x = _inputs(dtype)[rank]
        before = x.clone()
        res[dtype, "all_reduce"] = comm.all_reduce(x)
        res[dtype, "all_gather0"] = comm.all_gather(x, dim=0)
        res[dtype, "all_gather1"] = comm.all_gather(x, dim=-1)
        res[dtype, "reduce_scatter0"] = comm.reduce_scatter(x, dim=0)
        res[dtype, "reduce_scatter1"] = comm.reduce_scatter(x, dim=1)
        res[dtype, "input_unchanged"] = torch.equal(x, before)
    try:  # rejected before any collective, so the group stays usable
        comm.reduce_scatter(torch.ones(5, 3), dim=0)
    except ValueError as exc:
        res["indivisible"] = str(exc)

    with torch.no_grad():
        for dtype in DTYPES:
            fc1, fc2, x = (m.to(dtype) for m in _mlp())  # Module.to is in place: fresh copies
            col = ColumnParallelLinear.from_linear(fc1, comm=comm)
            row = RowParallelLinear.from_linear(fc2, comm=comm)
            res[dtype, "mlp"] = row(F.gelu(col(x)))
            res[dtype, "shards"] = (tuple(col.weight.shape), tuple(row.weight.shape))
        fc1, fc2, x = _mlp()
        gathered = ColumnParallelLinear.from_linear(fc1, comm=comm, gather_output=True)
        res["column_gathered"] = gathered(x)
        full_in = RowParallelLinear.from_linear(fc2, comm=comm, input_is_parallel=False)
        res["row_full_input"] = full_in(F.gelu(fc1(x)))

    # Groups rebuilt with a 3 s timeout: rank 1 skips the all-reduce, rank 0 must
    # get a CommunicationError (not hang); rank 1 waits for it, then exits.
    short = TPCommunicator(
        ParallelState.initialize(layout, backend="gloo", init_method=init, rank=rank, timeout_s=3)
    )
    flag = Path(init.removeprefix("file://")).with_name("tp_timeout_seen")
    if rank == 0:
        start = time.monotonic()
        try:
            short.all_reduce(torch.ones(8))
            res["timeout"] = None
        except CommunicationError as exc:
            res["timeout"] = (str(exc), time.monotonic() - start)
        flag.touch()
    else:
        deadline = time.monotonic() + 60
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    return res


@pytest.fixture(scope="module")
def tp2() -> list[dict]:
    return launch(_tp_worker, TP)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_tp2_collectives_equal_the_single_process_computation(tp2, dtype) -> None:
    xs = _inputs(dtype)
    total = (xs[0].float() + xs[1].float()).to(dtype)  # fp32 sum, cast back
    for rank, res in enumerate(tp2):
        assert (res["rank"], res["world_size"]) == (rank, TP)
        assert res[dtype, "input_unchanged"]
        for name in ("all_reduce", "all_gather0", "all_gather1", "reduce_scatter0"):
            assert res[dtype, name].dtype == dtype, name
        torch.testing.assert_close(res[dtype, "all_reduce"], total, rtol=0, atol=0)
        torch.testing.assert_close(res[dtype, "all_gather0"], torch.cat(xs, 0), rtol=0, atol=0)
        torch.testing.assert_close(res[dtype, "all_gather1"], torch.cat(xs, 1), rtol=0, atol=0)
        torch.testing.assert_close(
            res[dtype, "reduce_scatter0"], total.chunk(TP, 0)[rank], rtol=0, atol=0
        )
        torch.testing.assert_close(
            res[dtype, "reduce_scatter1"], total.chunk(TP, 1)[rank], rtol=0, atol=0
        )
    assert "not divisible" in tp2[0]["indivisible"]


def test_tp2_column_row_mlp_matches_single_process_mlp(tp2) -> None:
    fc1, fc2, x = _mlp()
    ref = _mlp_ref(fc1, fc2, x)  # one process, fp32: the baseline
    fc1_64, fc2_64, x_64 = (m.double() for m in _mlp())  # the same seeded MLP, in float64
    truth = _mlp_ref(fc1_64, fc2_64, x_64)
    with torch.no_grad():
        h, h_truth = fc1(x), fc1_64(x_64)
    ref_bf16 = _mlp_ref(*(m.to(torch.bfloat16) for m in _mlp()))
    baseline_err = (ref_bf16.float() - ref).abs().max().item()
    for res in tp2:
        assert res[torch.float32, "shards"] == ((16, 16), (16, 16))
        assert_twice_torch(res[torch.float32, "mlp"], truth, ref, what="TP2 MLP")
        assert_twice_torch(res["column_gathered"], h_truth, h, what="gathered column output")
        assert_twice_torch(res["row_full_input"], truth, ref, what="row-parallel on full input")
        out_bf16 = res[torch.bfloat16, "mlp"]
        assert out_bf16.dtype == torch.bfloat16
        assert (out_bf16.float() - ref).abs().max().item() <= 2 * baseline_err + 1e-3
    torch.testing.assert_close(tp2[0][torch.float32, "mlp"], tp2[1][torch.float32, "mlp"])


def test_tp_timeout_raises_communication_error_naming_group_and_op(tp2) -> None:
    outcome = tp2[0]["timeout"]
    assert outcome is not None, "all_reduce with a missing peer returned instead of failing"
    message, elapsed = outcome
    assert "all_reduce on the tp group failed" in message
    assert 2.0 < elapsed < 30.0, f"expected the 3 s group timeout, took {elapsed:.1f}s"


def test_world_size_one_is_a_no_op_without_processes() -> None:
    comm = TPCommunicator()
    assert (comm.rank, comm.world_size) == (0, 1)
    x = torch.randn(3, 4)
    assert comm.all_reduce(x) is x
    assert comm.all_gather(x, dim=1) is x
    assert comm.reduce_scatter(x, dim=0) is x
    fc1, fc2, x = _mlp()
    col, row = ColumnParallelLinear.from_linear(fc1), RowParallelLinear.from_linear(fc2)
    assert col.weight.shape == fc1.weight.shape and row.weight.shape == fc2.weight.shape
    with torch.no_grad():
        torch.testing.assert_close(row(F.gelu(col(x))), _mlp_ref(fc1, fc2, x))


def test_layers_reject_sizes_that_do_not_split_and_init_like_nn_linear() -> None:
    class FakeTP(TPCommunicator):
        def __init__(self, rank: int, world_size: int) -> None:
            self.group, self.rank, self.world_size = None, rank, world_size

    with pytest.raises(ValueError, match="out_features=15 is not divisible by the TP degree 2"):
        ColumnParallelLinear(8, 15, comm=FakeTP(0, 2))
    with pytest.raises(ValueError, match="in_features=15 is not divisible"):
        RowParallelLinear(15, 8, comm=FakeTP(1, 2))
    row = RowParallelLinear(64, 8, comm=FakeTP(1, 4))
    assert row.weight.shape == (8, 16) and row.bias.shape == (8,)
    bound = 1 / 64**0.5  # the full fan-in, not the shard's
    assert row.weight.abs().max().item() <= bound
    assert row.weight.abs().max().item() > bound / 2
    fc = nn.Linear(6, 8)
    shard = ColumnParallelLinear.from_linear(fc, comm=FakeTP(1, 2))
    torch.testing.assert_close(shard.weight, fc.weight[4:8])
    torch.testing.assert_close(shard.bias, fc.bias[4:8])
