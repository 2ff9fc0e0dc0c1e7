"""The ``native`` backend (C++ on CPU, CUDA on GPU) through the public merge API.

Accuracy follows flash-attention's rule against a float64 truth; edge cases and
masking are checked exactly. The first test to run compiles the CPU extension
(or loads it from the on-disk cache).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from medha_kernels import (
    available_backends,
    merge_state,
    merge_state_in_place,
    merge_states,
    native,
)
from medha_kernels.native import jit

from .reference import assert_twice_torch, merge_ref

NAN, INF = float("nan"), float("inf")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    ),
]
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _states(t: int, n: int, h: int, d: int, dtype: torch.dtype, device: str):
    v = torch.randn(t, n, h, d, device=device).to(dtype)
    s = torch.randn(t, n, h, device=device) * 4
    return v, s


def _check(v_out, s_out, v, s, *, baseline=None) -> None:
    """Error vs float64 truth at most twice the baseline's (default: naive torch)."""
    assert v_out.dtype == v.dtype and s_out.dtype == torch.float32
    assert v_out.shape == (v.shape[0], *v.shape[2:]) and s_out.shape == (s.shape[0], s.shape[2])
    truth_v, truth_s = merge_ref(v, s, upcast=True)
    base_v, base_s = baseline if baseline is not None else merge_ref(v, s, upcast=False)
    assert_twice_torch(v_out, truth_v, base_v, what="v")
    assert_twice_torch(s_out, truth_s, base_s, what="s")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    bits = BITS.get(a.dtype, torch.int32)
    return a.dtype == b.dtype and torch.equal(a.view(bits), b.view(bits))


# --- backend contract, build and cache --------------------------------------------------


def test_supports_device_and_registry() -> None:
    assert native.supports_device(torch.device("cpu"))
    assert "native" in available_backends("cpu")
    assert not native.supports_device(torch.device("meta"))
    from torch.utils.cpp_extension import CUDA_HOME

    expected = torch.cuda.is_available() and CUDA_HOME is not None
    assert native.supports_device(torch.device("cuda")) == expected


def _run(code: str, env: dict[str, str]) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_import_and_supports_device_build_nothing(tmp_path) -> None:
    env = {**os.environ, "MEDHA_CACHE_DIR": str(tmp_path)}
    code = (
        "import torch, medha_kernels.native as n; from medha_kernels import available_backends\n"
        "print(n.supports_device(torch.device('cpu')), available_backends('cpu'))"
    )
    out = _run(code, env)
    assert out.startswith("True") and "native" in out
    assert list(tmp_path.iterdir()) == []


