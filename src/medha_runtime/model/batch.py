"""What one model step reads: a flat batch of tokens and a paged KV cache.

Vocabulary: a batch holds ``B`` sequences and ``N`` new tokens, tokens first
(sequence ``b`` owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``). A decode is a
sequence with one new token; a prefill chunk one with several. Slot ``s`` of
the cache is offset ``s % block_size`` of block ``s // block_size``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import torch

from medha_kernels import PagedAttentionPlan, PagedHost, append_paged_kv, plan_paged_attention
from medha_kernels.decode_ops import write_kv as native_write_kv
from medha_kernels.plan import RunFn
from medha_runtime import huge_pages


@dataclass
class ForwardBatch:
    """Index tensors for one step (all on the model's device).

    Attributes:
        input_ids: ``[N]`` int64 token ids (read by the first SPP stage only).
        positions: ``[N]`` int64 absolute positions (RoPE).
        cu_seqlens_q: ``[B + 1]`` int32 row offsets of each sequence.
        kv_lens: ``[B]`` int32 keys per sequence in this cache, including this chunk's.
        block_table: ``[B, max_blocks]`` int32 cache blocks of each sequence, in order.
        slots: ``[N]`` int32 cache slot where each new token's K/V is written;
            a negative slot writes nothing (a token whose KV lives elsewhere).
        sample_rows: ``[S]`` int64 rows whose logits the last stage returns.
        host: the offsets, lengths and largest block id as the host lists the
            tensors were built from (None: the plan reads them from the tensors,
            a GPU sync).
        writes_kv: False when every slot is negative, as the host lists the
            slots were built from say (a KVP group that holds none of the
            step's new tokens): :meth:`write_kv` then does nothing at all.

    The step's attention plan (:meth:`attention_plan`) is built by the first
    layer that asks and reused by the others: the metadata is validated and
    read to the host once per step, not once per layer.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens_q: torch.Tensor
    kv_lens: torch.Tensor
    block_table: torch.Tensor
    slots: torch.Tensor
    sample_rows: torch.Tensor
    host: PagedHost | None = field(default=None, compare=False)
    writes_kv: bool = field(default=True, compare=False)
    _plans: dict[tuple, PagedAttentionPlan] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    #: (int64 slots of the written rows, those rows or None for all), after the first write
    _kv_write: tuple[torch.Tensor, torch.Tensor | None] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    #: (backend, the plan's unchecked run) after the step's first checked :meth:`attention`
    _attention_run: tuple[str, RunFn] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> None:
        """Write the new tokens' K/V at :attr:`slots` (a negative slot writes nothing).

        Args:
            k, v: ``[N, num_kv_heads, head_dim]`` (any strides).
            k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``; written.

        Unless :meth:`prepare_kv_write` ran, the first layer's write goes through
        :func:`medha_kernels.append_paged_kv`, which validates the slots (host
        reads); the step then keeps them as int64
        row indices, and every later layer writes with one ``index_copy_`` per
        tensor (on the CPU one native copy for both): no validation and no host
        sync, which on a GPU would stall the launch queue once per layer. Every
        layer's cache has the first one's shape.
        """
        if not self.writes_kv:
            return
        if self._kv_write is None:
            append_paged_kv(k, v, k_cache, v_cache, slots=self.slots)
            self._kv_write = _write_rows(self.slots)
            return
        idx, rows = self._kv_write
        if rows is None and native_write_kv(k, v, k_cache, v_cache, idx):  # CPU: one call
            return
        if rows is not None:
            k, v = k[rows], v[rows]
        if k.dtype != k_cache.dtype:  # skip the no-op casts (each still a dispatched op)
            k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, idx, k)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, idx, v)

    def prepare_kv_write(self, k_cache: torch.Tensor) -> None:
        """Check :attr:`slots` against a layer's cache and keep them as int64 row indices
        now, before the forward pass: every layer's :meth:`write_kv`, the first one's
        included, is then one ``index_copy_`` per tensor. A no-op once prepared.

        A stage that waits for the previous stage's activations prepares while the
        previous stage computes; a decode's first write then costs a later layer's
        (~8 us against ~47 us through :func:`medha_kernels.append_paged_kv`).

        Args:
            k_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, one layer's
                cache (every layer's has its shape).

        Raises:
            ValueError: the slots are not ``[num_tokens]`` int32 on the cache's device,
                or one is past the cache's ``num_blocks * block_size`` slots.
        """
        if not self.writes_kv or self._kv_write is not None:
            return
        slots = self.slots
        n = self.input_ids.shape[0]
        if slots.dtype != torch.int32 or tuple(slots.shape) != (n,):
            raise ValueError(f"slots: want [{n}] int32, got {list(slots.shape)} {slots.dtype}")
        if slots.device != k_cache.device:
            raise ValueError(f"slots are on {slots.device}, the cache on {k_cache.device}")
        capacity = k_cache.shape[0] * k_cache.shape[1]
        if n and (top := int(slots.max())) >= capacity:
            raise ValueError(f"slots: {top} is past the cache's {capacity} slots")
        self._kv_write = _write_rows(slots)

    def write_index(self) -> torch.Tensor | None:
        """The int64 slots every row's K/V goes to, where the write is prepared
        (:meth:`prepare_kv_write`, :meth:`set_kv_write_index`) and writes every row: a
        layer may then write them itself (``medha_kernels.linear.rms_norm_qkv_rotary``)
        instead of calling :meth:`write_kv`. None otherwise (:meth:`write_kv` does it)."""
        prepared = self._kv_write
        if prepared is None or prepared[1] is not None or not self.writes_kv:
            return None
        return prepared[0]

    def set_kv_write_index(self, index: torch.Tensor) -> None:
        """Write every row's K/V at ``index`` (``[num_tokens]`` int64 slots, each valid
        for the cache, on its device): what :meth:`prepare_kv_write` would keep, with
        its checks and host reads left to the caller (a CUDA graph's static batch,
        whose padding rows write a scratch slot)."""
        n = self.input_ids.shape[0]
        if index.dtype != torch.int64 or tuple(index.shape) != (n,):
            raise ValueError(f"index: want [{n}] int64, got {list(index.shape)} {index.dtype}")
        self._kv_write = (index, None)

    def attention_plan(
        self,
        *,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        backend: str = "auto",
    ) -> PagedAttentionPlan:
        """The step's causal paged-attention plan (see :func:`medha_kernels.plan_paged_attention`).

        Built on the first call for these shapes and backend, then returned as is.
        """
        key = (num_qo_heads, num_kv_heads, head_dim, block_size, dtype, backend)
        plan = self._plans.get(key)
        if plan is None:
            plan = plan_paged_attention(
                cu_seqlens_q=self.cu_seqlens_q,
                kv_lens=self.kv_lens,
                block_table=self.block_table,
                num_qo_heads=num_qo_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                block_size=block_size,
                dtype=dtype,
                backend=backend,
                host=self.host,
            )
            self._plans[key] = plan
        return plan

    def attention_plan_for(
        self, q: torch.Tensor, k_cache: torch.Tensor, backend: str = "auto"
    ) -> PagedAttentionPlan:
        """:meth:`attention_plan` with the shapes and dtype read from the queries
        ``q`` (``[num_q, num_qo_heads, head_dim]``) and the paged cache ``k_cache``
        (``[num_blocks, block_size, num_kv_heads, head_dim]``)."""
        return self.attention_plan(
            num_qo_heads=q.shape[1],
            num_kv_heads=k_cache.shape[2],
            head_dim=q.shape[2],
            block_size=k_cache.shape[1],
            dtype=q.dtype,
            backend=backend,
        )

    def attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, backend: str = "auto"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's causal attention through the step's plan (:meth:`attention_plan_for`):
        ``(o, lse)`` of :meth:`PagedAttentionPlan.run`.

        The step's first call runs the plan checked; later calls with the same
        ``backend`` run it unchecked (:meth:`PagedAttentionPlan.unchecked_run`): every
        layer of a step has the first one's query shape and dtype and a cache like its
        own, and the checks would only run again, cold, after the previous layer's
        attention streamed its KV through the caches.
        """
        done = self._attention_run
        if done is not None and done[0] == backend:
            return done[1](q, k_cache, v_cache)
        plan = self.attention_plan_for(q, k_cache, backend)
        out = plan.run(q, k_cache, v_cache)
        self._attention_run = (backend, plan.unchecked_run())
        return out

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.kv_lens.shape[0])

    def to(self, device: torch.device | str) -> ForwardBatch:
        moved = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        return ForwardBatch(
            **{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in moved.items()}
        )

    @classmethod
    def build(
        cls,
        token_ids: Sequence[Sequence[int]],
        start_positions: Sequence[int],
        block_ids: Sequence[Sequence[int]],
        *,
        block_size: int,
        sample: Sequence[bool] | None = None,
        device: torch.device | str = "cpu",
    ) -> ForwardBatch:
        """A batch from per-sequence Python lists.

        Args:
            token_ids: each sequence's new tokens (a chunk, or one decode token).
            start_positions: the position of each sequence's first new token,
                i.e. how many of its tokens are already in the cache.
            block_ids: each sequence's cache blocks, in order; enough for
                ``start + len(tokens)`` tokens.
            block_size: tokens per cache block.
            sample: which sequences need logits (their last row is sampled);
                default all.
            device: where the tensors go.

        Example:
            A 5-token prefill chunk of sequence 0 beside a decode of sequence 1
            (which already has 6 tokens cached), block size 4::

                ForwardBatch.build([[1, 2, 3, 4, 5], [9]], [0, 6], [[0, 1], [3, 2]],
                                   block_size=4)
        """
        n = len(token_ids)
        if not (len(start_positions) == len(block_ids) == n):
            raise ValueError(
                f"token_ids, start_positions and block_ids need one entry per sequence; "
                f"got {n}, {len(start_positions)} and {len(block_ids)}"
            )
        sample = [True] * n if sample is None else list(sample)
        if len(sample) != n:
            raise ValueError(f"sample has {len(sample)} entries for {n} sequences")
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu = [0]
        kv_lens: list[int] = []
        rows: list[int] = []
        for b, (toks, start, blocks) in enumerate(
            zip(token_ids, start_positions, block_ids, strict=True)
        ):
            if start < 0:
                raise ValueError(f"sequence {b}: start position {start} is negative")
            end = start + len(toks)
            if -(-end // block_size) > len(blocks):
                raise ValueError(
                    f"sequence {b}: {end} tokens need {-(-end // block_size)} blocks of "
                    f"{block_size}, got {len(blocks)}"
                )
            ids.extend(toks)
            positions.extend(range(start, end))
            slots.extend(
                blocks[p // block_size] * block_size + p % block_size for p in range(start, end)
            )
            cu.append(len(ids))
            kv_lens.append(end)
            if sample[b] and toks:
                rows.append(len(ids) - 1)
        width = max((len(b) for b in block_ids), default=0)
        table = [list(b) + [0] * (width - len(b)) for b in block_ids]

        def t(x: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(x, dtype=dtype, device=device)

        return cls(
            input_ids=t(ids, torch.int64),
            positions=t(positions, torch.int64),
            cu_seqlens_q=t(cu, torch.int32),
            kv_lens=t(kv_lens, torch.int32),
            block_table=t(table, torch.int32).reshape(n, width),
            slots=t(slots, torch.int32),
            sample_rows=t(rows, torch.int64),
            host=PagedHost.from_tables(cu, kv_lens, block_ids, block_size),
        )


def _write_rows(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(int64 slots of the rows to write, those rows or None for all) from int32 ``[N]``
    ``slots`` (a negative slot writes nothing)."""
    keep = slots >= 0
    if bool(keep.all()):
        return slots.long(), None
    rows = keep.nonzero().squeeze(1)
    return slots[rows].long(), rows


