"""What FlashInfer's kernels accept, checked before any call (no flashinfer import).

- head_dim in {64, 128, 256} for every op;
- fp16 or bf16 only (no fp32) for every op;
- merges launch one thread block of ``(head_dim / 8) x num_heads`` threads
  (at most 1024), so ``num_heads <= 128, 64, 32`` for ``head_dim = 64, 128, 256``;
- paged attention reads the caches in place, so they must be contiguous
  (every other input is made contiguous by the adapter when needed).
"""

from __future__ import annotations

import torch

HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.float16, torch.bfloat16)
MERGE_MAX_HEADS = {64: 128, 128: 64, 256: 32}
MERGE_OPS = ("merge_state", "merge_state_in_place", "merge_states")
ATTENTION_OPS = ("chunked_prefill_attention", "paged_attention")


class FlashInferLimitError(ValueError):
    """The inputs are valid for medha but outside what FlashInfer's kernels accept."""


def limit_violation(op: str, args: tuple) -> str | None:
    """Why FlashInfer cannot run ``op`` on these (already validated) arguments, or None.

    ``args`` are the positional arguments of the adapter's function for ``op``;
    the first one is always the value/query tensor, with head_dim last and the
    head count just before it.
    """
    if op not in MERGE_OPS + ATTENTION_OPS:
        return f"the flashinfer backend does not implement {op}"
    x = args[0]
    head_dim, heads = x.shape[-1], x.shape[-2]
    if x.dtype not in DTYPES:
        return f"flashinfer {op} needs fp16 or bf16 inputs, got {x.dtype}"
    if head_dim not in HEAD_DIMS:
        return f"flashinfer {op} needs head_dim in {HEAD_DIMS}, got {head_dim}"
    if op in MERGE_OPS and heads > MERGE_MAX_HEADS[head_dim]:
        return (
            f"flashinfer {op} needs num_heads <= {MERGE_MAX_HEADS[head_dim]} at "
            f"head_dim={head_dim} (one block of head_dim/8 x num_heads <= 1024 threads), "
            f"got {heads}"
        )
    if op == "paged_attention" and not (args[1].is_contiguous() and args[2].is_contiguous()):
        return "flashinfer paged_attention needs contiguous k_cache and v_cache"
    return None


def can_run(op: str, *args: object) -> bool:
    """True when FlashInfer's kernels accept ``op``'s arguments (the op's positional args)."""
    try:
        return limit_violation(op, args) is None
    except (AttributeError, IndexError, TypeError):  # not the arguments this op takes
        return False


def require(op: str, args: tuple) -> None:
    """Raise :class:`FlashInferLimitError` naming the limit when ``op`` cannot run."""
    why = limit_violation(op, args)
    if why is not None:
        raise FlashInferLimitError(why + "; use another backend (e.g. 'triton' or 'torch')")
