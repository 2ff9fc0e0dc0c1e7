"""KV-cache parallelism: replicate the query, attend per KV shard, merge exactly.

A long sequence's KV cache is split into contiguous shards, one per KVP group,
in order: group 0 holds the oldest tokens and the *tail* group (the last
active one) the newest. Progressive growth: a sequence starts on one group and
activates group ``k`` once groups ``0..k-1`` are full, so the active groups are
always a prefix ``0..active-1`` of the KVP groups. Only the tail group appends
KV for new tokens (and so holds a chunk's own keys); it attends causally and
every earlier group attends to its whole shard.

Collectives run over the prefix subgroup of size ``active``
(``state.kvp_prefix[active]``; the full KVP group when ``active == kvp``).
**Ranks outside the active prefix must not call** :meth:`KVPCommunicator.merge`
or :meth:`KVPCommunicator.broadcast_query` for that sequence: callers skip
them (check :meth:`KVPCommunicator.is_active`). Since prefix subgroups
overlap, every rank must issue its KVP collectives in the same order.
Timeouts come from ``ParallelState.initialize(timeout_s=...)``; a failed or
timed-out collective raises :class:`~medha_parallel.errors.CommunicationError`
naming ``kvp`` and the op, after which the process groups are unusable.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

from medha_kernels import chunked_prefill_attention
from medha_parallel.compat import all_gather_concat
from medha_parallel.errors import named_comm
from medha_parallel.merge import merge_partials, merge_weights, weighted_output
from medha_parallel.state import ParallelState

MergeStrategy = Literal["ag_lse_ar", "ag_all"]
STRATEGIES: tuple[str, ...] = ("ag_lse_ar", "ag_all")


class KVPCommunicator:
    """Query replication and partial-attention merging over a KVP group prefix.

    Attributes:
        size: the KVP degree.
        index: this rank's KVP group (0 holds the oldest KV).
    """

    def __init__(self, state: ParallelState) -> None:
        self.size = state.layout.kvp
        self.index = state.coords.kvp
        self._groups: dict[int, dist.ProcessGroup | None] = dict(state.kvp_prefix)
        if self.size > 1:
            self._groups[self.size] = state.kvp_group

    def __repr__(self) -> str:
        return f"KVPCommunicator(index={self.index}, size={self.size})"

    def is_active(self, active: int) -> bool:
        """Whether this rank takes part when the first ``active`` groups hold the sequence."""
        self._check_active(active)
        return self.index < active

    def broadcast_query(self, q: torch.Tensor, *, active: int, src_group: int) -> torch.Tensor:
        """Copy the query of KVP group ``src_group`` to every active group.

        Args:
            q: ``[num_q, num_qo_heads, head_dim]`` on ``src_group``; elsewhere a
                buffer of the same shape and dtype, overwritten if contiguous.
            active: the number of active KVP groups; 1 is a no-op.
            src_group: the KVP group that owns the query, ``0 <= src_group < active``.

        Returns:
            The query, on every active group.
        """
        group = self._group(active)
        if not 0 <= src_group < active:
            raise ValueError(f"src_group={src_group} is outside 0..{active - 1}")
        if active == 1:
            return q
        buf = q.contiguous()
        with named_comm("kvp", "broadcast_query"):
            dist.broadcast(buf, group=group, group_src=src_group)
        return buf

    def merge(
        self,
        out: torch.Tensor,
        lse: torch.Tensor,
        *,
        active: int,
        strategy: MergeStrategy = "ag_lse_ar",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Merge every active group's partial attention state.

        Args:
            out: ``[num_q, num_heads, head_dim]``, this group's partial output
                (fp16, bf16 or fp32); the same shape on every active group.
            lse: ``[num_q, num_heads]``, its natural-log LSE (fp32); -inf, +inf
                or NaN for a query that saw no key here.
            active: the number of active KVP groups; 1 returns the inputs.
            strategy: ``"ag_lse_ar"`` all-gathers the LSEs, scales the local
                output by ``exp(lse - lse_global)`` and all-reduces the
                outputs in fp32 (traffic independent of ``active``);
                ``"ag_all"`` all-gathers outputs and LSEs and merges locally
                with :func:`~medha_parallel.merge.merge_partials` (reference).

        Returns:
            ``(out, lse)`` over all active groups' keys, on every active group:
            ``[num_q, num_heads, head_dim]`` in ``out``'s dtype and
            ``[num_q, num_heads]`` fp32.
        """
        group = self._group(active)
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; known: {', '.join(STRATEGIES)}")
        if lse.shape != out.shape[:2] or out.dim() != 3:
            raise ValueError(
                f"expected out [num_q, num_heads, head_dim] and lse [num_q, num_heads], "
                f"got {tuple(out.shape)} and {tuple(lse.shape)}"
            )
        if active == 1:
            return out, lse
        lses = _all_gather(lse.detach().float(), active, group, f"merge[{strategy}].all_gather_lse")
        if strategy == "ag_all":
            outs = _all_gather(out.detach(), active, group, "merge[ag_all].all_gather_out")
            return merge_partials(outs, lses)
        w, lse_global = merge_weights(lses)
        partial = weighted_output(out.detach(), w[self.index])
        with named_comm("kvp", "merge[ag_lse_ar].all_reduce_out"):
            dist.all_reduce(partial, group=group)
        return partial.to(out.dtype), lse_global

    def _check_active(self, active: int) -> None:
        if not 1 <= active <= self.size:
            raise ValueError(f"active={active} is outside 1..{self.size}")

    def _group(self, active: int) -> dist.ProcessGroup | None:
        self._check_active(active)
        if self.index >= active:
            raise ValueError(
                f"KVP group {self.index} is outside the active prefix 0..{active - 1}: "
                "callers must skip it"
            )
        return self._groups.get(active)


