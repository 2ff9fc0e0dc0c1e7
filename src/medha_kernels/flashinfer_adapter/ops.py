"""medha ops on FlashInfer's kernels (arguments already validated by medha_kernels).

Every op first checks FlashInfer's limits (:mod:`.limits`), then converts
LSEs at the boundary (natural log in, base 2 to FlashInfer, natural log out)
and guarantees ``(0, -inf)`` for empty rows whatever FlashInfer's version does
with them: older merges give NaN when both sides are empty, newer ones a finite
LSE near ``-5e4 * ln 2`` (FlashInfer's ``-inf`` is the finite ``-5e4``), so
merges read emptiness from their inputs (:func:`.convert.fix_empty_merge`).
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import torch

from medha_kernels.flashinfer_adapter.convert import (
    NEG_INF,
    build_paged_index,
    fix_empty_merge,
    lse_from_base2,
    lse_to_base2,
    prefill_calls,
)
from medha_kernels.flashinfer_adapter.limits import require

logger = logging.getLogger("medha_kernels")

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace for split-KV
_WRAPPERS: dict[torch.device, object] = {}


@functools.cache
def load() -> ModuleType | None:
    """``flashinfer`` if it imports cleanly here, else None (never raises)."""
    try:
        import flashinfer
    except Exception as exc:  # ImportError, or a broken install failing at import time
        logger.debug("flashinfer unavailable: %s", exc)
        return None
    return flashinfer


def _fi() -> ModuleType:
    fi = load()
    if fi is None:
        raise RuntimeError("flashinfer is not importable; install flashinfer-python")
    return fi


def _prefill_wrapper(device: torch.device):
    """One ``BatchPrefillWithPagedKVCacheWrapper`` (and workspace) per device, planned per call."""
    if device not in _WRAPPERS:
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        _WRAPPERS[device] = _fi().BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    return _WRAPPERS[device]


def _to_fi(v: torch.Tensor, s: torch.Tensor, fix: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A state for FlashInfer: contiguous v with empty rows zeroed (if ``fix``), base-2 s."""
    s2 = lse_to_base2(s)
    if fix:  # an empty state's v may hold NaN, which 0 * NaN would leak into the result
        v = v.masked_fill(torch.isneginf(s2).unsqueeze(-1), 0)
    return v.contiguous(), s2


