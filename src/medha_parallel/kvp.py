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

Two entry points share the partial-state and merge code:

- :func:`kvp_attention`: one sequence over contiguous KV shards;
- :func:`plan_kvp_attention` then :func:`kvp_paged_attention`: a batch over a
  paged KV cache, as a serving step runs it. Each group plans its view of the
  step once (which sequences it holds, causal on the tail, non-causal over a
  full earlier shard, nothing where it holds no key) and every layer runs the
  plan and merges over the whole KVP group (``active == kvp``): groups that
  hold nothing of a sequence contribute the empty state ``(0, -inf)``, so one
  collective per layer serves every sequence of the batch.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from medha_kernels import (
    PagedAttentionPlan,
    chunked_prefill_attention,
    native,
    plan_paged_attention_from_host,
)
from medha_kernels.backends import resolve
from medha_parallel import shm
from medha_parallel.compat import all_gather_concat
from medha_parallel.errors import named_comm
from medha_parallel.merge import merge_partials, merge_weights, weighted_output
from medha_parallel.state import ParallelState

MergeStrategy = Literal["auto", "ag_lse_ar", "ag_all"]
STRATEGIES: tuple[str, ...] = ("auto", "ag_lse_ar", "ag_all")
#: "auto" all-gathers whole states (one collective) up to this many bytes per rank
AG_ALL_MAX_BYTES = 1 << 20


_memmove = ctypes.memmove


def _direct(merge_fn: Callable) -> Callable:
    """``merge_fn``, or the native extension's op itself where ``merge_fn`` is
    :func:`medha_kernels.native.merge_states` (whose wrapper only makes the inputs
    contiguous: the shared-memory views are; the op still checks them)."""
    if merge_fn is native.merge_states:
        return native.get_module("cpu").merge_states
    return merge_fn


