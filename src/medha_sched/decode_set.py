"""Running decodes in lanes: a step costs what changed, not what exists.

A *lane* is a group of decoding requests that are issued together, clear
pipeline stage 0 together and leave the pipeline together, each one token
further every time. Its three counters (``issued``, ``cleared``,
``computed``) move every member's cursors at once: a member stores only its
cursors' bases (:class:`~medha_sched.request.Request` adds the lane's
counter when read), so issuing a lane of any size is O(1).

What a lane keeps up to date as members join, leave or cross a block:

* **Pricing.** For cost models whose one-token features are integers affine
  in the KV length (``AggregateCostModel.affine_decode_features``), a
  member at position ``base + issued`` adds ``A + kv * B`` to its tail
  group's totals and a constant to each earlier group. A lane keeps, per
  group, the number of tail members, the sum of their ``base - shard
  offset`` and the constants: its totals at any step are O(groups), and
  equal (integers) to summing the members one by one. Other cost models are
  priced member by member, in running order, as before.
* **Block crossings.** A member needs a new KV block at the lane step
  ``capacity - base``. Members are kept in buckets by that step, so a step
  looks only at the members that cross now; after each gets one block the
  whole bucket moves ``block_size`` steps on.
* **Finishes.** Members are also kept in buckets by the ``computed`` count
  at which they reach ``max_output_tokens``.
* **The difference from the previous batch.** Each lane remembers the batch
  it was last issued in and who joined or left since, which is what a
  :class:`~medha_sched.output.DecodeBatch` carries.

Member lists are copy-on-write: an issued batch keeps the list it was issued
with (to spell its chunks out later), and a change makes a new one.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from operator import attrgetter
from typing import NamedTuple

from medha_sched.batch_cost import Work, chunk_works
from medha_sched.cost.base import AggregateCostModel, CostModel
from medha_sched.kv_memory import KVBlockManager
from medha_sched.output import PENDING_TOKEN, BlockGrant, DecodeBatch, ScheduledChunk
from medha_sched.request import Request

_REQUEST_ID = attrgetter("request.request_id")


class Member(NamedTuple):
    """One decoding request in a lane; immutable (issued batches keep theirs).

    Attributes:
        seq: admission order: members are kept in running order by it.
        request: the request.
        base: its next decode's position is ``base + lane.issued``.
        groups: its KVP groups, in shard order.
    """

    seq: int
    request: Request
    base: int
    groups: tuple[int, ...]


class Lane:
    """Decoding requests that move together (see the module docstring)."""

    __slots__ = (
        "cleared",
        "computed",
        "const",
        "cross_at",
        "finish_at",
        "index",
        "issued",
        "joined",
        "kv_sum",
        "left",
        "members",
        "n_tail",
        "n_works",
        "parents",
        "shared",
    )

    def __init__(self, num_groups: int) -> None:
        self.issued = self.cleared = self.computed = 0
        self.members: list[Member] = []  # running order
        self.shared = False  # ``members`` is held by an issued batch: copy before changing
        self.index: dict[str, Member] = {}
        self.cross_at: dict[int, list[Member]] = {}  # lane step -> members needing a block
        self.finish_at: dict[int, list[Member]] = {}  # computed count -> members finishing
        self.n_tail = [0] * num_groups  # members whose tail shard is on the group
        self.kv_sum = [0] * num_groups  # sum of their (base - tail shard offset)
        self.n_works = [0] * num_groups  # members with any shard on the group
        self.const: list[list[int] | None] = [None] * num_groups  # non-tail features
        self.parents: list[int] = []  # batches this lane was last issued in
        self.joined: dict[str, None] = {}  # members that joined since (in order)
        self.left: list[str] = []  # parents' members that left since

    def own_members(self) -> list[Member]:
        """The member list, copied first if an issued batch still holds it."""
        if self.shared:
            self.members = list(self.members)
            self.shared = False
        return self.members


class _EveryTokenIsZero(Mapping[str, int]):
    """Sampled tokens under the simulator's convention: every request's is token 0."""

    def __getitem__(self, key: str) -> int:
        return 0

    def __contains__(self, key: object) -> bool:
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


ZERO_TOKENS: Mapping[str, int] = _EveryTokenIsZero()
"""Every request's sampled token is 0 (the simulator's; see :mod:`medha_sched.decode_run`)."""


def decode_line(model: CostModel) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``(A, B)`` with ``features(1, kv, True) == A + kv * B``, or None if not exact."""
    if not isinstance(model, AggregateCostModel) or not model.affine_decode_features:
        return None
    a = tuple(model.features(1, 0, True))
    b = tuple(y - x for x, y in zip(a, model.features(1, 1, True), strict=True))
    return a, b