def _from_fi(v: torch.Tensor, s2: torch.Tensor, fix: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's ``(v, base-2 s)`` -> ``(v, natural s)``; empty rows exactly ``(0, -inf)``."""
    s = lse_from_base2(s2)
    if fix:
        v = v.masked_fill(torch.isneginf(s).unsqueeze(-1), 0)
    return v, s


def _any_empty(*lses: torch.Tensor) -> bool:
    """Whether any LSE entry is -inf, +inf or NaN (one host sync)."""
    return bool(torch.stack([(~torch.isfinite(s)).any() for s in lses]).any())


def merge_state(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, H, D]`` / ``[T, H]`` states -> merged ``(v [T, H, D], s [T, H] fp32)``."""
    require("merge_state", (v_a, s_a, v_b, s_b))
    fix = _any_empty(s_a, s_b)
    va, sa = _to_fi(v_a, s_a, fix)
    vb, sb = _to_fi(v_b, s_b, fix)
    v, s2 = _fi().merge_state(va, sa, vb, sb)
    v, s = _from_fi(v, s2, fix)
    return fix_empty_merge(v, s, (v_a, v_b), (s_a, s_b)) if fix else (v, s)


def merge_state_in_place(
    v: torch.Tensor,
    s: torch.Tensor,
    v_other: torch.Tensor,
    s_other: torch.Tensor,
    mask: torch.Tensor | None,
) -> None:
    """Merge ``(v_other, s_other)`` into ``(v [T, H, D], s [T, H])``; mask-False rows untouched."""
    require("merge_state_in_place", (v, s, v_other, s_other, mask))
    fix = _any_empty(s, s_other)
    rows = None if mask is None else mask.view(-1, 1)  # [T, 1]
    target = v if v.is_contiguous() else v.contiguous()
    s2 = lse_to_base2(s)
    if fix:  # zero only rows that will be rewritten: masked-off rows stay bit-identical
        empty = torch.isneginf(s2) if rows is None else torch.isneginf(s2) & rows
        target.masked_fill_(empty.unsqueeze(-1), 0)
    vo, so = _to_fi(v_other, s_other, fix)
    _fi().merge_state_in_place(target, s2, vo, so, mask=mask)
    new_s = lse_from_base2(s2)
    if fix:  # FlashInfer may leave an all-empty row finite: read emptiness from the inputs
        live, live_other = torch.isfinite(s), torch.isfinite(s_other)  # s is written below
        only_other = live_other & ~live
        none = ~live & ~live_other
        if rows is not None:
            only_other, none = only_other & rows, none & rows
        target.masked_fill_(none.unsqueeze(-1), 0)
        target[only_other] = v_other[only_other].to(target.dtype)
        new_s = torch.where(none, NEG_INF, new_s)
        new_s = torch.where(only_other, s_other.float(), new_s)
        new_s = torch.where(live & ~live_other, s.float(), new_s)  # only self: s as it was
    if target is not v:
        v.copy_(target)
    s.copy_(new_s if rows is None else torch.where(rows, new_s, s))


def merge_states(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``v [T, N, H, D]``, ``s [T, N, H]`` -> ``(v [T, H, D], s [T, H] fp32)``."""
    require("merge_states", (v, s))
    if v.shape[1] == 0:
        t, _, h, d = v.shape
        return v.new_zeros((t, h, d)), torch.full((t, h), NEG_INF, device=v.device)
    fix = _any_empty(s)
    vv, ss = _to_fi(v, s, fix)
    out, s2 = _fi().merge_states(vv, ss)
    out, s_out = _from_fi(out, s2, fix)
    return fix_empty_merge(out, s_out, v.unbind(1), s.unbind(1)) if fix else (out, s_out)


def _finish_attention(o: torch.Tensor, s2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Natural-log LSE; rows FlashInfer left non-finite (no keys) become ``(0, -inf)``."""
    s = lse_from_base2(s2)
    return torch.where(torch.isneginf(s).unsqueeze(-1), 0, o).to(o.dtype), s


def chunked_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offset: int,
    causal: bool,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[Nq, Hq, D]``, k/v ``[Nk, Hkv, D]`` -> ``(o [Nq, Hq, D], lse [Nq, Hq])``.

    medha's ``q_offset`` is mapped onto FlashInfer's bottom-right causal mask by
    :func:`.convert.prefill_calls`: keys after the chunk's last visible key are
    sliced off, rows before key 0 are empty, rows past the KV run non-causal.
    """
    require("chunked_prefill_attention", (q, k, v, q_offset, causal, sm_scale))
    num_q, heads, _ = q.shape
    calls = prefill_calls(num_q, k.shape[0], q_offset, causal)
    if not calls:
        return q.new_zeros(q.shape), torch.full((num_q, heads), NEG_INF, device=q.device)
    fi = _fi()
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()

    def run(c):
        return fi.single_prefill_with_kv_cache(
            q[c.q_lo : c.q_hi],
            k[: c.kv_len],
            v[: c.kv_len],
            causal=c.causal,
            kv_layout="NHD",
            sm_scale=sm_scale,
            return_lse=True,
        )

    if len(calls) == 1 and calls[0].q_lo == 0 and calls[0].q_hi == num_q:
        return _finish_attention(*run(calls[0]))
    o = q.new_zeros(q.shape)
    s2 = torch.full((num_q, heads), NEG_INF, device=q.device)
    for c in calls:
        o[c.q_lo : c.q_hi], s2[c.q_lo : c.q_hi] = run(c)
    return _finish_attention(o, s2)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    block_table: torch.Tensor,
    causal: bool,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixed prefill/decode batch: q ``[Nq, Hq, D]``, caches ``[blocks, block_size, Hkv, D]`` (NHD).

    One ``BatchPrefillWithPagedKVCacheWrapper.plan`` per call (the caller's
    index tensors are turned into FlashInfer's CSR arrays), then ``run`` with
    ``return_lse=True``. Queries are the newest tokens of each sequence, which
    is FlashInfer's bottom-right causal alignment.
    """
    args = (q, k_cache, v_cache, cu_seqlens_q, kv_lens, block_table, causal, sm_scale)
    require("paged_attention", args)
    _, block_size, kv_heads, head_dim = k_cache.shape
    index = build_paged_index(cu_seqlens_q.tolist(), kv_lens.tolist(), block_table, block_size)
    if q.shape[0] == 0 or index.kv_last_page_len.numel() == 0:
        return q.new_zeros(q.shape), torch.full(q.shape[:2], NEG_INF, device=q.device)
    wrapper = _prefill_wrapper(q.device)
    wrapper.plan(
        index.qo_indptr,
        index.kv_indptr,
        index.kv_indices,
        index.kv_last_page_len,
        q.shape[1],
        kv_heads,
        head_dim,
        block_size,
        causal=causal,
        sm_scale=sm_scale,
        q_data_type=q.dtype,
        kv_data_type=k_cache.dtype,
    )
    o, s2 = wrapper.run(q.contiguous(), (k_cache, v_cache), return_lse=True)
    return _finish_attention(o, s2)
