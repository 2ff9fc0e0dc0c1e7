"""Paged KV memory per KVP group, for a scheduler that preempts by recompute.

Sharding: with ``G = cache.group_token_limit`` (Gmax), shard ``i`` of a request
holds token positions ``[i*G, (i+1)*G)`` and lives on its own KVP group. The
request's groups form an ordered tuple in shard order; the last is the *tail*
group, the only one whose shard may be partial. Shard ``i`` holding ``t``
tokens owns ``ceil(t / block_size)`` blocks of its group's pool.

Watermark rule: an admission reserves blocks for the WHOLE prompt at once (a
half-admitted prefill could deadlock waiting for memory) and must leave at
least ``cache.watermark_blocks`` free on every group it touches. Growth for
decodes (:meth:`KVBlockManager.ensure_capacity`) ignores the watermark: that
head-room is kept exactly so running requests can grow.

Group choice is deterministic: groups with the most free blocks first, ties
to the lowest id; full shards take the roomiest groups, the tail the next.

Prefix caching (``cache.enable_prefix_caching``): a full block whose KV has
been computed is registered under its content hash (see
:mod:`medha_sched.prefix_hash`) in its group's pool. An admission given the
prompt's block hashes first looks for its longest cached prefix: shard by
shard (shard ``i`` covers positions ``[i*G, (i+1)*G)`` whatever the request,
so a shared prefix lies in the same shards), the group holding the longest
run of the shard's hashes. Those blocks are shared (reference-counted), the
shards they lie in are pinned to their groups, and only the rest of the
prompt is reserved. The hit stops one token short of the prompt, so a
request always computes at least its last prompt token. Freeing a request
(finish or preemption) drops references; a block nobody holds keeps its KV
until a pool runs out of free blocks and evicts it (LRU, per group).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from medha_sched.block_counter import NO_ID, BlockCounter
from medha_sched.block_pool import BlockPool
from medha_sched.config import CacheConfig
from medha_sched.errors import SchedulerError


def _check_tokens(num_tokens: object) -> None:
    if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 1:
        raise SchedulerError(f"num_tokens must be an integer >= 1, got {num_tokens!r}")


@dataclass(slots=True)
class _Entry:
    groups: tuple[int, ...]  # shard order (a tuple: handed out without copying)
    blocks: list[list[int]]  # per shard
    tokens: int  # tokens the request was sized for
    pending: dict[int, list[int]] = field(default_factory=dict)  # group -> new blocks
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    registered: int = 0  # leading blocks offered to the prefix cache so far


#: ``(group, block ids)`` of one shard's cached run, in shard order
_Hit = tuple[int, list[int]]


class KVBlockManager:
    """Block tables of all requests over ``num_groups`` KVP groups."""

    def __init__(self, cache: CacheConfig, *, num_groups: int) -> None:
        if not isinstance(num_groups, int) or isinstance(num_groups, bool) or num_groups < 1:
            raise SchedulerError(f"num_groups must be an integer >= 1, got {num_groups!r}")
        self.cache = cache
        self.num_groups = num_groups
        self._g = cache.group_token_limit
        self._bs = cache.block_size
        self._reserve = cache.watermark_blocks
        self._caching = cache.enable_prefix_caching
        self._ids = cache.block_ids
        pool = BlockPool if cache.block_ids else BlockCounter  # counted only: ids are all -1
        self._pools: list[BlockPool | BlockCounter] = [
            pool(g, cache.num_blocks_per_group) for g in range(num_groups)
        ]
        self._holders: list[set[Hashable]] = [set() for _ in range(num_groups)]
        self._entries: dict[Hashable, _Entry] = {}

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self._bs)

    def _split(self, num_tokens: int, num_shards: int) -> list[int]:
        return [min(self._g, max(0, num_tokens - i * self._g)) for i in range(num_shards)]

    def _pick(
        self, free: Sequence[int], candidates: Iterable[int], needs: list[int], reserve: int
    ) -> list[int] | None:
        """Groups for shards needing ``needs`` blocks (non-increasing), or None.

        The roomiest candidates are taken in order; pairing the biggest needs
        with the most free groups is optimal, so None means no fit exists.
        """
        order = sorted(candidates, key=lambda g: (-free[g], g))[: len(needs)]
        if len(order) < len(needs):
            return None
        if any(free[g] - need < reserve for g, need in zip(order, needs, strict=True)):
            return None
        return order

    def _plan_admit(
        self,
        num_tokens: int,
        free: Sequence[int],
        hits: Sequence[_Hit] = (),
        reserve: int | None = None,
    ) -> list[int] | None:
        """Groups of a ``num_tokens``-token prompt in shard order, or None.

        The shards of ``hits`` are pinned to their groups; their cached blocks
        are shared, so only the rest of each such shard is allocated (a hit
        block that is now cached stops counting as free once taken).
        ``reserve``: blocks each touched group keeps free (None: the watermark).
        """
        _check_tokens(num_tokens)
        needs = [self._blocks_for(t) for t in self._split(num_tokens, -(-num_tokens // self._g))]
        if reserve is None:
            reserve = self._reserve
        pinned = []
        for (group, blocks), need in zip(hits, needs, strict=False):
            pool = self._pools[group]
            taken = sum(1 for b in blocks if pool.is_cached(b))
            if free[group] - taken - (need - len(blocks)) < reserve:
                return None
            pinned.append(group)
        rest = needs[len(pinned) :]
        if not rest:
            return pinned
        others = self._pick(
            free, (g for g in range(self.num_groups) if g not in pinned), rest, reserve
        )
        return None if others is None else pinned + others

    def _match(self, block_hashes: Sequence[Hashable], num_tokens: int) -> list[_Hit]:
        """The longest cached prefix of a prompt, as runs of blocks per shard.

        Shard by shard, the group (not used by an earlier shard) holding the
        longest run of the shard's hashes; a run shorter than the shard ends
        the prefix. At most ``num_tokens - 1`` tokens are matched.
        """
        if not self.cache.enable_prefix_caching or not block_hashes:
            return []
        limit = min(len(block_hashes), (num_tokens - 1) // self._bs)
        per_shard = self._g // self._bs
        hits: list[_Hit] = []
        used: set[int] = set()
        k = 0
        while k < limit:
            end = min(limit, k + per_shard)
            best: _Hit | None = None
            for group, pool in enumerate(self._pools):
                if group in used:
                    continue
                run = []
                for i in range(k, end):
                    block = pool.lookup(block_hashes[i])
                    if block is None:
                        break
                    run.append(block)
                if run and (best is None or len(run) > len(best[1])):
                    best = (group, run)
            if best is None:
                break
            hits.append(best)
            used.add(best[0])
            k += len(best[1])
            if k < end:
                break
        return hits

    def cached_prefix_tokens(self, block_hashes: Sequence[Hashable], num_tokens: int) -> int:
        """Tokens of a ``num_tokens``-token prompt the prefix cache holds now
        (a look only: nothing is taken, and an admission may find less)."""
        return sum(len(run) for _, run in self._match(block_hashes, num_tokens)) * self._bs

    def _free_counts(self) -> list[int]:
        return [pool.num_free for pool in self._pools]

    def free_blocks(self) -> list[int]:
        """Free blocks of each group, in group order."""
        return self._free_counts()

    @property
    def group_limit(self) -> int:
        """Most tokens of one request on one group (the shard size)."""
        return self._g

    def tail_blocks(self, request_id: Hashable) -> int:
        """Blocks held by the request's last shard."""
        return len(self._entry(request_id).blocks[-1])

    def _grant(self, rid: Hashable, entry: _Entry, shard: int, count: int) -> None:
        if count <= 0:
            return
        group = entry.groups[shard]
        new = self._pools[group].allocate(rid, count)
        entry.blocks[shard].extend(new)
        entry.pending.setdefault(group, []).extend(new)
        self._holders[group].add(rid)

    def can_admit(self, num_tokens: int, block_hashes: Sequence[Hashable] = ()) -> bool:
        """Whether :meth:`admit` of ``num_tokens`` tokens would succeed now."""
        return self.plan_admit(num_tokens, block_hashes) is not None

    def plan_admit(
        self,
        num_tokens: int,
        block_hashes: Sequence[Hashable] = (),
        *,
        reserve: int | None = None,
    ) -> tuple[int, ...] | None:
        """The groups :meth:`admit` would give a prompt now, in shard order, or None."""
        plan = self._plan_cached(num_tokens, block_hashes, reserve)
        return None if plan is None else tuple(plan[0])

    def plan_admit_cached(
        self,
        num_tokens: int,
        block_hashes: Sequence[Hashable] = (),
        *,
        reserve: int | None = None,
    ) -> tuple[tuple[int, ...], int] | None:
        """``(groups, cached tokens)`` :meth:`admit` would give a prompt now, or None."""
        plan = self._plan_cached(num_tokens, block_hashes, reserve)
        if plan is None:
            return None
        groups, hits = plan
        return tuple(groups), sum(len(run) for _, run in hits) * self._bs

    def _plan_cached(
        self, num_tokens: int, block_hashes: Sequence[Hashable], reserve: int | None = None
    ) -> tuple[list[int], list[_Hit]] | None:
        """Groups and cache hits of an admission; without the hits when the
        pinned groups lack room for the rest of their shards. ``reserve``:
        blocks each touched group keeps free (None: the watermark)."""
        hits = self._match(block_hashes, num_tokens) if block_hashes and self._caching else []
        if not hits:
            _check_tokens(num_tokens)
            if num_tokens <= self._g:  # one shard: the roomiest group, the lowest first
                need = -(-num_tokens // self._bs)
                pools = self._pools
                if len(pools) == 1:
                    group, free = 0, pools[0].num_free
                else:
                    counts = [pool.num_free for pool in pools]
                    free = max(counts)
                    group = counts.index(free)
                keep = self._reserve if reserve is None else reserve
                return None if free - need < keep else ([group], hits)
        free = self._free_counts()
        if hits:
            groups = self._plan_admit(num_tokens, free, hits, reserve)
            if groups is not None:
                return groups, hits
        groups = self._plan_admit(num_tokens, free, reserve=reserve)
        return None if groups is None else (groups, [])

    @property
    def max_admit_tokens(self) -> int:
        """The longest prompt empty memory admits with the watermark left free: every
        group's shard if a group holds one beside the watermark, else what one group
        holds beside it."""
        usable = (self.cache.num_blocks_per_group - self._reserve) * self._bs
        return self.num_groups * self._g if usable >= self._g else usable

    def can_ever_admit(self, num_tokens: int) -> bool:
        """Whether ``num_tokens`` tokens could be admitted into empty memory."""
        empty = [self.cache.num_blocks_per_group] * self.num_groups
        return self._plan_admit(num_tokens, empty) is not None

    def admit(
        self,
        request_id: Hashable,
        num_tokens: int,
        block_hashes: Sequence[Hashable] = (),
        *,
        reserve: int | None = None,
    ) -> bool:
        """Reserve blocks for a whole ``num_tokens``-token prompt.

        With ``block_hashes`` (the prompt's full blocks, see
        :mod:`medha_sched.prefix_hash`) and prefix caching on, the longest
        cached prefix is shared instead of allocated;
        :meth:`cached_tokens` says how long it is. Returns False, changing
        nothing, if it does not fit while leaving the watermark free on each
        touched group (``reserve`` blocks instead, when given). Raises
        SchedulerError (a ValueError) if ``request_id`` already holds blocks.
        """
        if request_id in self._entries:
            raise SchedulerError(f"request {request_id!r} is already admitted")
        plan = self._plan_cached(num_tokens, block_hashes, reserve)
        if plan is None:
            return False
        groups, hits = plan
        if not hits and len(groups) == 1:  # one shard, nothing cached: one allocation
            self.admit_one_shard(request_id, num_tokens, groups[0])
            return True
        entry = _Entry(groups=tuple(groups), blocks=[[] for _ in groups], tokens=num_tokens)
        self._entries[request_id] = entry
        for shard, (group, run) in enumerate(hits):  # before allocating: never evict a hit
            pool = self._pools[group]
            for block in run:
                pool.acquire(block)
            entry.blocks[shard].extend(run)
            entry.pending.setdefault(group, []).extend(run)
            self._holders[group].add(request_id)
        hit_blocks = sum(len(run) for _, run in hits)
        entry.cached_tokens = hit_blocks * self._bs
        entry.registered = hit_blocks
        for shard, tokens in enumerate(self._split(num_tokens, len(groups))):
            self._grant(
                request_id, entry, shard, self._blocks_for(tokens) - len(entry.blocks[shard])
            )
        return True

    def admit_one_shard(self, request_id: Hashable, num_tokens: int, group: int) -> None:
        """:meth:`admit` of a prompt without block hashes for which
        :meth:`plan_admit` gave ``(group,)``, nothing having changed since:
        the same blocks, without planning again."""
        if request_id in self._entries:
            raise SchedulerError(f"request {request_id!r} is already admitted")
        new = self._pools[group].allocate(request_id, self._blocks_for(num_tokens))
        self._entries[request_id] = _Entry(
            groups=(group,), blocks=[list(new)], tokens=num_tokens, pending={group: list(new)}
        )
        self._holders[group].add(request_id)

    def cached_tokens(self, request_id: Hashable) -> int:
        """Prompt tokens the request found in the prefix cache when admitted."""
        return self._entry(request_id).cached_tokens

    def register_blocks(
        self, request_id: Hashable, block_hashes: Sequence[Hashable], num_tokens: int
    ) -> None:
        """Offer the request's full blocks within its first ``num_tokens``
        positions (KV computed on every stage) to the prefix cache.

        ``block_hashes`` gives at least the hashes of those blocks it knows;
        blocks offered before are skipped, so the cost is the new blocks.
        A no-op with prefix caching off.
        """
        if not self._caching:
            return
        entry = self._entry(request_id)
        upto = min(len(block_hashes), num_tokens // self._bs)
        per_shard = self._g // self._bs
        for k in range(entry.registered, upto):
            shard, index = divmod(k, per_shard)
            if shard >= len(entry.groups) or index >= len(entry.blocks[shard]):
                break
            self._pools[entry.groups[shard]].register(entry.blocks[shard][index], block_hashes[k])
            entry.registered = k + 1

    def ensure_capacity(self, request_id: Hashable, num_tokens: int) -> bool:
        """Grow the request block by block until it holds ``num_tokens`` tokens.

        Ignores the watermark. A token past a full tail shard opens a new
        shard on the roomiest group the request does not use yet. Returns
        False, changing nothing, if blocks or groups run out. Never shrinks.
        """
        entry = self._entry(request_id)
        _check_tokens(num_tokens)
        capacity = (len(entry.groups) - 1) * self._g + len(entry.blocks[-1]) * self._bs
        if num_tokens <= capacity:
            if num_tokens > entry.tokens:
                entry.tokens = num_tokens
            return True
        num_shards = -(-num_tokens // self._g)
        if num_shards > self.num_groups:
            return False
        needs = [self._blocks_for(t) for t in self._split(num_tokens, num_shards)]
        old = len(entry.groups)
        extra = [need - len(have) for need, have in zip(needs[:old], entry.blocks, strict=True)]
        free = self._free_counts()
        if any(free[g] < n for g, n in zip(entry.groups, extra, strict=True)):
            return False
        unused = (g for g in range(self.num_groups) if g not in entry.groups)
        new_groups = self._pick(free, unused, needs[old:], 0)
        if new_groups is None:
            return False
        entry.groups = (*entry.groups, *new_groups)
        entry.blocks.extend([] for _ in new_groups)
        for shard, count in enumerate(extra + needs[old:]):
            if count:
                self._grant(request_id, entry, shard, count)
        entry.tokens = num_tokens
        return True

    def ensure_capacity_many(self, wants: Iterable[tuple[Hashable, int]]) -> list[Hashable]:
        """``ensure_capacity`` for many requests; returns the ids that could not grow.

        The common cases (room already there, or more blocks in the tail
        shard's own group) cost one lookup and one allocation per request.
        """
        failed = []
        g, bs, entries = self._g, self._bs, self._entries
        for request_id, num_tokens in wants:
            entry = entries.get(request_id)
            if entry is not None:
                shards = len(entry.groups)
                tail_tokens = num_tokens - (shards - 1) * g
                if 0 < tail_tokens <= g:
                    extra = -(-tail_tokens // bs) - len(entry.blocks[-1])
                    if extra <= 0 or self._grow_tail(request_id, entry, extra):
                        entry.tokens = max(entry.tokens, num_tokens)
                        continue
            if not self.ensure_capacity(request_id, num_tokens):
                failed.append(request_id)
        return failed

    def grow_tails(self, group: int, request_ids: Sequence[Hashable]) -> tuple[int, ...] | None:
        """One more block on ``group`` for each request, in order; the block ids.

        For decodes crossing a block boundary inside a tail shard that lives
        on ``group`` (the caller knows; the shard must have room for a
        block). Gives the blocks ``ensure_capacity`` would give called for
        each request in turn, but in one pass, and does not record them as
        new (the caller reports them). Returns None, changing nothing, when
        the group has fewer free blocks than requests.
        """
        pool = self._pools[group]
        if pool.num_free < len(request_ids):
            return None
        blocks = pool.allocate_each(request_ids)
        for entry, block in zip(map(self._entries.__getitem__, request_ids), blocks, strict=True):
            entry.blocks[-1].append(block)
        return blocks

    def grow_tails_unspelled(self, group: int, request_ids: Iterable[Hashable], count: int) -> bool:
        """:meth:`grow_tails` for a caller that reads no block id (``count``: how many
        ``request_ids`` there are, which may be an iterator): the same state
        afterwards; False, changing nothing, when the group has fewer free
        blocks than requests. Blocks only counted, every id is :data:`NO_ID`:
        no ids are built, each tail gets the placeholder directly."""
        if not self._ids:
            pool = self._pools[group]
            if pool.num_free < count:
                return False
            pool.allocate(None, count)
            entries = self._entries
            for rid in request_ids:
                entries[rid].blocks[-1].append(NO_ID)
            return True
        return self.grow_tails(group, tuple(request_ids)) is not None

    def _grow_tail(self, rid: Hashable, entry: _Entry, count: int) -> bool:
        """Give the tail shard ``count`` more blocks from its own group, if free."""
        if self._pools[entry.groups[-1]].num_free < count:
            return False
        self._grant(rid, entry, len(entry.groups) - 1, count)
        return True

    def free(self, request_id: Hashable) -> None:
        """Drop the request's reference to each of its blocks, exactly once.

        With prefix caching the blocks go back last first, so a pool short
        of blocks evicts a cached prefix from its end: its start, which
        every longer match needs, stays cached longest.
        """
        entry = self._entry(request_id)
        pairs = list(zip(entry.groups, entry.blocks, strict=True))
        caching = self._caching and self._ids
        for group, blocks in reversed(pairs) if caching else pairs:
            # (its own blocks: ids the pool handed out)
            self._pools[group].release_allocated(request_id, blocks[::-1] if caching else blocks)
            self._holders[group].discard(request_id)
        del self._entries[request_id]

    def pop_new_blocks(self, request_id: Hashable) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """``(group, block ids)`` allocated since the last call, in shard order."""
        entry = self._entry(request_id)
        pending = entry.pending
        if not pending:
            return ()
        groups = entry.groups
        if len(groups) == 1:
            out: tuple[tuple[int, tuple[int, ...]], ...] = ((groups[0], tuple(pending[groups[0]])),)
        else:
            out = tuple((g, tuple(pending[g])) for g in groups if g in pending)
        pending.clear()
        return out

    def drop_new_blocks(self, request_id: Hashable) -> None:
        """:meth:`pop_new_blocks` for a caller that reads no id: the same state
        afterwards (and the same error for an unknown request), no answer built."""
        self._entry(request_id).pending.clear()

    def _entry(self, request_id: Hashable) -> _Entry:
        entry = self._entries.get(request_id)
        if entry is None:
            raise SchedulerError(
                f"request {request_id!r} holds no KV blocks (unknown or already freed)"
            )
        return entry

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def groups_of(self, request_id: Hashable) -> tuple[int, ...]:
        """The request's groups in shard order."""
        return self._entry(request_id).groups

    def tail_group(self, request_id: Hashable) -> int:
        """The group holding the request's last shard (may be group 0)."""
        return self._entry(request_id).groups[-1]

    def block_table(self, request_id: Hashable) -> tuple[tuple[int, ...], ...]:
        """Block ids per shard, in shard order (each -1 when blocks are only counted)."""
        return tuple(tuple(b) for b in self._entry(request_id).blocks)

    def num_tokens_capacity(self, request_id: Hashable) -> int:
        """Tokens the request's blocks can hold: full shards plus the tail's blocks."""
        entry = self._entry(request_id)
        return (len(entry.groups) - 1) * self._g + len(entry.blocks[-1]) * self._bs

    def shard_tokens(self, request_id: Hashable, num_tokens: int) -> tuple[int, ...]:
        """How many of the first ``num_tokens`` positions each shard holds."""
        if not 0 <= num_tokens <= self.num_tokens_capacity(request_id):
            raise SchedulerError(
                f"num_tokens={num_tokens!r} is outside request {request_id!r}'s capacity"
            )
        return tuple(self._split(num_tokens, len(self._entry(request_id).groups)))

    def num_free_blocks(self, group: int) -> int:
        """Free blocks in ``group``'s pool."""
        return self._pools[group].num_free

    def num_used_blocks(self, group: int) -> int:
        """Blocks of ``group`` owned by some request."""
        return self._pools[group].num_used

    def usage(self) -> float:
        """Fraction of all blocks, over all groups, in use."""
        used = sum(pool.num_used for pool in self._pools)
        return used / (self.num_groups * self.cache.num_blocks_per_group)

    def holders(self, group: int) -> set[Hashable]:
        """Requests with blocks on ``group`` (a copy)."""
        return set(self._holders[group])

    @property
    def num_block_allocs(self) -> int:
        """Blocks handed out, ever, over all groups."""
        return sum(pool.num_allocs for pool in self._pools)

    @property
    def num_block_frees(self) -> int:
        """Blocks returned, ever, over all groups."""
        return sum(pool.num_frees for pool in self._pools)

    def num_cached_blocks(self, group: int) -> int:
        """Blocks of ``group`` held by nobody that keep reusable KV."""
        return self._pools[group].num_cached

    def ref_count(self, group: int, block: int) -> int:
        """Requests holding ``block`` of ``group``."""
        pool = self._pools[group]
        if not isinstance(pool, BlockPool):
            raise SchedulerError(
                "blocks are counted, not named (CacheConfig.block_ids=False): "
                f"block {block!r} has no reference count"
            )
        return pool.ref_count(block)

    def check_invariants(self) -> None:
        """Raise AssertionError if any bookkeeping invariant is broken."""
        for pool in self._pools:
            pool.check()
        refs: list[dict[int, int]] = [{} for _ in self._pools]
        holders: list[set[Hashable]] = [set() for _ in self._pools]
        for rid, entry in self._entries.items():
            self._check_entry(rid, entry, refs, holders)
        if not self._ids:
            self._check_counts(refs, holders)
            return
        for group, pool in enumerate(self._pools):
            assert len(refs[group]) == pool.num_used, f"group {group}: held blocks leaked"
            for block, n in refs[group].items():
                assert pool.ref_count(block) == n, (
                    f"group {group}: block {block} has {pool.ref_count(block)} references, "
                    f"{n} holders"
                )
            assert holders[group] == self._holders[group], f"group {group}: holders out of date"

    def _check_entry(
        self,
        rid: Hashable,
        entry: _Entry,
        refs: list[dict[int, int]],
        holders: list[set[Hashable]],
    ) -> None:
        assert len(set(entry.groups)) == len(entry.groups), f"{rid!r}: a group holds two shards"
        assert len(entry.groups) == len(entry.blocks) >= 1, f"{rid!r}: bad shard lists"
        split = self._split(entry.tokens, len(entry.groups))
        for shard, (group, blocks) in enumerate(zip(entry.groups, entry.blocks, strict=True)):
            tokens = split[shard]
            assert self._blocks_for(tokens) <= len(blocks) <= self._g // self._bs, (
                f"{rid!r}: shard {shard} has {len(blocks)} blocks for {tokens} tokens"
            )
            if not self._ids:
                assert set(blocks) <= {NO_ID}, f"{rid!r}: an id in shard {shard} of a counter"
                refs[group][NO_ID] = refs[group].get(NO_ID, 0) + len(blocks)
            else:
                assert len(set(blocks)) == len(blocks), f"{rid!r}: a block twice in shard {shard}"
                for block in blocks:
                    refs[group][block] = refs[group].get(block, 0) + 1
            if blocks:
                holders[group].add(rid)
        for shard, blocks in enumerate(entry.blocks[:-1]):
            assert len(blocks) * self._bs == self._g, f"{rid!r}: non-tail shard {shard} not full"

    def _check_counts(self, refs: list[dict[int, int]], holders: list[set[Hashable]]) -> None:
        """check_invariants' end for counted blocks: each group's held count is the
        sum of its shards' lengths (``_check_entry`` put it under ``refs[g][NO_ID]``)."""
        for group, pool in enumerate(self._pools):
            held = refs[group].get(NO_ID, 0)
            assert held == pool.num_used, (
                f"group {group}: {pool.num_used} blocks counted held, the shards hold {held}"
            )
            assert holders[group] == self._holders[group], f"group {group}: holders out of date"
