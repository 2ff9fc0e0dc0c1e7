"""``medha_kernels.linear``: the native small-M CPU kernels against a float64 truth.

Odd sizes on purpose: K not a multiple of the 8- or 16-lane vectors, N not a
multiple of the row kernel's 3-row tasks nor of the column kernel's 24-row
tasks and 6/8/12-row register blocks (28-row tasks, 14-row blocks and
128-step K slices at 17-32 rows), M on both sides of every block edge
(the row kernel below 9 rows, the column kernel's 16/32/48/64-row vectors);
with and without bias; the error is at most twice ``F.linear``'s in fp32.
"""

from __future__ import annotations

import importlib
import os
import platform
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from medha_kernels import linear, native
from medha_kernels.linear import SMALL_M_MAX, SMALL_M_MAX_AVX2, native_linear_available

from .reference import assert_twice_torch

# the module (the package's ``linear`` attribute is the function)
linear_module = importlib.import_module("medha_kernels.linear")

pytestmark = pytest.mark.skipif(
    not native.supports_device(torch.device("cpu")), reason="needs a C++ compiler and ninja"
)

ROWS = [1, 2, 3, 5, 8, 9, 13, 16, 17, 24, 31, 32, 33, 47, 48, 49, 63, SMALL_M_MAX]


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize(
    ("n", "k"), [(1, 7), (4, 8), (13, 577), (50, 1536), (61, 100), (31, 17), (7, 4099), (57, 300)]
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_small_m_matches_float64(m: int, n: int, k: int, with_bias: bool) -> None:
    x = torch.randn(m, k)
    w = torch.randn(n, k) / k**0.5
    b = torch.randn(n) if with_bias else None
    out = native.get_module("cpu").linear_small_m(x, w, b)  # the kernel, whatever the limit
    truth = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert out.dtype == torch.float32 and out.shape == (m, n)
    assert_twice_torch(out, truth, F.linear(x, w, b), what=f"linear m={m} n={n} k={k}")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("n", "k"), [(1, 7), (13, 577), (50, 1536), (7, 4099), (100, 300)])
def test_one_and_two_rows_give_the_bits_of_the_three_row_tasks(threads, n, k) -> None:
    """One or two x rows read w one row at a time (one stream); from three rows on, w is read
    three rows side by side. Each output is the same sum either way: the rows of a 1- or
    2-row product equal, bit for bit, the same rows of a 3- or 8-row product."""
    ext = native.get_module("cpu")
    x = torch.randn(8, k)
    w = torch.randn(n, k) / k**0.5
    b = torch.randn(n)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for bias in (None, b):
            eight = ext.linear_small_m(x, w, bias)
            three = ext.linear_small_m(x[5:8], w, bias)
            assert torch.equal(three, eight[5:8])
            for lo, hi in ((0, 1), (3, 5), (7, 8), (5, 7)):
                assert torch.equal(ext.linear_small_m(x[lo:hi], w, bias), eight[lo:hi])
    finally:
        torch.set_num_threads(previous)


def test_offset_inputs_and_large_values() -> None:
    # x a non-contiguous view, w a row slice of a larger matrix (contiguous, offset storage)
    base = torch.randn(40, 300) * 1e3
    x = base[:, 3:260:2]  # [40, 129], strided
    w_full = torch.randn(70, 129) * 1e-3
    w = w_full[5:62]
    b = torch.randn(57)
    out = linear(x, w, b)
    truth = F.linear(x.double(), w.double(), b.double())
    assert_twice_torch(out, truth, F.linear(x, w, b), what="linear offset/strided")


def test_native_path_is_taken_and_others_fall_back() -> None:
    assert native_linear_available()  # this machine builds the vectorized kernel
    module = native.get_module("cpu")
    limit = linear_module.native_row_limit()
    expected = {"avx512": SMALL_M_MAX, "avx2": SMALL_M_MAX_AVX2}[module.linear_small_m_isa]
    assert limit == expected
    w = torch.randn(7, 33)
    for m in (4, limit):
        x = torch.randn(m, 33)
        torch.testing.assert_close(module.linear_small_m(x, w, None), linear(x, w), rtol=0, atol=0)
    # more rows, other dtypes, a 3-D input, autograd: plain F.linear
    x = torch.randn(4, 33)
    big = torch.randn(limit + 1, 33)
    assert torch.equal(linear(big, w), F.linear(big, w))
    xb, wb = x.bfloat16(), w.bfloat16()
    assert torch.equal(linear(xb, wb), F.linear(xb, wb))
    x3 = torch.randn(2, 3, 33)
    assert torch.equal(linear(x3, w), F.linear(x3, w))
    wg = w.clone().requires_grad_(True)
    linear(x, wg).sum().backward()
    assert wg.grad is not None
    with pytest.raises(RuntimeError, match="expected x \\[M, K\\] and w \\[N, K\\]"):
        module.linear_small_m(x, torch.randn(7, 32), None)


class _Recorder:
    """A stand-in native module that records the row counts it is given."""

    def __init__(self, isa: str) -> None:
        self.linear_small_m_isa = isa
        self.rows: list[int] = []

    def linear_small_m(self, x, w, bias):
        self.rows.append(x.shape[0])
        return F.linear(x, w, bias)


@pytest.mark.parametrize(("isa", "limit"), [("avx512", 64), ("avx2", 16), ("", 0)])
def test_row_limit_follows_the_build(monkeypatch, isa: str, limit: int) -> None:
    fake = _Recorder(isa)
    monkeypatch.setattr(linear_module, "_module", lambda: fake)
    assert linear_module.native_row_limit() == limit
    w = torch.randn(5, 12)
    for m in (1, 9, 16, 17, 64, 65):
        linear(torch.randn(m, 12), w)
    assert fake.rows == [m for m in (1, 9, 16, 17, 64, 65) if m <= limit]


def test_avx2_build_runs_and_keeps_its_limit(tmp_path) -> None:
    """A build for an AVX2-only CPU (torch told so) has the row kernel only, up to 16 rows."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    env = {**os.environ, "MEDHA_CACHE_DIR": str(tmp_path), "ATEN_CPU_CAPABILITY": "avx2"}
    code = (
        "import torch, torch.nn.functional as F\n"
        "import importlib\n"
        "L = importlib.import_module('medha_kernels.linear')\n"
        "from medha_kernels import native\n"
        "m = native.get_module('cpu')\n"
        "errs = []\n"
        "for rows in (1, 5, 13, 16):\n"
        "    x, w, b = torch.randn(rows, 577), torch.randn(29, 577) / 24, torch.randn(29)\n"
        "    t = F.linear(x.double(), w.double(), b.double())\n"
        "    errs.append((m.linear_small_m(x, w, b).double() - t).abs().max().item()\n"
        "                / max((F.linear(x, w, b).double() - t).abs().max().item(), 1e-6))\n"
        "print('ISA', repr(m.linear_small_m_isa), L.native_row_limit(), max(errs))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("ISA"))
    _, isa, limit, worst = line.split()
    assert isa == ("'avx2'" if x86 else "''")
    assert int(limit) == (SMALL_M_MAX_AVX2 if x86 else 0)
    assert float(worst) <= 2.0, line
