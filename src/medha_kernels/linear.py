"""``linear(x, weight, bias)``: ``x @ weight.T + bias``, with a native path for decode batches.

A decode step multiplies a few token rows by every weight matrix once. For
fp32 on the CPU with at most :func:`native_row_limit` rows, the native kernels
(``native/csrc/linear_cpu.cpp``) stream each weight matrix once, in place
(the ``[N, K]`` layout as given, no packing); BLAS instead packs a panel of
the weight every call, which at a handful of rows costs about as much as the
product. Builds for AVX-512 CPUs run up to :data:`SMALL_M_MAX` rows (a
row-dot kernel below 9 rows, a broadcast kernel over a transposed ``x`` from
9); AVX2-only builds run the row-dot kernel up to
:data:`SMALL_M_MAX_AVX2` rows, where it stops beating BLAS. Everything else
(more rows, other dtypes or devices, autograd, no compiler here,
``MEDHA_NATIVE_LINEAR=0``, read once per process at the first call) goes to
:func:`torch.nn.functional.linear`.

:func:`linear_silu_mul` is SwiGLU over a fused gate/up weight; from 17 to 32
rows on AVX-512 builds the native kernel applies ``silu(gate) * up`` to its
sums, so the ``[M, 2 I]`` product is never written out and read back.

See ``docs/benchmarks.md`` ("Native linear at 16-64 rows") for the
measurements behind the row limits (``benchmarks/cpu_linear.py``).

Prefill-sized fp32 products (at least :data:`ONEDNN_MIN_M` rows, at most
:data:`ONEDNN_MAX_K` input features, no bias, no autograd) on CPUs where torch
reports AVX-512 go to oneDNN (``torch.ops.mkldnn._linear_pointwise``, torch's
own op) instead of ``F.linear``'s BLAS: 5-14% faster at 128-2,048 rows on
SmolLM2's shapes here (``docs/benchmarks.md``, "helper 91"). Its fp32
accumulation error grows faster with ``K`` than BLAS's: within twice
``F.linear``'s at ``K`` = 576, not at 1,536, hence the ``K`` limit.
``MEDHA_ONEDNN_LINEAR=0`` (read once, at the first call) turns it off.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from medha_kernels.norm import _module as _norm_module
from medha_kernels.norm import rms_norm

#: most token rows the native kernels take on any build (AVX-512 builds)
SMALL_M_MAX = 64
#: most token rows on AVX2-only builds (the row kernel loses to BLAS from 24 rows)
SMALL_M_MAX_AVX2 = 16
_ROW_LIMITS = {"avx512": SMALL_M_MAX, "avx2": SMALL_M_MAX_AVX2}
_F32 = torch.float32
#: fewest rows sent to oneDNN (below, BLAS or the native kernels)
ONEDNN_MIN_M = 128
#: most input features sent to oneDNN (its error stays within twice BLAS's there)
ONEDNN_MAX_K = 1024


@functools.cache
def _module():
    """The native extension if it has the vectorized kernel, else None (builds on first use).

    Cached, ``MEDHA_NATIVE_LINEAR`` included: the environment is read at the first
    call only (a decode step calls :func:`linear` hundreds of times).
    """
    from medha_kernels import native

    module = native.cpu_module("MEDHA_NATIVE_LINEAR")
    return module if getattr(module, "linear_small_m_vectorized", False) else None


def native_linear_available() -> bool:
    """Whether :func:`linear` runs small fp32 CPU products natively here (may build once)."""
    return _module() is not None


def native_row_limit() -> int:
    """Most rows :func:`linear` sends to the native kernels here (0 if none; may build once)."""
    return _native()[1]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` (:func:`torch.nn.functional.linear`'s contract).

    Args:
        x: ``[M, K]`` (or any ``[..., K]``, which goes to torch).
        weight: ``[N, K]``.
        bias: ``[N]`` or None.

    Returns:
        ``[M, N]`` in ``x``'s dtype.
    """
    # cheapest checks first: a decode step makes hundreds of these calls
    if (
        x.dtype is _F32
        and weight.dtype is _F32
        and x.is_cpu
        and weight.is_cpu
        and x.dim() == 2
        and (bias is None or (bias.dtype is _F32 and bias.is_contiguous()))
        and (not torch.is_grad_enabled() or not (x.requires_grad or weight.requires_grad))
        and weight.is_contiguous()
    ):
        module, limit = _native()
        if 0 < x.shape[0] <= limit and x.shape[1] > 0:  # K = 0: torch's zeros
            return module.linear_small_m(x.contiguous(), weight, bias)
        if bias is None and _onednn_fits(x, weight):
            return _onednn(x, weight)
    return F.linear(x, weight, bias)


