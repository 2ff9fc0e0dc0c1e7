"""Paged attention planned once per step, run by every layer (FlashInfer's plan/run).

A step's batch metadata (query row offsets, KV lengths, block table) is the
same for every layer. :func:`plan_paged_attention` validates it once (the only
host reads), resolves the backend once, and lets the backend precompute its
work list; :meth:`PagedAttentionPlan.run` then only checks the layer's tensor
shapes (no host sync) and runs::

    plan = plan_paged_attention(cu_seqlens_q=cu, kv_lens=lens, block_table=table,
                                num_qo_heads=9, num_kv_heads=3, head_dim=64,
                                block_size=16, dtype=torch.float32)
    for layer in layers:
        o, lse = plan.run(q, k_cache[layer], v_cache[layer])

A backend module may expose ``plan_paged_attention(meta: PagedMeta)`` returning
a ``run(q, k_cache, v_cache) -> (o, lse)`` callable; otherwise its
``paged_attention`` op is called with the plan's tensors.
"""

from __future__ import annotations

import functools
import itertools
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from medha_kernels._checks import (
    FLOAT_DTYPES,
    KernelInputError,
    check_gqa,
    check_shape,
    check_tensor,
    default_sm_scale,
)
from medha_kernels.backends import planner, resolve, resolve_name

_Q = "[num_q, num_qo_heads, head_dim]"
_CACHE = "[num_blocks, block_size, num_kv_heads, head_dim]"
_I32 = (torch.int32,)

RunFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True, kw_only=True)
class PagedMeta:
    """One step's validated batch metadata, as tensors and as host lists.

    Attributes:
        cu_seqlens_q: ``[batch + 1]`` int32 query row offsets.
        kv_lens: ``[batch]`` int32 keys per sequence (the chunk's included).
        block_table: ``[batch, max_blocks]`` int32.
        cu, lens: the same offsets and lengths as Python lists (read once).
        max_block: the largest block id any sequence uses (-1 if none).
        num_qo_heads, num_kv_heads, head_dim, block_size: the shapes every layer has.
        dtype: q's and the caches' dtype.
        causal, sm_scale: as in :func:`medha_kernels.paged_attention`.
    """

    cu_seqlens_q: torch.Tensor
    kv_lens: torch.Tensor
    block_table: torch.Tensor
    cu: list[int]
    lens: list[int]
    max_block: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    causal: bool
    sm_scale: float

    @property
    def num_q(self) -> int:
        return self.cu[-1]

    @property
    def batch(self) -> int:
        return len(self.lens)

    @property
    def query_counts(self) -> list[int]:
        """Each sequence's number of queries (from the host copy)."""
        return [hi - lo for lo, hi in itertools.pairwise(self.cu)]

    @property
    def device(self) -> torch.device:
        return self.cu_seqlens_q.device