class DecodeLanes:
    """Every decoding request of one scheduler, in lanes.

    Args:
        model: the cost model (decides whether lanes price in O(1)).
        memory: the KV block manager (capacities, block grants).
    """

    def __init__(self, model: CostModel, memory: KVBlockManager) -> None:
        self.memory = memory
        self.kvp = memory.num_groups
        self.limit = memory.group_limit
        self.block_size = memory.cache.block_size
        line = decode_line(model)
        self.exact = line is not None
        self._a, self._b = line if line is not None else ((), ())
        self._nontail: list[int] = []
        if line is not None:
            assert isinstance(model, AggregateCostModel)
            self._nontail = list(model.features(1, self.limit, False))
        self.ready: list[Lane] = []
        self.where: dict[str, Lane] = {}  # decoding request id -> its lane
        self._retired_parents: list[int] = []
        self._retired_left: list[str] = []

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.where

    def __len__(self) -> int:
        return len(self.where)

    # ------------------------------------------------------------ membership
    def new_lane(self) -> Lane:
        lane = Lane(self.kvp)
        self.ready.append(lane)
        return lane

    def join(self, lane: Lane, seq: int, request: Request) -> None:
        """Add a request that has just become ready to decode to a ready ``lane``."""
        rid = request.request_id
        pos = request.num_scheduled_tokens
        request._scheduled -= lane.issued
        request._stage0 -= lane.cleared
        request._computed -= lane.computed
        request._lane = lane
        member = Member(seq, request, pos - lane.issued, self.memory.groups_of(rid))
        insort(lane.own_members(), member)
        lane.index[rid] = member
        self.where[rid] = lane
        lane.joined[rid] = None
        self._file(lane, member)
        if self.exact:
            self._account(lane, member, 1)

    def leave(self, request: Request) -> None:
        """Take a request out of its lane (it finished, was preempted or aborted).

        Call before its KV is freed; its cursors become plain fields again.
        A ready lane left empty is retired (its history goes to the next batch).
        """
        lane = self._remove(request)
        if not lane.members and lane in self.ready:
            self.retire(lane)

    def retire(self, lane: Lane) -> None:
        """Take an empty lane out of the ready ones (if there); its history goes to
        the next batch."""
        if lane in self.ready:
            self.ready.remove(lane)
        self._retired_parents += lane.parents
        self._retired_left += lane.left
        lane.parents, lane.left = [], []

    def regroup(self, request: Request) -> None:
        """The request's KVP groups changed (a new shard): file it again."""
        rid = request.request_id
        lane = self.where[rid]
        seq = lane.index[rid].seq
        self._remove(request)
        self.join(lane, seq, request)

    def _remove(self, request: Request) -> Lane:
        rid = request.request_id
        lane = self.where.pop(rid)
        member = lane.index.pop(rid)
        members = lane.own_members()
        del members[bisect_left(members, member)]
        self._unfile(lane, member)
        if self.exact:
            self._account(lane, member, -1)
        request._scheduled += lane.issued
        request._stage0 += lane.cleared
        request._computed += lane.computed
        request._lane = None
        if rid in lane.joined:
            del lane.joined[rid]
        else:
            lane.left.append(rid)
        return lane

    def _file(self, lane: Lane, member: Member) -> None:
        """Put a member in its crossing and finishing buckets."""
        r = member.request
        cap = self.memory.num_tokens_capacity(r.request_id)
        insort(lane.cross_at.setdefault(cap - member.base, []), member)
        done = lane.computed + r.max_output_tokens - r.num_output_tokens
        insort(lane.finish_at.setdefault(done, []), member)

    def _unfile(self, lane: Lane, member: Member) -> None:
        r = member.request
        cap = self.memory.num_tokens_capacity(r.request_id)
        _discard(lane.cross_at, cap - member.base, member)
        done = lane.computed + r.max_output_tokens - r.num_output_tokens
        _discard(lane.finish_at, done, member)

    def _account(self, lane: Lane, member: Member, sign: int) -> None:
        """Add (``sign`` 1) or remove (-1) a member's features in the lane's sums."""
        groups, limit = member.groups, self.limit
        tail = groups[-1]
        lane.n_tail[tail] += sign
        lane.kv_sum[tail] += sign * (member.base - (len(groups) - 1) * limit)
        lane.n_works[tail] += sign
        for g in groups[:-1]:
            lane.n_works[g] += sign
            const = lane.const[g]
            if const is None:
                const = [0] * len(self._nontail)
            lane.const[g] = [c + sign * f for c, f in zip(const, self._nontail, strict=True)]

    # ------------------------------------------------------------- the step
    def gather(self) -> Lane | None:
        """The one lane holding every ready decode (merging lanes), or None."""
        ready = self.ready
        if not ready:
            return None
        if len(ready) > 1:
            ready.sort(key=lambda lane: -len(lane.members))
            for other in ready[1:]:
                self._merge(ready[0], other)
            del ready[1:]
        return ready[0]

    def _merge(self, dst: Lane, src: Lane) -> None:
        """Move every member of ready lane ``src`` into ready lane ``dst``."""
        shift = src.issued - dst.issued
        cleared, computed = src.cleared - dst.cleared, src.computed - dst.computed
        moved: dict[int, Member] = {}
        for m in src.members:
            r = m.request
            r._scheduled += shift
            r._stage0 += cleared
            r._computed += computed
            r._lane = dst
            new = moved[m.seq] = Member(m.seq, r, m.base + shift, m.groups)
            dst.index[r.request_id] = new
            self.where[r.request_id] = dst
        dst.members = sorted(dst.own_members() + list(moved.values()))
        for buckets, dst_buckets, offset in (
            (src.cross_at, dst.cross_at, -shift),
            (src.finish_at, dst.finish_at, -computed),
        ):
            for key, bucket in buckets.items():
                here = dst_buckets.setdefault(key + offset, [])
                here.extend(moved[m.seq] for m in bucket)
                here.sort()
        for g in range(self.kvp):
            dst.n_tail[g] += src.n_tail[g]
            dst.kv_sum[g] += src.kv_sum[g] + src.n_tail[g] * shift
            dst.n_works[g] += src.n_works[g]
            if src.const[g] is not None:
                base = dst.const[g] or [0] * len(self._nontail)
                dst.const[g] = [x + y for x, y in zip(base, src.const[g], strict=True)]
        dst.parents += src.parents
        dst.joined.update(src.joined)
        dst.left += src.left

    def grow_all(self, lane: Lane, crossers: list[Member]) -> list[BlockGrant] | None:
        """One block for each member crossing a block boundary now, in bulk.

        Each block goes to the tail shard's group, in running order (so the
        block ids are those one-by-one growth gives), and the crossers move
        ``block_size`` steps on in the buckets. Returns the grants, or None,
        changing nothing, when a group is short of blocks or a crosser needs
        a new shard: then :meth:`grow_each` and :meth:`settle`.
        """
        step = lane.issued
        grow = self.memory.grow_tails
        if self.kvp == 1:  # a request never outgrows its one shard (max context)
            rids = tuple(map(_REQUEST_ID, crossers))
            blocks = grow(0, rids)
            if blocks is None:
                return None
            grants: list[BlockGrant] = [(0, rids, blocks)]
        else:
            by_group: dict[int, list[str]] = {}
            for m in crossers:
                if (m.base + step) % self.limit == 0:  # its tail shard is full
                    return None
                by_group.setdefault(m.groups[-1], []).append(m.request.request_id)
            free = self.memory.num_free_blocks
            if any(free(g) < len(rids) for g, rids in by_group.items()):
                return None
            grants = []
            for g in sorted(by_group):
                rids = tuple(by_group[g])
                blocks = grow(g, rids)
                assert blocks is not None
                grants.append((g, rids, blocks))
        self._refile(lane, crossers)
        return grants

    def grow_moved(self, lane: Lane, crossers: list[Member]) -> bool:
        """:meth:`grow_all` for a caller that reads no grant (a simulator's turns),
        ``crossers`` being ``lane.cross_at[lane.issued]``, which it then drops:
        the same state as ``grow_all`` and that ``del``; False, changing
        nothing, where ``grow_all`` gives None. With one group no id tuple or
        grant is built (``KVBlockManager.grow_tails_unspelled``)."""
        if self.kvp != 1:
            if self.grow_all(lane, crossers) is None:
                return False
        elif self.memory.grow_tails_unspelled(0, map(_REQUEST_ID, crossers), len(crossers)):
            self._refile(lane, crossers)
        else:
            return False
        del lane.cross_at[lane.issued]
        return True

    def _refile(self, lane: Lane, crossers: list[Member]) -> None:
        """The crossers, grown, cross again ``block_size`` steps on."""
        key = lane.issued + self.block_size
        bucket = lane.cross_at.get(key)
        lane.cross_at[key] = crossers if bucket is None else sorted(bucket + crossers)

    def grow_each(self, lane: Lane, crossers: list[Member]) -> list[Request]:
        """Grow the crossers one by one (``ensure_capacity``); those that could not.

        The blocks stay pending in the KV manager until :meth:`settle`.
        """
        step = lane.issued
        wants = [(m.request.request_id, m.base + step + 1) for m in crossers]
        failed = set(self.memory.ensure_capacity_many(wants))
        return [m.request for m in crossers if m.request.request_id in failed]

    def settle(self, lane: Lane, crossers: list[Member], issued: int) -> list[BlockGrant]:
        """After :meth:`grow_each` (and any preemptions): file the crossers again.

        A crosser with a new shard joins again (its chunk is spelled out);
        the others among the first ``issued`` members report their new
        blocks now (the rest keep them pending until they are issued).
        """
        grants: list[BlockGrant] = []
        memory = self.memory
        for m in crossers:
            r = m.request
            rid = r.request_id
            if lane.index.get(rid) is not m:
                continue  # preempted meanwhile
            if memory.groups_of(rid) != m.groups:
                self.regroup(r)
                continue
            if bisect_left(lane.members, m) < issued:
                for g, ids in memory.pop_new_blocks(rid):
                    grants.append((g, (rid,) * len(ids), ids))
            key = memory.num_tokens_capacity(rid) - m.base
            insort(lane.cross_at.setdefault(key, []), m)
        return grants

    def split(self, lane: Lane, keep: int) -> None:
        """Move every member of ready ``lane`` after the first ``keep`` to a new ready lane."""
        rest = lane.members[keep:]
        other = self.new_lane()
        for m in rest:
            self._remove(m.request)
            self.join(other, m.seq, m.request)

    def totals(self, lane: Lane, ahead: int = 0) -> list[list[int] | None]:
        """Summed features per group of the lane's decodes ``ahead`` steps from now.

        None for a group holding none of them. Exact models only.
        """
        step = lane.issued + ahead
        a, b = self._a, self._b
        out: list[list[int] | None] = []
        for g in range(self.kvp):
            if not lane.n_works[g]:
                out.append(None)
                continue
            nt = lane.n_tail[g]
            kv = lane.kv_sum[g] + nt * step
            const = lane.const[g]
            if const is None:
                out.append([nt * x + kv * y for x, y in zip(a, b, strict=True)])
            else:
                out.append([nt * x + kv * y + c for x, y, c in zip(a, b, const, strict=True)])
        return out

    def one_group_times(
        self,
        lane: Lane,
        group_time: Callable[[Sequence[float]], float],
        steps: int,
        budget: float = float("inf"),
        *,
        varying: Callable[[Sequence[float], int, int], Callable[[float, float], float] | None]
        | None = None,
    ) -> list[float]:
        """``group_time(totals(lane, j)[0])`` for ``j`` in ``range(steps)``.

        The same integer totals as :meth:`totals` (one group holding decodes),
        without a call and a list of groups per step. Stops early once the
        times add up to ``budget`` seconds (that last one included).
        ``varying``: the model's ``group_time_varying`` (see
        :class:`~medha_sched.cost.base.AggregateCostModel`), used when only two
        totals move with the step and it gives a function of them.
        """
        a, b = self._a, self._b
        nt, kv_sum, const = lane.n_tail[0], lane.kv_sum[0], lane.const[0]
        if const is None:  # integer totals: adding zeros changes none of them
            const = [0] * len(a)
        times = []
        spent = 0.0
        vary = [i for i, y in enumerate(b) if y]
        if len(vary) == 2:
            # Only two totals move with the step (KV read and attended pairs
            # for the roofline): one row, those two entries rewritten in place
            # by the same expressions (``nt * x`` is the same product each step).
            i, j = vary
            ai, bi, ci, aj, bj, cj = nt * a[i], b[i], const[i], nt * a[j], b[j], const[j]
            kv = kv_sum + nt * lane.issued
            row = [nt * x + kv * y + c for x, y, c in zip(a, b, const)]  # noqa: B905
            time_of = None if varying is None else varying(row, i, j)
            if time_of is not None:  # the other totals' terms computed once
                series = getattr(time_of, "series", None)
                if series is not None:  # the loop below in one call (the roofline's)
                    return series(ai, bi, ci, aj, bj, cj, kv_sum, nt, lane.issued, steps, budget)
                for step in range(lane.issued, lane.issued + steps):
                    kv = kv_sum + nt * step
                    t = time_of(ai + kv * bi + ci, aj + kv * bj + cj)
                    times.append(t)
                    spent += t
                    if spent >= budget:
                        break
                return times
            for step in range(lane.issued, lane.issued + steps):
                kv = kv_sum + nt * step
                row[i] = ai + kv * bi + ci
                row[j] = aj + kv * bj + cj
                t = group_time(row)
                times.append(t)
                spent += t
                if spent >= budget:
                    break
            return times
        for step in range(lane.issued, lane.issued + steps):
            kv = kv_sum + nt * step
            t = group_time([nt * x + kv * y + c for x, y, c in zip(a, b, const)])  # noqa: B905
            times.append(t)
            spent += t
            if spent >= budget:
                break
        return times

    def works(self, lane: Lane, ahead: int = 0) -> list[Work]:
        """Works of the lane's decodes in running order (for models priced one by one)."""
        step, limit = lane.issued + ahead, self.limit
        works: list[Work] = []
        for m in lane.members:
            pos = m.base + step
            if pos < limit:
                works.append((m.groups[0], 1, pos, True))
            else:
                works.extend(chunk_works(m.groups, pos, 1, limit))
        return works

    def issue(self, lane: Lane | None, batch_id: int, grants: list[BlockGrant]) -> DecodeBatch:
        """Issue every member of ready ``lane`` in batch ``batch_id``; its compact form.

        ``grants`` are this step's blocks for members crossing a block.
        """
        parents = self._retired_parents
        left = self._retired_left
        self._retired_parents, self._retired_left = [], []
        if lane is None:
            if not parents:
                return DecodeBatch()
            return DecodeBatch(0, tuple(parents), tuple(left))
        steps, members = lane.issued, lane.members
        lane.shared = True
        new: dict[str, ScheduledChunk] = {}
        if lane.joined:
            pop, limit = self.memory.pop_new_blocks, self.limit
            granted = _grants_by_id(grants)
            for rid in lane.joined:
                m = lane.index[rid]
                new[rid] = _chunk(m, steps, limit, pop(rid) + granted.get(rid, ()))
            if granted:
                grants = _without(grants, new)
        batch = DecodeBatch(
            len(members),
            tuple(lane.parents + parents),
            tuple(lane.left + left),
            tuple(new.values()),
            tuple(grants),
            partial(_spell, members, steps, self.limit, grants, new),
        )
        lane.issued = steps + 1
        lane.parents = [batch_id]
        lane.joined = {}
        lane.left = []
        self.ready.remove(lane)
        return batch

    def issue_unspelled(self, lane: Lane | None, batch_id: int) -> None:
        """:meth:`issue` for a caller that never reads the batch (a simulator):
        the same state afterwards (the joined members' new blocks are taken),
        no :class:`~medha_sched.output.DecodeBatch` built."""
        # (these lists and the lane's never leave this class, so an empty one is
        # kept rather than replaced: no allocation in the common turn)
        if self._retired_parents or self._retired_left:
            self._retired_parents, self._retired_left = [], []
        if lane is None:
            return
        if lane.joined:
            drop = self.memory.drop_new_blocks
            for rid in lane.joined:
                drop(rid)
            lane.joined = {}
        lane.shared = True
        lane.issued += 1
        lane.parents = [batch_id]
        if lane.left:
            lane.left = []
        self.ready.remove(lane)

    def cleared(self, lane: Lane) -> None:
        """The lane's batch cleared pipeline stage 0."""
        lane.cleared += 1

    def returned(self, lane: Lane, tokens: Mapping[str, int], skip: set[str]) -> list[Member]:
        """The lane's batch left the pipeline: one token for each member not in ``skip``.

        Members in ``skip`` (aborted) get no token and must leave next. The
        lane is ready again. Returns, in running order, the members that
        reached ``max_output_tokens`` (still members). ``tokens`` must hold
        every other member's token (the caller checks).
        """
        if skip:
            for rid in skip:
                self._unfile(lane, lane.index[rid])
            lane.computed += 1
            for m in lane.members:
                r = m.request
                if r.request_id not in skip:
                    r.output_token_ids.append(tokens[r.request_id])
        elif tokens is ZERO_TOKENS:  # no lookup per member
            lane.computed += 1
            for m in lane.members:
                m.request.output_token_ids.append(0)
        else:
            lane.computed += 1
            for m in lane.members:
                r = m.request
                r.output_token_ids.append(tokens[r.request_id])
        self.ready.append(lane)
        return lane.finish_at.pop(lane.computed, [])

    def returned_fresh(
        self,
        lane: Lane,
        tokens: Mapping[str, int],
        skip: set[str],
        fresh: Mapping[str, Member],
    ) -> list[Member]:
        """:meth:`returned` for a lane some of whose members (``fresh``: request id to
        its member when it joined) joined after this batch was issued (decodes issued
        ahead): they get no token, their cursors and finishing step stay where they
        were. Members of ``fresh`` that left since are ignored.
        """
        keep = [m for rid, m in fresh.items() if lane.index.get(rid) is m and rid not in skip]
        # an aborted fresh member leaves with the count of what it computed
        gone = [m for rid, m in fresh.items() if lane.index.get(rid) is m and rid in skip]
        for rid in skip:
            self._unfile(lane, lane.index[rid])
        for m in keep:
            r = m.request
            _discard(lane.finish_at, lane.computed + r.max_output_tokens - r.num_output_tokens, m)
        lane.computed += 1
        ids = {m.request.request_id for m in keep}
        for m in lane.members:
            r = m.request
            rid = r.request_id
            if rid not in skip and rid not in ids:
                r.output_token_ids.append(tokens[rid])
        for m in gone:
            m.request._computed -= 1  # the lane's count moved on without it
        for m in keep:
            r = m.request
            r._computed -= 1  # the lane's count moved on without it
            done = lane.computed + r.max_output_tokens - r.num_output_tokens
            insort(lane.finish_at.setdefault(done, []), m)
        self.ready.append(lane)
        return lane.finish_at.pop(lane.computed, [])

    def advance(self, lane: Lane, steps: int, token_id: int) -> None:
        """``steps`` decode iterations of ready ``lane`` at once (a decode run).

        The caller grew the KV first. Every member gets ``steps`` tokens and
        is filed again; the next batch spells every member out (the executor
        never saw the run's batches).
        """
        lane.issued += steps
        lane.cleared += steps
        lane.computed += steps
        lane.cross_at, lane.finish_at = {}, {}
        for m in lane.members:
            m.request.output_token_ids.extend([token_id] * steps)
            self._file(lane, m)
            rid = m.request.request_id
            if rid not in lane.joined:
                lane.left.append(rid)
                lane.joined[rid] = None


