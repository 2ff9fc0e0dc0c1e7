"""Pure-torch glue between medha's conventions and FlashInfer's (no flashinfer import).

- LSE base: FlashInfer stores ``log2(sum 2^x)`` of base-2 scores, which is the
  natural-log LSE times ``log2(e)``. We convert at the boundary.
- Paged KV indexing: FlashInfer takes CSR arrays (``kv_indptr``,
  ``kv_indices``, ``kv_last_page_len``) where medha takes a block table.
- Causal alignment: FlashInfer's mask is bottom-right aligned to
  ``kv_len - qo_len``; medha takes any ``q_offset``, which we reduce to
  bottom-right calls on row and key slices.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

LOG2E = math.log2(math.e)  # natural -> base 2
LN2 = math.log(2.0)  # base 2 -> natural
NEG_INF = float("-inf")


def lse_to_base2(s: torch.Tensor) -> torch.Tensor:
    """Natural-log LSE ``[...]`` -> FlashInfer's base-2 fp32 LSE; +inf and NaN -> -inf (empty)."""
    s = s.float()
    return torch.where(torch.isfinite(s), s * LOG2E, NEG_INF)


def lse_from_base2(s2: torch.Tensor) -> torch.Tensor:
    """FlashInfer's base-2 LSE ``[...]`` -> natural-log fp32; anything non-finite -> -inf."""
    s2 = s2.float()
    return torch.where(torch.isfinite(s2), s2 * LN2, NEG_INF)


def fix_empty_merge(
    v: torch.Tensor, s: torch.Tensor, vs: Sequence[torch.Tensor], ss: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply medha's empty-state convention to a merge FlashInfer computed.

    FlashInfer stands in ``-5e4`` for minus infinity (``math::inf = 5e4``), so a
    merge whose inputs are all empty comes back with a finite LSE (about
    ``-5e4`` in base 2), which no check on the output can tell from a real
    one. Emptiness is therefore read from the inputs: rows where no input is
    live become exactly ``(0, -inf)``, rows where exactly one is live become
    that input exactly; rows with two or more live inputs keep ``(v, s)``.

    Args:
        v: the merged values ``[T, H, D]`` (any float dtype).
        s: the merged natural-log LSE ``[T, H]`` (fp32).
        vs: the inputs' values, each ``[T, H, D]``.
        ss: the inputs' natural-log LSEs, each ``[T, H]``; -inf, +inf and NaN are empty.

    Returns:
        ``(v, s)`` with those rows replaced (new tensors; the arguments are not written).
    """
    count = torch.zeros(s.shape, dtype=torch.int32, device=s.device)
    v_one, s_one = torch.zeros_like(v), torch.full_like(s, NEG_INF, dtype=torch.float32)
    for vi, si in zip(vs, ss, strict=True):
        live = torch.isfinite(si)
        count += live
        s_one = torch.where(live, si.float(), s_one)  # the last live input: the only one if one
        v_one = torch.where(live.unsqueeze(-1), vi.to(v.dtype), v_one)
    keep = count >= 2
    return torch.where(keep.unsqueeze(-1), v, v_one), torch.where(keep, s.float(), s_one)


class PagedIndex(NamedTuple):
    """FlashInfer's CSR description of a batch (sequences without queries dropped).

    ``qo_indptr``, ``kv_indptr`` ``[n + 1]`` and ``kv_last_page_len`` ``[n]`` are
    int32 on the CPU (FlashInfer's ``plan`` reads them on the host);
    ``kv_indices`` ``[kv_indptr[-1]]`` is int32 on the block table's device.
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor


def build_paged_index(
    cu_seqlens_q: list[int], kv_lens: list[int], block_table: torch.Tensor, block_size: int
) -> PagedIndex:
    """Block table ``[batch, max_blocks]`` + lengths -> FlashInfer CSR arrays.

    Sequence ``b`` uses pages ``block_table[b, :ceil(kv_lens[b] / block_size)]``;
    its last page holds ``kv_lens[b] - (pages - 1) * block_size`` tokens (in
    ``[1, block_size]``). Sequences with no query rows are dropped: they produce
    no output, and FlashInfer cannot describe an empty KV (last page length >= 1).
    """
    keep = [b for b in range(len(kv_lens)) if cu_seqlens_q[b + 1] > cu_seqlens_q[b]]
    pages = [-(-kv_lens[b] // block_size) for b in keep]
    qo, kv = [0], [0]
    for b, p in zip(keep, pages, strict=True):
        qo.append(qo[-1] + cu_seqlens_q[b + 1] - cu_seqlens_q[b])
        kv.append(kv[-1] + p)
    last = [kv_lens[b] - (p - 1) * block_size for b, p in zip(keep, pages, strict=True)]
    dev = block_table.device
    if len(keep) < len(kv_lens):
        block_table = block_table[torch.tensor(keep, dtype=torch.long, device=dev)]
    n_pages = torch.tensor(pages, dtype=torch.long, device=dev)
    used = torch.arange(block_table.shape[1], device=dev) < n_pages[:, None]
    i32 = torch.int32
    return PagedIndex(
        qo_indptr=torch.tensor(qo, dtype=i32),
        kv_indptr=torch.tensor(kv, dtype=i32),
        kv_indices=block_table[used].to(i32).contiguous(),
        kv_last_page_len=torch.tensor(last, dtype=i32),
    )


class PrefillCall(NamedTuple):
    """One FlashInfer call: query rows ``[q_lo, q_hi)`` over keys ``[0, kv_len)``."""

    q_lo: int
    q_hi: int
    kv_len: int
    causal: bool


def prefill_calls(num_q: int, num_kv: int, q_offset: int, causal: bool) -> list[PrefillCall]:
    """Cover medha's mask (query ``i`` sees keys ``j <= q_offset + i``) with bottom-right calls.

    Rows with ``q_offset + i < 0`` see no key and get no call (the caller
    writes ``(0, -inf)``). Rows whose last visible key lies inside the KV form
    one causal call over the keys ``[0, q_offset + q_hi)``, whose bottom-right
    alignment is then exactly ``q_offset``. Rows past the end of the KV see
    every key: one non-causal call. The usual case ``q_offset = num_kv - num_q``
    is a single causal call over all keys.
    """
    if num_q == 0 or num_kv == 0:
        return []
    if not causal:
        return [PrefillCall(0, num_q, num_kv, False)]
    r0 = min(max(-q_offset, 0), num_q)
    r1 = min(max(num_kv - q_offset, r0), num_q)
    calls = []
    if r1 > r0:
        calls.append(PrefillCall(r0, r1, q_offset + r1, True))
    if num_q > r1:
        calls.append(PrefillCall(r1, num_q, num_kv, False))
    return calls