def test_cache_root_follows_the_model_cache(monkeypatch, tmp_path) -> None:
    """The build cache is where fetched models go: ``$MEDHA_CACHE_DIR`` (``~``
    expanded), else ``$XDG_CACHE_HOME/medha``, else ``~/.cache/medha``."""
    from medha_runtime.model.smollm2 import cache_dir

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("MEDHA_CACHE_DIR", "~/m")
    assert jit.cache_root() == cache_dir() == tmp_path / "m"
    monkeypatch.delenv("MEDHA_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert jit.cache_root() == cache_dir() == tmp_path / "xdg" / "medha"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert jit.cache_root() == cache_dir() == tmp_path / ".cache" / "medha"


def test_second_process_reuses_the_build() -> None:
    jit.get_module("cpu")  # built (or loaded) by this process
    library = jit.load_info("cpu").library
    assert library.is_file() and library.parent == jit.build_directory("cpu")
    mtime = library.stat().st_mtime_ns
    code = (
        "import torch; from medha_kernels.native import jit; import medha_kernels as mk\n"
        "jit.get_module('cpu'); info = jit.load_info('cpu')\n"
        "v, s = mk.merge_state(torch.ones(2, 1, 4), torch.zeros(2, 1), torch.zeros(2, 1, 4),\n"
        "                      torch.zeros(2, 1), backend='native')\n"
        "print('MEDHA_LOAD', info.built, f'{info.seconds:.3f}', info.library, v[0, 0, 0].item())"
    )
    line = next(x for x in _run(code, dict(os.environ)).splitlines() if x.startswith("MEDHA_LOAD"))
    _, built, seconds, path, value = line.split()
    assert built == "False", line
    assert path == str(library) and library.stat().st_mtime_ns == mtime
    assert float(seconds) < 5.0 and float(value) == 0.5


# --- accuracy -----------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 59])
@pytest.mark.parametrize("num_tokens", [1, 97, 1025])
@pytest.mark.parametrize("num_heads", [1, 32])
def test_merge_state_vs_truth(device, dtype, head_dim, num_tokens, num_heads) -> None:
    v, s = _states(num_tokens, 2, num_heads, head_dim, dtype, device)
    v_out, s_out = merge_state(v[:, 0], s[:, 0], v[:, 1], s[:, 1], backend="native")
    assert v_out.device == v.device
    _check(v_out, s_out, v, s)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_states", [0, 1, 3, 7])
@pytest.mark.parametrize("head_dim", [128, 59])
def test_merge_states_vs_truth(device, dtype, num_states, head_dim) -> None:
    v, s = _states(97, num_states, 32, head_dim, dtype, device)
    v_out, s_out = merge_states(v, s, backend="native")
    assert v_out.shape == (97, 32, head_dim) and v_out.dtype == dtype
    if num_states == 0:
        assert torch.equal(v_out, torch.zeros_like(v_out))
        assert torch.equal(s_out, torch.full_like(s_out, -INF))
    elif num_states == 1:  # weight exp(0) = 1: an exact copy
        assert _same_bits(v_out, v[:, 0]) and _same_bits(s_out, s[:, 0])
    else:
        _check(v_out, s_out, v, s)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_parity_with_torch_backend(device, dtype) -> None:
    """Native's error vs the float64 truth is at most twice the torch backend's."""
    v, s = _states(257, 3, 8, 96, dtype, device)
    got = merge_states(v, s, backend="native")
    _check(*got, v, s, baseline=merge_states(v, s, backend="torch"))
    pair = (v[:, 0], s[:, 0], v[:, 1], s[:, 1])
    got2 = merge_state(*pair, backend="native")
    _check(*got2, v[:, :2], s[:, :2], baseline=merge_state(*pair, backend="torch"))


# --- edge cases ---------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_empty_states_are_ignored(device, dtype) -> None:
    """-inf, +inf and NaN LSE are empty; their (NaN, inf, huge) v never leaks."""
    t, h, d = 6, 4, 64
    v_a = torch.randn(t, h, d, device=device).to(dtype)
    v_b = torch.randn(t, h, d, device=device).to(dtype)
    s_b = torch.randn(t, h, device=device)
    for empty in (-INF, INF, NAN):
        for garbage in (NAN, INF, -INF, 6e4):
            s_a = torch.full((t, h), empty, device=device)
            junk = torch.full_like(v_a, garbage)
            v_out, s_out = merge_state(junk, s_a, v_b, s_b, backend="native")
            assert _same_bits(v_out, v_b) and _same_bits(s_out, s_b), (empty, garbage)
            v_out, s_out = merge_state(v_b, s_b, junk, s_a, backend="native")  # other order
            assert _same_bits(v_out, v_b) and _same_bits(s_out, s_b), (empty, garbage)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_empty_gives_zero_and_neg_inf(device, dtype) -> None:
    empties = torch.tensor([-INF, INF, NAN], device=device)
    s = torch.cartesian_prod(empties, empties).view(9, 2, 1).expand(9, 2, 3).contiguous()
    v = torch.full((9, 2, 3, 59), NAN, device=device).to(dtype)
    for v_out, s_out in (
        merge_state(v[:, 0], s[:, 0], v[:, 1], s[:, 1], backend="native"),
        merge_states(v, s, backend="native"),
        merge_states(v[:, :1], s[:, :1], backend="native"),
    ):
        assert torch.equal(v_out, torch.zeros_like(v_out)), v_out
        assert torch.equal(s_out, torch.full_like(s_out, -INF))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("offset", [1e4, -1e4])
def test_large_common_offset(device, dtype, offset) -> None:
    """Weights are exp(s - max): a common ±1e4 offset neither overflows nor underflows."""
    t, h, d = 33, 4, 128
    v_a = torch.full((t, h, d), 1.0, device=device).to(dtype)
    v_b = torch.full((t, h, d), 3.0, device=device).to(dtype)
    s = torch.full((t, h), offset, device=device)
    v_out, s_out = merge_state(v_a, s, v_b, s, backend="native")  # ties: weights exactly 0.5
    assert torch.equal(v_out, torch.full_like(v_out, 2.0))
    _check(v_out, s_out, torch.stack((v_a, v_b), 1), torch.stack((s, s), 1))
    v, s = _states(t, 5, h, d, dtype, device)
    _check(*merge_states(v, s + offset, backend="native"), v, s + offset)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_very_negative_finite_lse_is_not_empty(device, dtype) -> None:
    t, h, d = 5, 3, 64
    v_a = torch.randn(t, h, d, device=device).to(dtype)
    v_b = torch.randn(t, h, d, device=device).to(dtype)
    low = torch.full((t, h), -1e30, device=device)
    v_out, s_out = merge_state(v_a, low, v_b, torch.full_like(low, -INF), backend="native")
    assert _same_bits(v_out, v_a) and _same_bits(s_out, low)
    v_out, s_out = merge_state(v_a, low, v_b, low, backend="native")
    assert torch.isfinite(s_out).all() and torch.allclose(s_out, low)
    mean = ((v_a.float() + v_b.float()) / 2).to(dtype)
    assert torch.allclose(v_out.float(), mean.float(), rtol=1e-2, atol=1e-2)
    # Against a state at LSE 0, exp(-1e30) underflows to 0: its v is not read.
    v_out, _ = merge_state(torch.full_like(v_a, NAN), low, v_b, low + 1e30, backend="native")
    assert _same_bits(v_out, v_b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mixed_empty_states_vs_truth(device, dtype) -> None:
    v, s = _states(64, 7, 8, 59, dtype, device)
    kind = torch.randint(0, 6, s.shape, device=device)
    s = torch.where(kind == 0, -INF, torch.where(kind == 1, INF, torch.where(kind == 2, NAN, s)))
    s[:4] = -INF  # whole rows empty
    v = torch.where((kind < 3).unsqueeze(-1), torch.full_like(v, NAN), v)
    v_out, s_out = merge_states(v, s, backend="native")
    assert torch.equal(v_out[:4], torch.zeros_like(v_out[:4])) and (s_out[:4] == -INF).all()
    _check(v_out, s_out, v, s)


@pytest.mark.parametrize("device", DEVICES)
def test_zero_tokens_and_non_contiguous_inputs(device) -> None:
    z = torch.empty(0, 4, 64, device=device)
    v_out, s_out = merge_state(z, z[..., 0], z, z[..., 0], backend="native")
    assert v_out.shape == (0, 4, 64) and s_out.shape == (0, 4)
    v, s = _states(8, 2, 4, 64, torch.float16, device)
    v_t = v.transpose(0, 2).contiguous().transpose(0, 2)  # same values, strided
    s_t = s.transpose(0, 2).contiguous().transpose(0, 2)
    assert not v_t.is_contiguous() and torch.equal(v_t, v)
    expected = merge_state(v[:, 0], s[:, 0], v[:, 1], s[:, 1], backend="native")
    got = merge_state(v_t[:, 0], s_t[:, 0], v_t[:, 1], s_t[:, 1], backend="native")
    assert all(_same_bits(a, b) for a, b in zip(got, expected, strict=True))
    got = merge_states(v_t, s_t, backend="native")
    assert all(_same_bits(a, b) for a, b in zip(got, expected, strict=True))


# --- in place -----------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_in_place_masks(device, dtype) -> None:
    t, h, d = 97, 32, 128
    v, s = _states(t, 2, h, d, dtype, device)
    v[3, 0] = NAN  # garbage in rows that masks leave alone must stay bit-identical
    s[5, 0] = NAN
    v0, s0, v1, s1 = v[:, 0].clone(), s[:, 0].clone(), v[:, 1].clone(), s[:, 1].clone()
    ref_v, ref_s = merge_state(v0, s0, v1, s1, backend="native")

    for mask in (None, torch.ones(t, dtype=torch.bool, device=device)):
        vv, ss = v0.clone(), s0.clone()
        merge_state_in_place(vv, ss, v1, s1, mask=mask, backend="native")
        assert _same_bits(vv, ref_v) and _same_bits(ss, ref_s)
        assert not _same_bits(vv, v0)  # something did change

    vv, ss = v0.clone(), s0.clone()
    merge_state_in_place(vv, ss, v1, s1, mask=torch.zeros(t, dtype=torch.bool, device=device))
    assert _same_bits(vv, v0) and _same_bits(ss, s0)

    gen = torch.Generator().manual_seed(1)
    for _ in range(8):
        mask = (torch.rand(t, generator=gen) > 0.5).to(device)
        mask[3] = mask[5] = False
        vv, ss = v0.clone(), s0.clone()
        merge_state_in_place(vv, ss, v1, s1, mask=mask, backend="native")
        assert _same_bits(vv[~mask], v0[~mask]) and _same_bits(ss[~mask], s0[~mask])
        assert _same_bits(vv[mask], ref_v[mask]) and _same_bits(ss[mask], ref_s[mask])


@pytest.mark.parametrize("device", DEVICES)
def test_in_place_on_strided_views(device) -> None:
    """A non-contiguous target: only the selected rows of the view change."""
    t, h, d = 40, 4, 64
    base_v = torch.randn(t, 2 * h, d, device=device)
    base_s = torch.randn(t, 2 * h, device=device)
    v, s = base_v[:, ::2], base_s[:, ::2]  # every other head
    assert not v.is_contiguous() and not s.is_contiguous()
    v1, s1 = torch.randn(t, h, d, device=device), torch.randn(t, h, device=device)
    ref_v, ref_s = merge_state(v.contiguous(), s.contiguous(), v1, s1, backend="native")
    before_v, before_s = base_v.clone(), base_s.clone()
    mask = torch.arange(t, device=device) % 3 == 0
    merge_state_in_place(v, s, v1, s1, mask=mask, backend="native")
    assert torch.equal(v[mask], ref_v[mask]) and torch.equal(s[mask], ref_s[mask])
    assert torch.equal(base_v[~mask], before_v[~mask]) and torch.equal(
        base_s[~mask], before_s[~mask]
    )
    assert torch.equal(base_v[:, 1::2], before_v[:, 1::2])  # other heads untouched
    merge_state_in_place(v, s, v1, s1, backend="native")  # no mask: every row
    assert torch.equal(base_v[:, 1::2], before_v[:, 1::2])
    assert not torch.equal(base_v[~mask, ::2], before_v[~mask, ::2])


# --- CUDA only: 64-bit offsets --------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_offsets_beyond_int32() -> None:
    if torch.cuda.get_device_properties(0).total_memory < 24 * 2**30:
        pytest.skip("needs a GPU with 24 GiB")
    h, d = 8, 128
    t = 2**31 // (h * d) + 3  # T * H * D > 2^31 elements
    v_a = torch.randn(t, h, d, device="cuda", dtype=torch.float16)
    v_b = torch.randn_like(v_a)
    s_a, s_b = torch.randn(t, h, device="cuda"), torch.randn(t, h, device="cuda")
    v_out, s_out = merge_state(v_a, s_a, v_b, s_b, backend="native")
    rows = torch.tensor([0, t // 2, t - 2, t - 1], device="cuda")
    pick = (
        torch.stack((v_a[rows], v_b[rows]), 1),
        torch.stack((s_a[rows], s_b[rows]), 1),
    )
    _check(v_out[rows], s_out[rows], *pick)