def linear_silu_mul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """SwiGLU over a fused gate/up projection: ``silu(gate) * up`` of ``linear(x, weight, bias)``.

    Args:
        x: ``[M, K]`` (or any ``[..., K]``, which goes to torch).
        weight: ``[2 I, K]``: the gate's ``I`` rows, then the up projection's.
        bias: ``[2 I]`` or None (a bias goes to :func:`linear` and torch's ops).

    Returns:
        ``[M, I]`` in ``x``'s dtype. Where :func:`linear` runs natively (fp32 CPU, at most
        :func:`native_row_limit` rows, no bias), one native call; from 17 to 32 rows on
        AVX-512 builds ``silu`` runs in the product's epilogue (its own ``exp``, relative
        error about 2e-7), at other row counts it is torch's ``silu`` and ``mul``.
    """
    if (
        bias is None
        and x.dtype is _F32
        and weight.dtype is _F32
        and x.is_cpu
        and weight.is_cpu
        and x.dim() == 2
        and (not torch.is_grad_enabled() or not (x.requires_grad or weight.requires_grad))
        and weight.is_contiguous()
        and weight.shape[0] % 2 == 0
    ):
        module, limit = _native()
        if 0 < x.shape[0] <= limit and x.shape[1] > 0:  # K = 0: torch's zeros
            return module.linear_silu_mul(x.contiguous(), weight)
        # what linear() would pick here (its checks just passed)
        y = _onednn(x, weight) if _onednn_fits(x, weight) else F.linear(x, weight)
    else:
        y = linear(x, weight, bias)
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


def linear_add_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A projection, the residual add after it and the RMSNorm after that:
    ``rms_norm(linear(x, weight), norm_weight, eps, residual)`` (a decode layer's
    o-projection and post-attention norm at TP 1).

    Args:
        x: ``[M, K]`` (any ``[..., K]`` goes to torch).
        weight: ``[N, K]`` (no bias).
        residual: ``[M, N]`` in ``x``'s dtype.
        norm_weight: ``[N]``.
        eps: added to the mean square.

    Returns:
        ``(h, norm(h))`` with ``h = x @ weight.T + residual``, each ``[M, N]`` (the dtypes of
        :func:`medha_kernels.rms_norm`). Where :func:`linear` and ``rms_norm`` both run
        natively (fp32 CPU, at most :func:`native_row_limit` rows, contiguous weights, no
        autograd), one native call with the same kernels, so the same bits as the two
        calls; else the two calls.
    """
    # the checks are in the native call (None: the tensors do not fit): read from Python,
    # a decode layer's dozen tensor attributes cost more than the call saves
    # a CPU tensor first: a GPU model never loads (or builds) the CPU extension here
    fused, limit = _fused() if x.device.type == "cpu" else (None, 0)
    if fused is not None:
        out = fused.linear_add_rms_norm(x, weight, residual, norm_weight, eps, limit)
        if out is not None:
            return out
    return rms_norm(linear(x, weight), norm_weight, eps, residual)


def linear_add_rms_norm_swiglu(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`linear_add_rms_norm`, then a SwiGLU MLP on the normalized rows: a decode
    layer from its o-projection to its MLP's output (TP 1, no biases).

    Args:
        x, weight, residual, norm_weight, eps: as :func:`linear_add_rms_norm`
            (``x [M, K]``, ``weight [N, K]``, ``residual [M, N]``, ``norm_weight [N]``).
        gate_up: ``[2 I, N]``, the gate's ``I`` rows, then the up projection's.
        down: ``[N, I]``.

    Returns:
        ``(h, linear(linear_silu_mul(n, gate_up), down))`` for ``(h, n) =
        linear_add_rms_norm(...)``, each ``[M, N]``. Where all of it runs natively (fp32
        CPU, at most :func:`native_row_limit` rows, contiguous weights, no autograd), one
        native call with the same kernels (the same bits); else those calls.
    """
    fused, limit = _fused() if x.device.type == "cpu" else (None, 0)
    if fused is not None:
        out = fused.linear_add_rms_norm_swiglu(
            x, weight, residual, norm_weight, eps, gate_up, down, limit
        )
        if out is not None:
            return out
    # (the native call declined: linear_add_rms_norm's would too, so its torch path)
    h, normed = rms_norm(linear(x, weight), norm_weight, eps, residual)
    return h, linear(linear_silu_mul(normed, gate_up), down)


