"""The native ``publish_merge_states``: one rank's step of a shared-memory merge.

Single process: the flags are an int32 tensor laid out as ``medha_parallel.shm``'s
(one per rank, 64 bytes apart, the sleeping word next to each); the peers' flags
and slots are written by the test. The merged state must be bit for bit the native
``merge_states`` of the same buffer, and within twice plain torch's fp32 error of the
float64 merge.
"""

from __future__ import annotations

import time

import pytest
import torch

from medha_kernels import native
from medha_parallel.merge import merge_partials

from .reference import assert_twice_torch, merge_ref

pytestmark = pytest.mark.skipif(
    not native.supports_device(torch.device("cpu")), reason="no C++ toolchain"
)

STRIDE = 64  # bytes between two ranks' flags, as medha_parallel.shm
WORDS = STRIDE // 4


def _ext():
    return native.get_module("cpu")


def _setup(num_q: int, size: int, index: int, seed: int):
    """fp32 states ``[num_q, size, 4, 16]`` / ``[num_q, size, 4]`` (the peers' filled, this
    rank's slots NaN), this rank's ``out`` / ``lse`` and zeroed flags ``[size * 16]`` int32."""
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(num_q, size, 4, 16, generator=gen)
    s = 3 * torch.randn(num_q, size, 4, generator=gen)
    s[0, (index + 1) % size, seed % 4] = float("-inf")  # a head a peer saw no key of
    out, lse = v[:, index].clone(), s[:, index].clone()
    v[:, index], s[:, index] = float("nan"), float("nan")
    return v, s, out, lse, torch.zeros(size * WORDS, dtype=torch.int32)


def _check(v, s, out, lse, index, merged):
    want_v, want_s = v.clone(), s.clone()
    want_v[:, index], want_s[:, index] = out, lse
    torch.testing.assert_close(v, want_v, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(s, want_s, rtol=0, atol=0, equal_nan=True)
    got_o, got_l = merged
    ref_o, ref_l = _ext().merge_states(want_v, want_s)
    assert torch.equal(got_o, ref_o) and torch.equal(got_l, ref_l)
    # against float64, within twice plain torch's fp32 error (merge_partials: states first)
    truth = merge_ref(want_v, want_s)
    base = merge_partials(want_v.transpose(0, 1), want_s.transpose(0, 1))
    assert_twice_torch(got_o, truth[0], base[0])
    assert_twice_torch(got_l, truth[1], base[1])


@pytest.mark.parametrize("size,index,num_q", [(2, 0, 1), (2, 1, 1), (3, 1, 5), (4, 3, 2)])
def test_peers_arrived_merges_bit_for_bit(size: int, index: int, num_q: int) -> None:
    v, s, out, lse, flags = _setup(num_q, size, index, seed=size + index)
    seq = 7
    flags[::WORDS] = seq
    flags[index * WORDS] = seq - 1  # this rank's flag: the last exchange's
    merged = _ext().publish_merge_states(out, lse, v, s, index, flags.data_ptr(), STRIDE, seq, 0.0)
    assert merged is not None
    assert int(flags[index * WORDS]) == seq
    _check(v, s, out, lse, index, merged)


def test_non_contiguous_state_is_copied() -> None:
    v, s, out, lse, flags = _setup(3, 2, 1, seed=3)
    out = out.transpose(1, 2).contiguous().transpose(1, 2)  # same values, strided
    assert not out.is_contiguous()
    flags[::WORDS] = 1
    merged = _ext().publish_merge_states(out, lse, v, s, 1, flags.data_ptr(), STRIDE, 1, 0.0)
    assert merged is not None
    _check(v, s, out, lse, 1, merged)


def test_a_state_that_requires_grad_is_copied_in_grad_mode() -> None:
    """A direct library call in grad mode (the runner's steps run under no_grad) with a
    strided state that requires grad: its copy into the slots takes the values."""
    v, s, out, lse, flags = _setup(3, 2, 0, seed=5)
    out = out.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    lse = lse.clone().requires_grad_()
    flags[::WORDS] = 1
    with torch.enable_grad():
        merged = _ext().publish_merge_states(out, lse, v, s, 0, flags.data_ptr(), STRIDE, 1, 0.0)
    assert merged is not None
    _check(v, s, out.detach(), lse.detach(), 0, merged)


def test_late_peer_returns_none_after_the_spin() -> None:
    v, s, out, lse, flags = _setup(1, 2, 0, seed=4)
    flags[WORDS] = 4  # the peer is one exchange behind
    t0 = time.perf_counter()
    merged = _ext().publish_merge_states(out, lse, v, s, 0, flags.data_ptr(), STRIDE, 5, 2e-3)
    assert merged is None
    assert time.perf_counter() - t0 >= 2e-3  # it spun, then gave up
    assert int(flags[0]) == 5  # published all the same
    assert torch.equal(v[:, 0], out) and torch.equal(s[:, 0], lse)
    flags[WORDS] = 5  # the peer arrives: the caller merges the same buffer
    _check(v, s, out, lse, 0, _ext().merge_states(v, s))


def test_flags_wrap_modulo_2_32_and_sleepers_are_woken() -> None:
    v, s, out, lse, flags = _setup(1, 2, 1, seed=5)
    seq = 2**32 + 3  # stored as 3; a peer's 3 (or 4) has reached it, a peer's 2 has not
    flags[0], flags[1] = 4, 1  # the peer is ahead and sleeps: a futex wake (no waiter here)
    merged = _ext().publish_merge_states(out, lse, v, s, 1, flags.data_ptr(), STRIDE, seq, 0.0)
    assert merged is not None and int(flags[WORDS]) == 3
    _check(v, s, out, lse, 1, merged)
    flags[0] = 2
    late = _ext().publish_merge_states(out, lse, v, s, 1, flags.data_ptr(), STRIDE, seq, 0.0)
    assert late is None
    flags[0] = -(2**31)  # 2**31 behind 3 modulo 2**32 (int32): not reached
    assert (
        _ext().publish_merge_states(out, lse, v, s, 1, flags.data_ptr(), STRIDE, 3 + 2**31, 0.0)
        is None
    )


def test_bad_arguments_are_refused() -> None:
    v, s, out, lse, flags = _setup(1, 2, 0, seed=6)
    ext = _ext()
    with pytest.raises(RuntimeError, match="index 2"):
        ext.publish_merge_states(out, lse, v, s, 2, flags.data_ptr(), STRIDE, 1, 0.0)
    with pytest.raises(RuntimeError, match="out: expected fp32"):
        ext.publish_merge_states(out[:, :2], lse, v, s, 0, flags.data_ptr(), STRIDE, 1, 0.0)
    with pytest.raises(RuntimeError, match="lse: expected fp32"):
        ext.publish_merge_states(out, lse.double(), v, s, 0, flags.data_ptr(), STRIDE, 1, 0.0)
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        ext.publish_merge_states(out, lse, v.half(), s, 0, flags.data_ptr(), STRIDE, 1, 0.0)
    with pytest.raises(RuntimeError, match="flags"):
        ext.publish_merge_states(out, lse, v, s, 0, 0, STRIDE, 1, 0.0)
    assert int(flags[0]) == 0  # nothing published