def _discard(buckets: dict[int, list[Member]], key: int, member: Member) -> None:
    """Remove ``member`` from the sorted bucket ``key`` if it is there."""
    bucket = buckets.get(key)
    if bucket is None:
        return
    i = bisect_left(bucket, member)
    if i < len(bucket) and bucket[i] is member:
        del bucket[i]
        if not bucket:
            del buckets[key]


def _without(grants: list[BlockGrant], ids: Mapping[str, object]) -> list[BlockGrant]:
    """``grants`` less those to ``ids``."""
    out = []
    for group, rids, blocks in grants:
        kept = [(r, b) for r, b in zip(rids, blocks, strict=True) if r not in ids]
        if kept:
            out.append((group, tuple(r for r, _ in kept), tuple(b for _, b in kept)))
    return out


def _grants_by_id(grants: list[BlockGrant]) -> dict[str, tuple[tuple[int, tuple[int, ...]], ...]]:
    out: dict[str, tuple[tuple[int, tuple[int, ...]], ...]] = {}
    for group, rids, ids in grants:
        for rid, block in zip(rids, ids, strict=True):
            out[rid] = (*out.get(rid, ()), (group, (block,)))
    return out


def _chunk(
    member: Member, steps: int, limit: int, blocks: tuple[tuple[int, tuple[int, ...]], ...]
) -> ScheduledChunk:
    r = member.request
    start = member.base + steps
    groups = member.groups[: start // limit + 1]
    ids = r.token_ids(start, start + 1)
    if not ids and r.prompt_token_ids is not None:
        ids = (PENDING_TOKEN,)  # issued ahead: the batch in flight samples it
    return ScheduledChunk(r.request_id, start, 1, groups, blocks, ids, True)


def _spell(
    members: list[Member],
    steps: int,
    limit: int,
    grants: list[BlockGrant],
    new: dict[str, ScheduledChunk],
) -> tuple[ScheduledChunk, ...]:
    """Every decode chunk of an issued lane, in running order."""
    granted = _grants_by_id(grants)
    out = []
    for m in members:
        rid = m.request.request_id
        chunk = new.get(rid)
        if chunk is None:
            chunk = _chunk(m, steps, limit, granted.get(rid, ()))
        out.append(chunk)
    return tuple(out)