@dataclass(frozen=True, kw_only=True)
class PagedHost:
    """Host copies of a step's metadata, as the caller built the tensors from them.

    With it :func:`plan_paged_attention` reads nothing back from the device (no
    GPU sync); FlashInfer's ``plan`` takes its host index arrays the same way.
    The lists are checked like the tensors would be; they must hold what the
    tensors hold (not compared).

    Attributes:
        cu_seqlens_q: ``batch + 1`` query row offsets.
        kv_lens: ``batch`` keys per sequence.
        max_block: the largest block id any sequence uses (``-1`` if none);
            a negative id in use is the caller's error.
    """

    cu_seqlens_q: Sequence[int]
    kv_lens: Sequence[int]
    max_block: int

    @classmethod
    def from_tables(
        cls,
        cu_seqlens_q: Sequence[int],
        kv_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
    ) -> PagedHost:
        """From each sequence's block list (longer lists are cut to the blocks in use)."""
        in_use = (t[: -(-n // block_size)] for t, n in zip(block_tables, kv_lens, strict=True))
        return cls(
            cu_seqlens_q=cu_seqlens_q,
            kv_lens=kv_lens,
            max_block=max((max(t) for t in in_use if len(t)), default=-1),
        )


@dataclass(frozen=True, kw_only=True)
class PagedAttentionPlan:
    """A validated step plan; :meth:`run` it once per layer.

    Attributes:
        meta: the step's metadata (see :class:`PagedMeta`).
        backend: the backend that runs it (``"auto"`` already resolved).
    """

    meta: PagedMeta
    backend: str
    _run: RunFn

    def run(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of one layer.

        Args:
            q: ``[num_q, num_qo_heads, head_dim]`` in the planned dtype.
            k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``,
                this layer's cache with the step's K/V already written.

        Returns:
            ``(o [num_q, num_qo_heads, head_dim]`` in q's dtype, ``lse [num_q,
            num_qo_heads]`` fp32 natural log); a row that sees no key is ``(0, -inf)``.
        """
        m = self.meta
        want_q = (m.num_q, m.num_qo_heads, m.head_dim)
        if tuple(q.shape) != want_q or q.dtype != m.dtype or q.device != m.device:
            raise KernelInputError(
                f"q: the plan expects {want_q} {_Q} {m.dtype} on {m.device}, "
                f"got {tuple(q.shape)} {q.dtype} on {q.device}"
            )
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            if (
                c.dim() != 4
                or tuple(c.shape[1:]) != (m.block_size, m.num_kv_heads, m.head_dim)
                or c.shape[0] <= m.max_block
                or c.dtype != m.dtype
                or c.device != m.device
            ):
                raise KernelInputError(
                    f"{name}: the plan expects [> {m.max_block}, {m.block_size}, "
                    f"{m.num_kv_heads}, {m.head_dim}] {_CACHE} {m.dtype} on {m.device}, "
                    f"got {tuple(c.shape)} {c.dtype} on {c.device}"
                )
        return self._run(q, k_cache, v_cache)

    def unchecked_run(self) -> RunFn:
        """:meth:`run` without its checks, for the later layers of a step whose first
        layer's :meth:`run` checked them: the backend's planned call itself.

        Every layer of a step has the first one's query shape and dtype, and its own
        cache of the same shape, dtype and device (one allocation per layer, alike); the
        checks would only run again, cold (each layer's attention streams its KV through
        the caches first). Take it only after a :meth:`run` that returned, and call it
        only with such arguments: it does not check them.
        """
        return self._run


def plan_paged_attention(
    *,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    block_table: torch.Tensor,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    causal: bool = True,
    sm_scale: float | None = None,
    backend: str = "auto",
    host: PagedHost | None = None,
) -> PagedAttentionPlan:
    """Validate a step's metadata once and plan its attention for every layer.

    Sequence ``b`` owns query rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``, the
    newest of its ``kv_lens[b]`` keys, which live in blocks
    ``block_table[b, :ceil(kv_lens[b] / block_size)]``.

    Args:
        cu_seqlens_q: ``[batch + 1]`` int32, rising from 0 to ``num_q``.
        kv_lens: ``[batch]`` int32, each ``>=`` its number of queries.
        block_table: ``[batch, max_blocks]`` int32, on the same device.
        num_qo_heads, num_kv_heads, head_dim, block_size: the layers' shapes.
        dtype: q's and the caches' dtype (fp16, bf16 or fp32).
        causal: query ``i`` of a chunk sees keys up to its own position;
            without it every key.
        sm_scale: default ``1 / sqrt(head_dim)``.
        backend: ``"auto"``, ``"torch"``, ``"native"``, ``"triton"`` or ``"flashinfer"``.
        host: the same metadata as host lists (:class:`PagedHost`): then nothing
            is read back from the device.

    Returns:
        A :class:`PagedAttentionPlan`.
    """
    meta = _validate(
        cu_seqlens_q,
        kv_lens,
        block_table,
        num_qo_heads=num_qo_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        causal=causal,
        sm_scale=sm_scale,
        host=None if host is None else (host.cu_seqlens_q, host.kv_lens, host.max_block),
    )
    return _plan(meta, backend)


def padded_block_table(rows: Sequence[Sequence[int]]) -> torch.Tensor:
    """``[len(rows), longest row]`` int32 CPU tensor of block-table rows, padded with zeros.

    Rows that are ``array('i')`` are copied with one ``memcpy`` each, other
    rows converted int by int.
    """
    width = max((len(r) for r in rows), default=0)
    if width == 0:
        return torch.zeros((len(rows), 0), dtype=torch.int32)
    flat = array("i")
    for r in rows:
        flat.extend(r if isinstance(r, array) and r.typecode == "i" else array("i", r))
        flat.frombytes(bytes(flat.itemsize * (width - len(r))))
    return torch.frombuffer(flat, dtype=torch.int32).view(len(rows), width)


def plan_paged_attention_from_host(
    *,
    cu_seqlens_q: Sequence[int],
    kv_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    causal: bool = True,
    sm_scale: float | None = None,
    backend: str = "auto",
) -> PagedAttentionPlan:
    """:func:`plan_paged_attention` from host lists: checked on the host, copied to ``device``.

    What a scheduler holds anyway; nothing is read back from the device (no
    sync on a GPU). ``block_tables[b]`` lists sequence ``b``'s blocks (at least
    ``ceil(kv_lens[b] / block_size)``; the rest is ignored); the plan's
    ``[batch, max_blocks]`` table is padded with zeros.
    """
    if int(block_size) < 1:
        raise KernelInputError(f"block_size must be >= 1, got {block_size}")
    if len(block_tables) != len(kv_lens):
        raise KernelInputError(
            f"block_tables: {len(block_tables)} rows for {len(kv_lens)} sequences"
        )
    used = []
    for b, (t, n) in enumerate(zip(block_tables, kv_lens, strict=True)):
        need = -(-int(n) // int(block_size))
        if len(t) < need:
            raise KernelInputError(f"kv_lens[{b}]={n} needs {need} blocks, got {len(t)}")
        used.append(t[:need])
    table = padded_block_table(used)
    max_block = -1
    if table.numel():  # zero padding changes neither a negative minimum nor the maximum of ids >= 0
        lo_t, hi_t = torch.aminmax(table)
        if int(lo_t) < 0:
            raise KernelInputError(f"block_table: block id {int(lo_t)} is negative")
        max_block = int(hi_t)
    cu, lens = [int(x) for x in cu_seqlens_q], [int(x) for x in kv_lens]
    meta = _validate(
        host_tensor(cu, torch.int32, device),
        host_tensor(lens, torch.int32, device),
        table.to(device),
        num_qo_heads=num_qo_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        causal=causal,
        sm_scale=sm_scale,
        host=(cu, lens, max_block),
    )
    return _plan(meta, backend)


_TYPECODES = {torch.int64: "q", torch.int32: "i"}


def host_tensor(
    values: Sequence[int], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)`` for ``torch.int32`` or
    ``torch.int64``, through an array (a third of the cost for a decode step's short
    lists). ``[len(values)]``."""
    if not values:
        return torch.empty(0, dtype=dtype, device=device)
    t = torch.frombuffer(array(_TYPECODES[dtype], values), dtype=dtype)
    return t if torch.device(device).type == "cpu" else t.to(device)


def _plan(meta: PagedMeta, backend: str) -> PagedAttentionPlan:
    """Resolve ``backend`` for validated metadata and let it plan (if it can)."""
    dtype, device = meta.dtype, meta.device
    # Shaped stand-ins (no memory) for backends whose "auto" limits look at the tensors.
    base = _scalar(dtype, device)
    like_q = base.expand(meta.num_q, meta.num_qo_heads, meta.head_dim)
    like_cache = base.expand(meta.max_block + 1, meta.block_size, meta.num_kv_heads, meta.head_dim)
    args = (
        like_q,
        like_cache,
        like_cache,
        meta.cu_seqlens_q,
        meta.kv_lens,
        meta.block_table,
        meta.causal,
        meta.sm_scale,
    )
    name = resolve_name("paged_attention", backend, device, args)
    plan_fn = planner("paged_attention", name)
    if plan_fn is not None:
        run = plan_fn(meta)
    else:
        run = _unplanned(resolve("paged_attention", name, device, args), meta)
    return PagedAttentionPlan(meta=meta, backend=name, _run=run)


@functools.cache
def _scalar(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-dim tensor to expand into shaped stand-ins (one per dtype and device)."""
    return torch.empty((), dtype=dtype, device=device)


def _unplanned(fn: Callable, meta: PagedMeta) -> RunFn:
    def run(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor):
        return fn(
            q,
            k_cache,
            v_cache,
            meta.cu_seqlens_q,
            meta.kv_lens,
            meta.block_table,
            meta.causal,
            meta.sm_scale,
        )

    return run


def _validate(
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    causal: bool,
    sm_scale: float | None,
    num_q: int | None = None,
    host: tuple[Sequence[int], Sequence[int], int] | None = None,
) -> PagedMeta:
    """Check a step's metadata (the only host reads) and return it as a :class:`PagedMeta`.

    ``num_q``: the query rows ``cu_seqlens_q`` must end at (None: any).
    ``host``: ``(cu_seqlens_q, kv_lens, max_block)`` as the caller built the
    tensors from (nothing is read back from the device then).
    """
    if dtype not in FLOAT_DTYPES:
        raise KernelInputError(f"dtype: expected fp16, bf16 or fp32, got {dtype}")
    for name, value in (("head_dim", head_dim), ("block_size", block_size)):
        if int(value) < 1:
            raise KernelInputError(f"{name} must be >= 1, got {value}")
    check_gqa(int(num_qo_heads), int(num_kv_heads))
    check_tensor("cu_seqlens_q", cu_seqlens_q, layout="[batch + 1]", dtypes=_I32)
    device = cu_seqlens_q.device
    batch = cu_seqlens_q.shape[0] - 1
    if batch < 0:
        raise KernelInputError("cu_seqlens_q must rise from 0 to num_q, got []")
    check_tensor("kv_lens", kv_lens, layout="[batch]", dtypes=_I32, device=device)
    check_shape("kv_lens", kv_lens, (batch,), "[batch]")
    check_tensor(
        "block_table", block_table, layout="[batch, max_blocks]", dtypes=_I32, device=device
    )
    if block_table.shape[0] != batch:
        raise KernelInputError(
            f"block_table: expected {batch} rows [batch, max_blocks], got {block_table.shape[0]}"
        )
    if host is None:
        cu, lens = cu_seqlens_q.tolist(), kv_lens.tolist()
    else:
        cu, lens = [int(x) for x in host[0]], [int(x) for x in host[1]]
        if len(cu) != batch + 1 or len(lens) != batch:
            raise KernelInputError(
                f"host: {len(cu)} offsets and {len(lens)} lengths for tensors of "
                f"{tuple(cu_seqlens_q.shape)} and {tuple(kv_lens.shape)}"
            )
    rising = all(a <= b for a, b in itertools.pairwise(cu))
    if cu[0] != 0 or not rising or (num_q is not None and cu[-1] != num_q):
        to = "num_q" if num_q is None else f"num_q={num_q}"
        raise KernelInputError(f"cu_seqlens_q must rise from 0 to {to}, got {cu}")
    width = block_table.shape[1]
    for b in range(batch):
        nq = cu[b + 1] - cu[b]
        if lens[b] < nq:
            raise KernelInputError(f"kv_lens[{b}]={lens[b]} is below its {nq} queries")
        if -(-lens[b] // block_size) > width:
            raise KernelInputError(
                f"kv_lens[{b}]={lens[b]} needs more blocks than block_table's {width}"
            )
    max_block = _max_block(block_table, kv_lens, block_size) if host is None else host[2]
    return PagedMeta(
        cu_seqlens_q=cu_seqlens_q.contiguous(),
        kv_lens=kv_lens.contiguous(),
        block_table=block_table.contiguous(),
        cu=cu,
        lens=lens,
        max_block=max_block,
        num_qo_heads=int(num_qo_heads),
        num_kv_heads=int(num_kv_heads),
        head_dim=int(head_dim),
        block_size=int(block_size),
        dtype=dtype,
        causal=bool(causal),
        sm_scale=default_sm_scale(head_dim, sm_scale),
    )


def _max_block(block_table: torch.Tensor, kv_lens: torch.Tensor, block_size: int) -> int:
    """The largest block id in use; raises on a negative one."""
    if block_table.numel() == 0:
        return -1
    used_blocks = (kv_lens.long() + block_size - 1) // block_size  # [batch]
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    used = cols.view(1, -1) < used_blocks.view(-1, 1)
    if not bool(used.any()):
        return -1
    ids = block_table[used]
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0:
        raise KernelInputError(f"block_table: block id {lo} is negative")
    return hi


def check_q_and_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The per-call checks of :func:`medha_kernels.paged_attention` (before planning)."""
    check_tensor("q", q, layout=_Q)
    check_tensor("k_cache", k_cache, layout=_CACHE, dtypes=(q.dtype,), device=q.device)
    check_tensor("v_cache", v_cache, layout=_CACHE, dtypes=(q.dtype,), device=q.device)
    check_shape("v_cache", v_cache, tuple(k_cache.shape), _CACHE)
    if k_cache.shape[3] != q.shape[2]:
        raise KernelInputError(
            f"k_cache: head_dim {k_cache.shape[3]} differs from q's {q.shape[2]}"
        )
    check_gqa(q.shape[1], k_cache.shape[2])
