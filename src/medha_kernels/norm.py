"""``rms_norm(x, weight, eps, residual)``: transformers' RMSNorm, one native call for fp32 CPUs.

transformers' ``LlamaRMSNorm`` is six dispatched ops (``pow``, ``mean``, ``add``,
``rsqrt``, two ``mul``); ``F.rms_norm`` on the CPU decomposes into about as many.
At a decode step's one token row each costs far more than its arithmetic. For
fp32 on the CPU the native kernel (``native/csrc/norm_cpu.cpp``) does it in one
call, the residual add before it (vLLM's ``fused_add_rms_norm``) included, with
the same bits: every step but the sum of squares is one IEEE operation done as
torch does it, and that sum is torch's own. Everything else (other dtypes or
devices, autograd, non-contiguous tensors, no compiler here,
``MEDHA_NATIVE_NORM=0``, read once per process at the first call) goes to
torch with the same arithmetic.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

_F32 = torch.float32


@functools.cache
def _module():
    """The native extension, or None where it cannot run (builds on first use; cached)."""
    from medha_kernels import native

    return native.cpu_module("MEDHA_NATIVE_NORM")


def native_rms_norm_available() -> bool:
    """Whether :func:`rms_norm` runs fp32 CPU rows natively here (may build once)."""
    return _module() is not None


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, weight * normalize(h))`` with ``h = x + residual`` (or ``x``), as transformers.

    ``normalize`` is transformers' ``LlamaRMSNorm`` without its weight: in fp32,
    ``h * rsqrt(mean(h ** 2, -1) + eps)``, rounded once to ``h``'s dtype; then
    the scale by ``weight`` in ``weight``'s dtype promotion (bit for bit).

    Args:
        x: ``[M, K]`` (any ``[..., K]`` goes to torch).
        weight: ``[K]``.
        eps: added to the mean square.
        residual: ``x``'s shape and dtype, or None.

    Returns:
        ``h`` (``x`` itself without a residual, else a new tensor) and the
        normalized ``[M, K]`` in the promoted dtype of ``weight`` and ``x``.
    """
    # cheapest checks first: a decode step makes 2 of these a layer
    if (
        x.dtype is _F32
        and weight.dtype is _F32
        and x.is_cpu
        and x.dim() == 2
        and x.is_contiguous()
        and weight.is_contiguous()
        and (residual is None or (residual.dtype is _F32 and residual.is_contiguous()))
        and (
            not torch.is_grad_enabled()
            or not (
                x.requires_grad
                or weight.requires_grad
                or (residual is not None and residual.requires_grad)
            )
        )
    ):
        module = _module()
        if module is not None:
            return module.rms_norm(x, weight, eps, residual)
    h = x if residual is None else x + residual
    if h.dtype == _F32:  # one composite op, the same arithmetic
        return h, F.rms_norm(h, weight.shape, weight, eps)
    # fp32 inside, rounded once to h's dtype (transformers' h.to(input_dtype)), then the scale
    return h, weight * F.rms_norm(h, weight.shape, None, eps)