def rms_norm_qkv_rotary(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    cos2: torch.Tensor,
    sin2: torch.Tensor,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A decode layer from its input norm to its attention's query, in one native call
    (TP 1, no q/k/v bias): ``(h, n) = rms_norm(x, norm_weight, eps, residual)``,
    ``qkv = linear(n, weight)``, its q and k heads rotated in place (as
    :func:`medha_kernels.decode_ops.rotary_`), and with ``index`` its k and v heads
    written at those slots (as :func:`medha_kernels.decode_ops.write_kv`).

    Args:
        x, residual, norm_weight, eps: as :func:`medha_kernels.rms_norm` (``[M, K]``).
        weight: ``[(Hq + 2 Hkv) D, K]``, the fused q/k/v projection.
        num_q_heads, num_kv_heads: ``Hq`` and ``Hkv``.
        cos2, sin2: ``[M, 1, 2, D / 2]`` from ``medha_runtime.model.rope.rotary_tables``.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``, contiguous; written at
            ``index`` (``[M]`` int64 slots, each checked against the cache). All three
            or none (nothing written).

    Returns:
        ``(h, q, qkv)``: ``q [M, Hq, D]`` contiguous (rotated), ``qkv [M, (Hq + 2 Hkv) D]``
        (q and k rotated), the same bits as those calls; None (nothing done) unless
        everything is fp32 on the CPU, ``M`` at most :func:`native_row_limit`, the
        weights contiguous, no autograd, and the native norm, linear and decode ops
        all run here (``MEDHA_NATIVE_LINEAR`` and ``MEDHA_NATIVE_DECODE_OPS`` not 0).
    """
    fused, limit = _front() if x.device.type == "cpu" else (None, 0)
    if fused is None:
        return None
    return fused.rms_norm_qkv_rotary(
        x,
        residual,
        norm_weight,
        eps,
        weight,
        num_q_heads,
        num_kv_heads,
        cos2,
        sin2,
        k_cache,
        v_cache,
        index,
        limit,
    )


@functools.cache
def _front():
    """:func:`_fused`, where the native decode ops (rotary, K/V write) run too."""
    from medha_kernels.decode_ops import _module as _decode_module

    fused, limit = _fused()
    if fused is None or _decode_module() is None:
        return None, 0
    return fused, limit


@functools.cache
def _fused():
    """``(native module, row limit)`` where both :func:`linear` and
    :func:`medha_kernels.rms_norm` run natively, else ``(None, 0)``."""
    module, limit = _native()
    if module is None or limit == 0 or _norm_module() is None:
        return None, 0
    return module, limit


def _native():
    """``(module, row limit)``; ``(None, 0)`` where nothing runs natively."""
    module = _module()
    return module, (0 if module is None else _ROW_LIMITS.get(module.linear_small_m_isa, 0))


def _onednn_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether an fp32 CPU product of ``x [M, K]`` and ``weight [N, K]`` (checks already
    passed) goes to oneDNN. Mismatched shapes stay on ``F.linear``, whose error names them."""
    k = x.shape[1]
    return (
        x.shape[0] >= ONEDNN_MIN_M
        and 0 < k <= ONEDNN_MAX_K
        and weight.dim() == 2
        and weight.shape[1] == k
        and _onednn_enabled()
    )


def _onednn(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` through oneDNN (fp32, contiguous ``[M, K]`` and ``[N, K]``)."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, None, "none", [], "")


@functools.cache
def _onednn_enabled() -> bool:
    """oneDNN's linear is here, the CPU has AVX-512 (where it was measured faster) and
    ``MEDHA_ONEDNN_LINEAR`` is not ``0`` (read at the first call)."""
    if os.environ.get("MEDHA_ONEDNN_LINEAR", "1") == "0":
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return False
    return hasattr(torch.ops.mkldnn, "_linear_pointwise")