class KVCache:
    """Paged K/V for the layers of one stage.

    ``k[i]`` and ``v[i]`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``
    (this TP rank's KV heads) for the ``i``-th layer this model holds.
    """

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        if len(k) != len(v) or not k:
            raise ValueError(f"need one k and one v per layer, got {len(k)} and {len(v)}")
        self.k, self.v = k, v

    @classmethod
    def allocate(
        cls,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> KVCache:
        """Zero-filled caches for ``num_layers`` layers.

        On the CPU, one huge-page arena holds every layer's K and V where the
        kernel allows (:mod:`medha_runtime.huge_pages`; ``MEDHA_CPU_HUGE_PAGES=off``
        turns it off): a long context's attention reads blocks in the table's
        order, scattered over the cache.
        """
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        if torch.device(device).type == "cpu":
            made = huge_pages.zeros(2 * num_layers, shape, dtype)
            if made is not None:  # layer i's K then its V
                return cls(made[0::2], made[1::2])
        k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        return cls(k, v)

    @staticmethod
    def bytes_per_block(
        *, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Memory one block takes across all layers (K and V)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def num_blocks(self) -> int:
        return int(self.k[0].shape[0])

    @property
    def block_size(self) -> int:
        return int(self.k[0].shape[1])

    def __repr__(self) -> str:
        shape = tuple(self.k[0].shape)
        return f"KVCache(layers={self.num_layers}, shape={shape}, dtype={self.k[0].dtype})"