def _fast_merge(
    shared: shm.ShmAllGather,
    both: tuple[tuple, ...],
    out_bytes: int,
    lse_bytes: int,
    merge_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]],
) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """A repeat of an fp32 shared-memory ``ag_all`` merge (its arguments checked once
    for these shapes), as one closure: write this rank's state, exchange, merge.

    A decode step makes one such call per layer, each right after its attention
    streamed the layer's KV shard through the caches: every Python frame, attribute
    read and dispatched op here runs cold (several microseconds each), so it spends
    none the merge does not need. ``both``: per exchange buffer, the ``[num_q, size,
    num_heads, head_dim]`` outputs and ``[num_q, size, num_heads]`` LSEs over it, this
    rank's slots of each and their addresses (0 where the slots are not contiguous).
    Contiguous states (what the attention returns) are copied into this rank's slots
    with ``memmove`` where those are contiguous too (one query: fp32 on the CPU, as
    the key of :attr:`KVPCommunicator._fast` says), else with ``copy_``; the
    exchange raises its own :class:`~medha_parallel.errors.CommunicationError` (named
    ``kvp``) on a timeout, and ``merge_fn`` is the native op itself.
    """
    next_parity, exchange, memmove = shared.next_parity, shared.exchange, _memmove
    op = "merge[ag_all].all_gather"

    def merge(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        v, s, v_mine, s_mine, v_addr, s_addr = both[next_parity()]
        if v_addr and out.is_contiguous() and lse.is_contiguous():
            memmove(v_addr, out.data_ptr(), out_bytes)
            memmove(s_addr, lse.data_ptr(), lse_bytes)
        else:
            v_mine.copy_(out.detach())
            s_mine.copy_(lse.detach())
        exchange(op)
        return merge_fn(v, s)

    return merge


def _my_slots(vb: torch.Tensor, sb: torch.Tensor, index: int) -> tuple:
    """One exchange buffer's ``[num_q, size, num_heads, head_dim]`` outputs ``vb`` and
    ``[num_q, size, num_heads]`` LSEs ``sb``, rank ``index``'s slots of each, and their
    addresses: ``(vb, sb, v_mine, s_mine, v_addr, s_addr)``, the addresses 0 where the
    slots are not contiguous (a decode's, one query, are: copied by address)."""
    v_mine, s_mine = vb[:, index], sb[:, index]
    one = v_mine.is_contiguous() and s_mine.is_contiguous()
    addrs = (v_mine.data_ptr(), s_mine.data_ptr()) if one else (0, 0)
    return (vb, sb, v_mine, s_mine, *addrs)


def _publisher(
    shared: shm.ShmAllGather,
    views: tuple[tuple[torch.Tensor, torch.Tensor], ...],
    index: int,
    out_bytes: int,
    lse_bytes: int,
    op: str,
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """This rank's half of a repeat of an fp32 shared-memory ``ag_all`` merge whose result
    it does not read, as one closure: its state into its slots of the next exchange's
    buffer, then :meth:`~medha_parallel.shm.ShmAllGather.publish` (no wait for the
    peers). ``views``: per exchange buffer, the ``[num_q, size, num_heads, head_dim]``
    outputs and ``[num_q, size, num_heads]`` LSEs over it. Contiguous states go into
    contiguous slots (a decode's) with ``memmove``, others with ``copy_``."""
    both = [_my_slots(vb, sb, index)[2:] for vb, sb in views]
    next_parity, publish, memmove = shared.next_parity, shared.publish, _memmove

    def contribute(out: torch.Tensor, lse: torch.Tensor) -> None:
        # (_fast_merge's copy into this rank's slots, inline: each frame here runs cold)
        v_mine, s_mine, v_addr, s_addr = both[next_parity()]
        if v_addr and out.is_contiguous() and lse.is_contiguous():
            memmove(v_addr, out.data_ptr(), out_bytes)
            memmove(s_addr, lse.data_ptr(), lse_bytes)
        else:
            v_mine.copy_(out.detach())
            s_mine.copy_(lse.detach())
        publish(op)

    return contribute


class KVPCommunicator:
    """Query replication and partial-attention merging over a KVP group prefix.

    Args:
        state: this rank's parallel state.
        shared_memory: whole-group all-gathers of at most
            :data:`AG_ALL_MAX_BYTES` go through shared memory
            (:class:`~medha_parallel.shm.ShmAllGather`) instead of the process
            group; default: on CPU ranks (gloo) on a supported platform. Set up by the
            first such all-gather, collectively; used only where every rank
            of the group runs on this host.

    Attributes:
        size: the KVP degree.
        index: this rank's KVP group (0 holds the oldest KV).
    """

    def __init__(self, state: ParallelState, *, shared_memory: bool | None = None) -> None:
        self.size = state.layout.kvp
        self.index = state.coords.kvp
        self._groups: dict[int, dist.ProcessGroup | None] = dict(state.kvp_prefix)
        if self.size > 1:
            self._groups[self.size] = state.kvp_group
        self._timeout_s = state.timeout.total_seconds()
        if shared_memory is None:
            shared_memory = state.device_type == "cpu" and shm.supported()
        # None: not set up yet (the first whole-group all-gather does, collectively)
        self._shm: shm.ShmAllGather | bool | None = None if shared_memory else False
        self._merge_fns: dict[str, Callable] = {}  # medha_kernels' merge_states per device type
        self._state_views: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        # merge() calls that took the shared-memory fp32 path, by their arguments' shapes:
        # the merge of such states with everything resolved (_fast_merge); the next such
        # call goes straight to it (a decode step makes one per layer, every step the same)
        self._fast: dict[tuple, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {}
        # and this rank's half of such a merge where it drops the result (contributor)
        self._publish: dict[tuple, Callable[[torch.Tensor, torch.Tensor], None]] = {}

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
        strategy: MergeStrategy = "auto",
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
                outputs in fp32 (two collectives; traffic independent of
                ``active``); ``"ag_all"`` all-gathers every state, output and
                LSE packed in one fp32 buffer (one collective), and merges
                locally with :func:`~medha_parallel.merge.merge_partials`;
                ``"auto"`` takes ``"ag_all"`` with two groups (the same bytes
                as an all-reduce) or when a state is at most
                :data:`AG_ALL_MAX_BYTES`, else ``"ag_lse_ar"``.

        Returns:
            ``(out, lse)`` over all active groups' keys, on every active group:
            ``[num_q, num_heads, head_dim]`` in ``out``'s dtype and
            ``[num_q, num_heads]`` fp32.
        """
        key = (out.shape, lse.shape, out.dtype, lse.dtype, out.device, active, strategy)
        fast = self._fast.get(key)
        if fast is not None:
            return fast(out, lse)
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
        if strategy == "auto":
            small = out.numel() * 4 <= AG_ALL_MAX_BYTES
            strategy = "ag_all" if active == 2 or small else "ag_lse_ar"
        if strategy == "ag_all":
            return self._merge_gathered(out, lse, active, key)
        lses = self._all_gather(lse.detach().float(), active, "merge[ag_lse_ar].all_gather_lse")
        w, lse_global = merge_weights(lses)
        partial = weighted_output(out.detach(), w[self.index])
        with named_comm("kvp", "merge[ag_lse_ar].all_reduce_out"):
            dist.all_reduce(partial, group=group)
        return partial.to(out.dtype), lse_global

    def _merge_gathered(
        self, out: torch.Tensor, lse: torch.Tensor, active: int, key: tuple | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``ag_all``: one all-gather of ``[num_q, num_heads, head_dim + 1]`` states (out,
        then LSE; fp32, or fp64 for fp64 outputs), merged locally.

        ``key``: :meth:`merge`'s arguments, under which a call that goes through shared
        memory in fp32 remembers its views for the next (:func:`_fast_merge`).
        """
        dtype = torch.promote_types(out.dtype, torch.float32)
        op = "merge[ag_all].all_gather"
        shape = (*out.shape[:2], out.shape[2] + 1)
        shared = self._shared(active, out.device, shape, dtype, op)
        if shared is not None and dtype == torch.float32:
            v, s = self._shared_states(shared, out.shape)
            merge_fn = self._merge_fn(v, s)
            if key is not None and out.dtype == torch.float32 and lse.dtype == torch.float32:
                if len(self._fast) >= 64:
                    self._fast.clear()
                    self._publish.clear()
                direct = _direct(merge_fn)
                publish = (
                    getattr(native.get_module("cpu"), "publish_merge_states", None)
                    if direct is not merge_fn
                    else None
                )
                views = tuple(self._state_views_of(shared.buffer(b), out.shape) for b in (0, 1))
                sizes = (out.numel() * 4, lse.numel() * 4)
                self._publish[key] = _publisher(shared, views, self.index, *sizes, op)
                if publish is not None:  # the native op: one call copies, exchanges, merges
                    self._fast[key] = shared.merger(views, publish, direct, op)
                else:
                    both = tuple(_my_slots(vb, sb, self.index) for vb, sb in views)
                    self._fast[key] = _fast_merge(shared, both, *sizes, direct)
            v[:, self.index].copy_(out.detach())  # tokens first: merged in place, no copy
            s[:, self.index].copy_(lse.detach())
            with named_comm("kvp", op):
                shared.exchange(op)
            merged, lse_global = merge_fn(v, s)
            return merged.to(out.dtype), lse_global
        if shared is not None:  # packed straight into the shared slot, merged from the buffer
            slot = shared.slot(shape, dtype)
            slot[..., :-1].copy_(out.detach())
            slot[..., -1].copy_(lse.detach())
            with named_comm("kvp", op):
                states = shared.gather(shape, dtype, op)
        else:
            packed = torch.cat((out.detach().to(dtype), lse.detach().to(dtype)[..., None]), -1)
            states = self._all_gather(packed, active, op)
        if dtype == torch.float32:  # medha_kernels' merge (native on the CPU), tokens first
            v, s = states[..., :-1].transpose(0, 1), states[..., -1].transpose(0, 1)
            merged, lse_global = self._merge_fn(v, s)(v, s)
        else:
            merged, lse_global = merge_partials(states[..., :-1], states[..., -1])
        return merged.to(out.dtype), lse_global.float()

    def merger(
        self,
        out: torch.Tensor,
        lse: torch.Tensor,
        *,
        active: int,
        strategy: MergeStrategy = "auto",
    ) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None:
        """:meth:`merge` of states like ``out`` and ``lse`` with nothing left to check
        or resolve, where an earlier :meth:`merge` of these shapes, dtypes, device,
        ``active`` and ``strategy`` took the fp32 shared-memory path; else None.

        For a decode step's later layers (the first one merged through :meth:`merge`):
        the callable takes ``(out, lse)`` of exactly those shapes and dtypes (it does
        not check them) and returns what :meth:`merge` would.
        """
        key = (out.shape, lse.shape, out.dtype, lse.dtype, out.device, active, strategy)
        return self._fast.get(key)

    def contributor(
        self,
        out: torch.Tensor,
        lse: torch.Tensor,
        *,
        active: int,
        strategy: MergeStrategy = "auto",
    ) -> Callable[[torch.Tensor, torch.Tensor], None] | None:
        """This rank's part of a :meth:`merge` whose result it does not need, where
        :meth:`merger` would find one for these arguments (an earlier :meth:`merge` took
        the shared-memory fp32 path): a callable that takes ``(out, lse)`` of exactly
        those shapes and dtypes (not checked), hands them to the other groups' merge and
        returns without waiting for their states; else None (then call :meth:`merge`
        and drop its result).

        Every group still makes the same merges in the same order: the others call
        :meth:`merge` (or their merger) for this one as usual and get the merged state.
        This rank's next merge first waits for the others to reach this one
        (:meth:`~medha_parallel.shm.ShmAllGather.publish`). For a group whose output
        nobody reads: a KVP group other than the sampler's after its stage's last layer.
        """
        key = (out.shape, lse.shape, out.dtype, lse.dtype, out.device, active, strategy)
        return self._publish.get(key)

    def _merge_fn(self, v: torch.Tensor, s: torch.Tensor) -> Callable:
        """medha_kernels' ``merge_states`` for ``v``'s device, resolved once (shapes are ours)."""
        merge = self._merge_fns.get(v.device.type)
        if merge is None:
            merge = self._merge_fns[v.device.type] = resolve(
                "merge_states", "auto", v.device, (v, s)
            )
        return merge

    def _shared_states(
        self, shared: shm.ShmAllGather, shape: torch.Size
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``[num_q, size, num_heads, head_dim]`` outputs and ``[num_q, size, num_heads]``
        LSEs over the next exchange's buffer, tokens first (what ``merge_states`` takes)."""
        buf = shared.next_buffer()
        key = (buf.data_ptr(), *shape)
        views = self._state_views.get(key)
        if views is None:
            views = self._state_views_of(buf, shape)
            if len(self._state_views) >= 64:
                self._state_views.clear()
            self._state_views[key] = views
        return views

    def _state_views_of(
        self, buf: torch.Tensor, shape: torch.Size
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``[num_q, size, num_heads, head_dim]`` and ``[num_q, size, num_heads]``
        views over the uint8 exchange buffer ``buf`` (outputs, then LSEs)."""
        q, h, d = shape
        nv, ns = q * self.size * h * d, q * self.size * h
        flat = buf.view(torch.float32)
        return flat[:nv].view(q, self.size, h, d), flat[nv : nv + ns].view(q, self.size, h)

    def _all_gather(self, x: torch.Tensor, n: int, op: str) -> torch.Tensor:
        """Stack ``x`` from the first ``n`` groups into ``[n, *x.shape]``."""
        x = x.contiguous()
        shared = self._shared(n, x.device, x.shape, x.dtype, op)
        with named_comm("kvp", op):
            if shared is not None:
                return shared.all_gather(x, op)
            out = x.new_empty((n * x.shape[0], *x.shape[1:]))
            all_gather_concat(out, x, self._groups.get(n))  # gloo needs a dim-0 concatenation
        return out.view(n, *x.shape)

    def _shared(
        self,
        n: int,
        device: torch.device,
        shape: tuple[int, ...] | torch.Size,
        dtype: torch.dtype,
        op: str,
    ) -> shm.ShmAllGather | None:
        """The shared-memory exchange for a whole-group message that fits it, else None.

        The first whole-group call sets it up (collectively; every rank gets there).
        """
        if n != self.size or self._shm is False or device.type != "cpu":
            return None
        if self._shm is None:
            with named_comm("kvp", op):
                self._shm = (
                    shm.ShmAllGather.create(
                        self._groups.get(n), slot_bytes=AG_ALL_MAX_BYTES, timeout_s=self._timeout_s
                    )
                    or False
                )
        if isinstance(self._shm, shm.ShmAllGather) and self._shm.fits(shape, dtype):
            return self._shm
        return None

    @property
    def uses_shared_memory(self) -> bool:
        """Whether whole-group all-gathers go through shared memory (after the first)."""
        return isinstance(self._shm, shm.ShmAllGather)

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
    strategy: MergeStrategy = "auto",
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
        q_offset_local: on the tail, the position of query 0 within its shard,
            ``>= 0`` (default: the chunk is the shard's newest ``num_q`` keys). A
            chunk must start within the tail's shard: the other groups attend to
            every key they hold, so a chunk reaching back into their shards would
            see keys after its own positions (refused with a ValueError on every
            rank it is given to: pass the same value to all).
        sm_scale: default ``1 / sqrt(head_dim)``.
        strategy: see :meth:`KVPCommunicator.merge`.
        backend: the ``medha_kernels`` attention backend.

    Returns:
        ``(out, lse)``: ``[num_q, num_qo_heads, head_dim]`` in ``q``'s dtype and
        ``[num_q, num_qo_heads]`` fp32, attention over all active groups' keys.
    """
    if is_tail is None:
        is_tail = comm.index == active - 1
    # checked on every rank (not only the tail), so no peer waits in the merge for it
    if q_offset_local is not None and q_offset_local < 0:
        raise ValueError(
            f"q_offset_local={q_offset_local}: the chunk must start within the tail's shard "
            "(>= 0); the other groups attend to every key they hold"
        )
    if k_shard.shape[0] == 0:  # this group holds no keys yet: an empty state
        out, lse = empty_state(q)
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


def empty_state(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The state of queries that see no key: ``(0, -inf)``.

    Args:
        q: ``[num_q, num_heads, head_dim]``.

    Returns:
        ``[num_q, num_heads, head_dim]`` zeros in ``q``'s dtype and
        ``[num_q, num_heads]`` fp32 ``-inf``.
    """
    out = q.new_zeros(q.shape)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    return out, lse


@dataclass(frozen=True)
class KVPPart:
    """Sequences of a step that one KVP group attends to in one paged-attention call.

    Attributes:
        rows: ``[num_rows]`` int64 query rows of the step's batch, or None for
            every row (then the plan has this one part).
        plan: the paged-attention plan of those rows (causal or not).
    """

    rows: torch.Tensor | None
    plan: PagedAttentionPlan


@dataclass(frozen=True)
class KVPAttentionPlan:
    """One KVP group's attention over its shard for one step, planned once, run by every layer.

    Attributes:
        num_q: query rows of the step's batch.
        parts: the paged-attention calls (at most two: a causal one and a
            non-causal one); rows in none of them see no key on this group.
    """

    num_q: int
    parts: tuple[KVPPart, ...]

    def partial(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This group's partial state for one layer (no host read, no collective).

        Args:
            q: ``[num_q, num_qo_heads, head_dim]``, the whole batch's query.
            k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``,
                this group's cache of the layer, the step's new K/V written.

        Returns:
            ``(out [num_q, num_qo_heads, head_dim]`` in q's dtype, ``lse [num_q,
            num_qo_heads]`` fp32); ``(0, -inf)`` for rows this group holds nothing of.
        """
        if q.shape[0] != self.num_q:
            raise ValueError(f"q has {q.shape[0]} rows; the plan has {self.num_q}")
        parts = self.parts
        if len(parts) == 1 and parts[0].rows is None:
            return parts[0].plan.run(q, k_cache, v_cache)
        return self._partial_parts(q, k_cache, v_cache)

    def partial_fn(self) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`partial` without its checks, for a step's later layers (the first one's
        :meth:`partial` checked the rows, the query and the caches): the one paged-attention
        call, unchecked (:meth:`~medha_kernels.PagedAttentionPlan.unchecked_run`), where it
        covers every row (a decode step), else the loop over the parts."""
        parts = self.parts
        if len(parts) == 1 and parts[0].rows is None:
            return parts[0].plan.unchecked_run()
        return self._partial_parts

    def _partial_parts(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        parts = self.parts
        out, lse = empty_state(q)
        for part in parts:
            assert part.rows is not None
            o, s = part.plan.run(q.index_select(0, part.rows), k_cache, v_cache)
            out.index_copy_(0, part.rows, o)
            lse.index_copy_(0, part.rows, s)
        return out, lse


def plan_kvp_attention(
    *,
    num_q: Sequence[int],
    kv_lens: Sequence[int],
    is_tail: Sequence[bool],
    block_tables: Sequence[Sequence[int]],
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    sm_scale: float | None = None,
    backend: str = "auto",
) -> KVPAttentionPlan:
    """Plan one KVP group's attention of a step's batch over its paged KV shard.

    Sequence ``b`` owns the next ``num_q[b]`` query rows of the batch (rows
    are in sequence order). This group holds ``kv_lens[b]`` of its keys, in
    blocks ``block_tables[b]``:

    - on its tail group (``is_tail[b]``), the newest keys, the chunk's own
      included: causal attention (``kv_lens[b] >= num_q[b]``);
    - on an earlier group, a full shard before the chunk: every key;
    - ``kv_lens[b] == 0``: the group holds nothing of it: ``(0, -inf)``.

    Decodes (one query) on an earlier group join the causal call (one query
    sees every key either way), so a step of decodes is a single call.
    Everything is read from host lists: the only device work is building the
    plan's tensors and :func:`~medha_kernels.plan_paged_attention`'s checks.

    Args:
        num_q: ``[batch]`` query rows per sequence, each ``>= 1``.
        kv_lens: ``[batch]`` keys this group holds per sequence.
        is_tail: ``[batch]`` whether this group holds the sequence's newest keys.
        block_tables: ``[batch]`` block ids per sequence, at least
            ``ceil(kv_lens[b] / block_size)`` each.
        num_qo_heads, num_kv_heads, head_dim, block_size, dtype: every layer's shapes.
        device: where the plan's tensors live (the caches' device).
        sm_scale: default ``1 / sqrt(head_dim)``.
        backend: the ``medha_kernels`` attention backend.

    Returns:
        A :class:`KVPAttentionPlan`.
    """
    batch = len(num_q)
    if not len(kv_lens) == len(is_tail) == len(block_tables) == batch:
        raise ValueError(
            f"num_q, kv_lens, is_tail and block_tables need one entry per sequence; got "
            f"{batch}, {len(kv_lens)}, {len(is_tail)} and {len(block_tables)}"
        )
    if int(block_size) < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size!r}")
    causal: list[int] = []
    full: list[int] = []
    starts = [0] * batch
    row = 0
    for b in range(batch):
        n, kv = int(num_q[b]), int(kv_lens[b])
        if n < 1 or kv < 0:
            raise ValueError(f"sequence {b}: num_q={n} must be >= 1 and kv_lens={kv} >= 0")
        if is_tail[b] and kv < n:
            raise ValueError(f"sequence {b}: its tail group holds {kv} keys for {n} queries")
        if len(block_tables[b]) < -(-kv // block_size):
            raise ValueError(
                f"sequence {b}: {kv} keys need {-(-kv // block_size)} blocks of {block_size}, "
                f"got {len(block_tables[b])}"
            )
        starts[b] = row
        row += n
        if kv > 0:
            (causal if is_tail[b] or n == 1 else full).append(b)
    shapes = {
        "num_qo_heads": num_qo_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "block_size": block_size,
        "dtype": dtype,
        "sm_scale": sm_scale,
        "backend": backend,
    }

    def part(seqs: list[int], is_causal: bool, every_row: bool) -> KVPPart:
        cu = [0]
        rows: list[int] = []
        for b in seqs:
            cu.append(cu[-1] + int(num_q[b]))
            if not every_row:
                rows.extend(range(starts[b], starts[b] + int(num_q[b])))
        plan = plan_paged_attention_from_host(
            cu_seqlens_q=cu,
            kv_lens=[int(kv_lens[b]) for b in seqs],
            block_tables=[block_tables[b] for b in seqs],
            causal=is_causal,
            device=device,
            **shapes,
        )
        return KVPPart(
            None if every_row else torch.tensor(rows, dtype=torch.int64, device=device), plan
        )

    every_row = len(causal) == batch
    parts = tuple(
        part(seqs, is_causal, every_row)
        for seqs, is_causal in ((causal, True), (full, False))
        if seqs
    )
    return KVPAttentionPlan(num_q=row, parts=parts)


def kvp_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    plan: KVPAttentionPlan,
    comm: KVPCommunicator,
    strategy: MergeStrategy = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's attention over the paged KV shards of every KVP group (one layer).

    Call it on every KVP group with the same query rows, each with its own
    plan (:func:`plan_kvp_attention`): each group attends over its shard and
    the partial states are merged over the whole KVP group, one merge per call.

    Args:
        q: ``[num_q, num_qo_heads, head_dim]``, the batch's query (the same on every group).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``,
            this group's cache of the layer, with the step's new K/V written.
        plan: this group's plan of the step.
        comm: the KVP communicator.
        strategy: see :meth:`KVPCommunicator.merge`.

    Returns:
        ``(out, lse)``: ``[num_q, num_qo_heads, head_dim]`` in ``q``'s dtype and
        ``[num_q, num_qo_heads]`` fp32, attention over every group's keys.
    """
    out, lse = plan.partial(q, k_cache, v_cache)
    return comm.merge(out, lse, active=comm.size, strategy=strategy)
