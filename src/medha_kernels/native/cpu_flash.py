"""Large prefill chunks on the CPU through torch's own flash-attention op.

The native kernel is the faster one for decodes and small chunks; torch's
``_scaled_dot_product_flash_attention_for_cpu`` (blocked GEMMs, natural-log
LSE) for big ones, K/V gathered from the blocks included. Measured with
``python benchmarks/cpu_prefill_attention.py`` (one thread, SmolLM2's heads:
9 query, 3 KV, dim 64, fp32), native time over flash time by queries x keys:
0.66x at 64 x 64, 0.94x at 256 x 256, 0.90x at 512 x 512, 1.03x at
128 x 4,096, 1.46x at 1,024 x 1,024, 1.65x at 256 x 2,048, 1.53x at
512 x 4,096, 1.57x at 2,048 x 2,048. Hence the rule: a sequence of at least
:data:`FLASH_MIN_Q` queries whose queries x keys reach :data:`FLASH_MIN_WORK`
goes to flash.
"""

from __future__ import annotations

import torch

from medha_kernels.torch_ref.merge import merge_state

#: queries x keys from which a sequence's attention goes to torch's flash op
FLASH_MIN_WORK = 512 * 1024
#: fewest queries that go to flash (fewer rows use its tiles poorly)
FLASH_MIN_Q = 128


def use_flash(num_q: int, num_kv: int) -> bool:
    """Whether a sequence of ``num_q`` queries over ``num_kv`` keys goes to flash."""
    return num_q >= FLASH_MIN_Q and num_q * num_kv >= FLASH_MIN_WORK


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offset: int,
    causal: bool,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's attention with its LSE (queries are keys ``q_offset:`` when causal).

    Args:
        q: ``[num_q, num_qo_heads, head_dim]``.
        k, v: ``[num_kv, num_kv_heads, head_dim]``, ``num_kv >= q_offset + num_q``
            when causal; q's dtype.

    Returns:
        ``o [num_q, num_qo_heads, head_dim]`` in q's dtype and ``lse [num_q,
        num_qo_heads]`` fp32, natural log. A causal chunk with a prefix is the
        prefix attended in full merged with the chunk's own causal triangle
        (torch's causal mask is aligned to the top left).
    """
    if not causal:
        return _flash(q, k, v, False, sm_scale)
    n = q.shape[0]
    own = _flash(q, k[q_offset : q_offset + n], v[q_offset : q_offset + n], True, sm_scale)
    if q_offset == 0:
        return own
    prefix = _flash(q, k[:q_offset], v[:q_offset], False, sm_scale)
    return merge_state(*prefix, *own)  # the library's exact merge


def _flash(q, k, v, causal: bool, scale: float):
    """torch's op on ``[1, heads, len, dim]`` views (it maps GQA groups itself: no K/V copy)."""
    q4 = q.transpose(0, 1).unsqueeze(0)
    k4 = k.transpose(0, 1).unsqueeze(0)
    v4 = v.transpose(0, 1).unsqueeze(0)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q4, k4, v4, 0.0, causal, scale=scale
    )[:2]
    return out[0].transpose(0, 1), lse[0].transpose(0, 1).float()