def _all_gather(x: torch.Tensor, n: int, group: dist.ProcessGroup | None, op: str) -> torch.Tensor:
    """Stack ``x`` from ``n`` ranks into ``[n, *x.shape]`` (gloo needs a dim-0 concatenation)."""
    x = x.contiguous()
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))
    with named_comm("kvp", op):
        all_gather_concat(out, x, group)
    return out.view(n, *x.shape)


def kvp_attention(
    q: torch.Tensor,
    k_shard: torch.Tensor,
    v_shard: torch.Tensor,
    *,
    comm: KVPCommunicator,
    active: int,
    is_tail: bool | None = None,
    q_offset_local: int | None = None,
    sm_scale: float | None = None,
    strategy: MergeStrategy = "ag_lse_ar",
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's attention over KV sharded across the active KVP groups.

    Call it on every active group (and skip the others) with the same query.

    Args:
        q: ``[num_q, num_qo_heads, head_dim]``, the chunk's (or decode's) query.
        k_shard: ``[num_kv, num_kv_heads, head_dim]``, this group's keys; on the
            tail they include the chunk's own keys. ``num_kv`` may be 0.
        v_shard: like ``k_shard``.
        comm: the KVP communicator.
        active: the number of active KVP groups.
        is_tail: whether this group holds the newest keys (default: it is group
            ``active - 1``); the tail attends causally, the others to every key.
        q_offset_local: on the tail, the position of query 0 within its shard
            (default: the chunk is the shard's newest ``num_q`` keys).
        sm_scale: default ``1 / sqrt(head_dim)``.
        strategy: see :meth:`KVPCommunicator.merge`.
        backend: the ``medha_kernels`` attention backend.

    Returns:
        ``(out, lse)``: ``[num_q, num_qo_heads, head_dim]`` in ``q``'s dtype and
        ``[num_q, num_qo_heads]`` fp32, attention over all active groups' keys.
    """
    if is_tail is None:
        is_tail = comm.index == active - 1
    if k_shard.shape[0] == 0:  # this group holds no keys yet: an empty state
        out = q.new_zeros(q.shape)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    else:
        out, lse = chunked_prefill_attention(
            q,
            k_shard,
            v_shard,
            q_offset=q_offset_local if is_tail else None,
            causal=is_tail,
            sm_scale=sm_scale,
            backend=backend,
        )
    return comm.merge(out, lse, active=active, strategy=strategy)
