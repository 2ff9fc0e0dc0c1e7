"""One rank's sampled token ids, sent to every rank of the world.

With async scheduling (a decode issued before its previous token is back)
every rank that embeds tokens must learn the token the previous batch sampled,
and only one rank samples. :class:`TokenBroadcast` sends that rank's ids to
every other rank: one ``int64`` tensor (the count, then the ids) on a gloo group of the whole world
(made for it, so the ids never share a queue with the model's collectives and
stay on the host whatever the model's device). Failures and timeouts raise
:class:`~medha_parallel.errors.CommunicationError` naming ``world`` and
``broadcast_tokens``.

Where every rank runs on this host (Linux on x86-64) the ids go through shared
memory instead (:class:`_ShmTokens`): a gloo broadcast crosses the TCP stack
and wakes a transport thread on every rank, 0.13-1.05 ms of wall per step in a
``kvp=2`` decode on ``tiny`` at 32K (``docs/benchmarks.md``), against a copy
and a flag here. The sender never waits for the receivers (it only checks
that they read the buffer it reuses, two broadcasts back).

:class:`TokenReturn` is the one-way path with stream pipelining: the last
stage's sampling rank sends each batch's ids to the ranks of stage 0 only,
through a ring of shared-memory buffers; a receiver can look for a message
without blocking (stage 0 waits only when a plan holds a decode whose token is
pending).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import struct
from collections.abc import Sequence

import torch
import torch.distributed as dist

from medha_parallel import shm
from medha_parallel.errors import CommunicationError, named_comm
from medha_parallel.state import ParallelState

#: ids one shared-memory broadcast carries at most; a longer one goes through gloo
SHM_MAX_IDS = 4096
#: bytes of one shared-memory buffer: the count, then up to SHM_MAX_IDS ids (int64)
_SLOT = 8 * (1 + SHM_MAX_IDS)


def _check_count(rank: int, count: int, src: int, sent: int) -> None:
    if sent != count:
        raise CommunicationError(
            f"broadcast_tokens on the world group failed: rank {rank} expects "
            f"{count} token ids, rank {src} sent {sent}"
        )


#: messages a :class:`TokenReturn` holds that its receivers did not read yet, at most
RETURN_SLOTS = 8


def return_slots(spp: int) -> int:
    """Buffers of the :class:`TokenReturn` ring an ``spp``-stage pipeline uses: at most
    that many batches may be in flight (unread messages never outnumber them)."""
    return max(RETURN_SLOTS, 2 * spp)


class _ShmTokens:
    """One rank's ids to the other ranks of a group on this host, through shared memory.

    The mapping holds one int32 flag per rank (64 bytes apart; the sender's
    counts its broadcasts, a receiver's the broadcasts it read) and two
    buffers of ``1 + SHM_MAX_IDS`` little-endian int64s (the count, then the ids). Broadcast ``s``
    uses buffer ``s % 2``: the sender waits until every receiver read
    broadcast ``s - 2`` (always so when the ranks run steps in lockstep),
    writes the ids, stores ``s`` in its flag and wakes waiters; a receiver
    waits until the sender's flag is ``>= s``, copies the ids out and stores
    ``s`` in its own flag.
    """

    def __init__(self, mm: mmap.mmap, *, size: int, index: int, src: int, timeout_s: float):
        self.size, self.index, self.src, self.timeout_s = size, index, src, timeout_s
        self._mm = mm
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        self._flags = [ctypes.c_int32.from_buffer(mm, r * shm._FLAG_STRIDE) for r in range(size)]
        self._data = size * shm._FLAG_STRIDE
        self._seq = 0
        self._libc = ctypes.CDLL(None, use_errno=True)

    @classmethod
    def create(
        cls, group: dist.ProcessGroup | None, *, src: int, timeout_s: float
    ) -> _ShmTokens | None:
        """Map the buffer on every rank of ``group`` (collective); None (on every rank)
        unless all of them run on this host on a supported platform."""
        size, index = dist.get_world_size(group), dist.get_rank(group)
        nbytes = size * shm._FLAG_STRIDE + 2 * _SLOT
        mm = shm.map_group_buffer(group, nbytes, prefix="medha-tokens")
        if mm is None:
            return None
        return cls(mm, size=size, index=index, src=src, timeout_s=timeout_s)

    def broadcast(self, ids: Sequence[int] | None, count: int) -> list[int]:
        """The sender's ``count`` ids (``0 < count <= SHM_MAX_IDS``) on every rank."""
        self._seq += 1
        seq = self._seq
        offset = self._data + (seq % 2) * _SLOT
        if self.index == self.src:
            assert ids is not None
            if seq > 2:  # buffer seq % 2 was broadcast seq - 2's: every receiver read it
                for r in range(self.size):
                    if r != self.src:
                        self._wait(r, seq - 2)
            struct.pack_into(f"<{count + 1}q", self._mm, offset, count, *ids)
            self._flags[self.src].value = seq
            shm._wake(self._libc, self._base + self.src * shm._FLAG_STRIDE, self.size)
            return list(ids)
        self._wait(self.src, seq)
        (sent,) = struct.unpack_from("<q", self._mm, offset)
        got = list(struct.unpack_from(f"<{min(count, sent)}q", self._mm, offset + 8))
        self._flags[self.index].value = seq  # read: the sender may reuse this buffer
        shm._wake(self._libc, self._base + self.index * shm._FLAG_STRIDE, 1)
        _check_count(self.index, count, self.src, sent)  # group rank = global rank
        return got

    def _wait(self, rank: int, seq: int) -> None:
        addr = self._base + rank * shm._FLAG_STRIDE
        flag = self._flags[rank]
        if not shm._wait_flag(self._libc, flag, addr, seq, self.timeout_s, shm._GATHER_SPIN_S):
            raise CommunicationError(
                f"broadcast_tokens on the world group failed: rank {rank} of the "
                f"shared-memory group did not arrive within {self.timeout_s:.0f} s"
            )

    def close(self) -> None:
        """Unmap the buffer (idempotent)."""
        self._flags.clear()
        with contextlib.suppress(BufferError, ValueError):
            self._mm.close()


class TokenBroadcast:
    """Token ids from rank ``src`` to every rank of ``state``'s world.

    Building one is collective (it creates a process group): every rank
    builds it, at the same point of its start-up. With a world of one rank
    nothing is created and :meth:`broadcast` hands the ids back.

    Args:
        state: this rank's parallel state (its layout gives the world size).
        src: the global rank whose ids are sent (``0 <= src < world size``).
        shared_memory: send up to :data:`SHM_MAX_IDS` ids through shared
            memory where every rank runs on this host on a supported platform
            (None, the default, or True; decided together by all ranks);
            False: always gloo. Every rank must pass the same value.
        timeout_s: how long a shared-memory broadcast waits for the sender
            before it raises :class:`CommunicationError` (None: the state's
            timeout, which also bounds the gloo groups).

    Attributes:
        rank: this rank's global rank.
        src: the sending rank.
        uses_shared_memory: whether broadcasts of up to :data:`SHM_MAX_IDS`
            ids go through shared memory.
    """

    def __init__(
        self,
        state: ParallelState,
        *,
        src: int,
        shared_memory: bool | None = None,
        timeout_s: float | None = None,
    ) -> None:
        world = state.layout.world_size
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < world:
            raise ValueError(f"src must be a rank in [0, {world}), got {src!r}")
        if timeout_s is None:
            timeout_s = state.timeout.total_seconds()
        elif (
            isinstance(timeout_s, bool)
            or not isinstance(timeout_s, int | float)
            or not (0 < timeout_s < float("inf"))
        ):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        self.rank, self.src, self.world_size = state.rank, src, world
        self.group: dist.ProcessGroup | None = None
        if world > 1:
            with named_comm("world", "new_group"):
                self.group = dist.new_group(
                    list(range(world)), timeout=state.timeout, backend="gloo"
                )
        self._shm: _ShmTokens | None = None
        self._closed = False
        # None: every rank tries (creating the mapping is collective, and it
        # finds None on every rank unless all are on this host and supported)
        if world > 1 and shared_memory is not False:
            with named_comm("world", "broadcast_tokens"):
                self._shm = _ShmTokens.create(self.group, src=src, timeout_s=float(timeout_s))
        self.uses_shared_memory = self._shm is not None

    def __repr__(self) -> str:
        return f"TokenBroadcast(rank={self.rank}, src={self.src}, world_size={self.world_size})"

    def broadcast(self, ids: Sequence[int] | None, count: int) -> list[int]:
        """Rank ``src``'s ``count`` token ids, on every rank.

        Args:
            ids: on rank ``src``, ``count`` ints; ignored elsewhere (pass None).
            count: how many ids are sent; the same on every rank (0: no
                communication, ``[]``).

        Returns:
            The ids, as a list of ``count`` ints, the same on every rank.

        The count travels ahead of the ids: a rank that expects another count
        than the sender's gets a :class:`CommunicationError` saying both.
        """
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"count must be an int >= 0, got {count!r}")
        if self._closed:
            raise ValueError("broadcast after close()")
        if self.rank == self.src:
            if ids is None or len(ids) != count:
                got = None if ids is None else len(ids)
                raise ValueError(f"rank {self.src} sends {count} token ids, got {got}")
            if self.group is None or count == 0:
                return list(ids)
            if self._shm is not None and count <= SHM_MAX_IDS:
                return self._shm.broadcast(ids, count)
            buf = torch.tensor([count, *ids], dtype=torch.int64)
        else:
            if count == 0:
                return []
            if self._shm is not None and count <= SHM_MAX_IDS:
                return self._shm.broadcast(None, count)
            buf = torch.empty(count + 1, dtype=torch.int64)
        with named_comm("world", "broadcast_tokens"):
            dist.broadcast(buf, src=self.src, group=self.group)
        sent, *got = buf.tolist()
        _check_count(self.rank, count, self.src, sent)
        return got

    def close(self) -> None:
        """Unmap the shared-memory buffer, if any (idempotent); no broadcast follows
        (ranks that closed and ranks that did not could pick different transports)."""
        self._closed = True
        if self._shm is not None:
            self._shm.close()
            self._shm = None
            self.uses_shared_memory = False


class TokenReturn:
    """Token ids from one rank (``src``) to a set of ranks (``dst``), one message per
    call, in order, through shared memory on this host; the receivers may read
    without blocking.

    With stream pipelining and async scheduling the last stage's sampling rank
    sends each batch's sampled ids straight to every rank of stage 0, which
    needs them for the next decode issued ahead (its token id is pending);
    the driver's round trip is no longer on that path.

    Building one is collective over the whole world (it creates a process group
    of ``src`` and ``dst``; every rank calls it, at the same point of its
    start-up); ranks outside ``src`` and ``dst`` get an inactive channel.

    The mapping holds one int32 flag per member (64 bytes apart: the
    sender's counts its messages, a receiver's the messages it read) and
    ``slots`` buffers of ``1 + max_ids`` little-endian int64s (the
    count, then the ids). Message ``s`` (1-based) goes to buffer
    ``(s - 1) % slots``; the sender first waits until every receiver
    read message ``s - slots``; a receiver reads message ``s`` once the
    sender's flag is ``>= s`` and stores ``s`` in its own flag.

    Args:
        state: this rank's parallel state.
        src: the sending global rank.
        dst: the receiving global ranks (not ``src``; at least one).
        max_ids: the most ids one message carries.
        slots: messages sent and not yet read, at most (the sender waits for
            the oldest beyond that).

    Raises:
        CommunicationError: (on every member) when the members do not all run on
            this host on a supported platform (Linux on x86-64): there is no
            other transport.

    Attributes:
        rank: this rank's global rank.
        src, dst: the sending and receiving global ranks.
        is_sender, is_receiver: this rank's part.
        sent: messages this rank sent (sender) or read (receiver) so far.
    """

    def __init__(
        self,
        state: ParallelState,
        *,
        src: int,
        dst: Sequence[int],
        max_ids: int = SHM_MAX_IDS,
        slots: int = RETURN_SLOTS,
    ) -> None:
        world = state.layout.world_size
        dst = tuple(dst)
        for r in (src, *dst):
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world:
                raise ValueError(f"src and dst must be ranks in [0, {world}), got {r!r}")
        if not dst or src in dst or len(set(dst)) != len(dst):
            raise ValueError(f"dst must be distinct ranks other than src={src}, got {dst!r}")
        if isinstance(max_ids, bool) or not isinstance(max_ids, int) or max_ids < 1:
            raise ValueError(f"max_ids must be an int >= 1, got {max_ids!r}")
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be an int >= 1, got {slots!r}")
        self.slots = slots
        self.rank, self.src, self.dst, self.max_ids = state.rank, src, dst, max_ids
        self.is_sender, self.is_receiver = state.rank == src, state.rank in dst
        self.timeout_s = state.timeout.total_seconds()
        self.sent = 0
        members = sorted((src, *dst))
        with named_comm("world", "new_group"):
            group = dist.new_group(members, timeout=state.timeout, backend="gloo")
        self._mm: mmap.mmap | None = None
        if not (self.is_sender or self.is_receiver):
            return
        self._slot = shm._lines(8 * (1 + max_ids))
        nbytes = len(members) * shm._FLAG_STRIDE + slots * self._slot
        with named_comm("world", "return_tokens"):
            mm = shm.map_group_buffer(group, nbytes, prefix="medha-return")
        if mm is None:
            raise CommunicationError(
                f"return_tokens: ranks {members} cannot share memory (they must all run on "
                "one host, Linux on x86-64); there is no other transport"
            )
        self._mm = mm
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        self._flags = [
            ctypes.c_int32.from_buffer(mm, i * shm._FLAG_STRIDE) for i in range(len(members))
        ]
        self._data = len(members) * shm._FLAG_STRIDE
        self._index = members.index(state.rank)
        self._src_index = members.index(src)
        self._receivers = [members.index(r) for r in dst]
        self._libc = ctypes.CDLL(None, use_errno=True)

    def __repr__(self) -> str:
        return f"TokenReturn(rank={self.rank}, src={self.src}, dst={list(self.dst)})"

    def _offset(self, seq: int) -> int:
        return self._data + ((seq - 1) % self.slots) * self._slot

    def send(self, ids: Sequence[int]) -> None:
        """The sender's next message: ``ids`` (at most ``max_ids``; may be empty).
        Waits only while the oldest buffer is unread (``slots`` back)."""
        if not self.is_sender or self._mm is None:
            raise ValueError(f"rank {self.rank} is not the sender of {self!r} (or it is closed)")
        count = len(ids)
        if count > self.max_ids:
            raise ValueError(f"a message carries at most {self.max_ids} token ids, got {count}")
        seq = self.sent + 1
        if seq > self.slots:
            for i in self._receivers:
                self._wait(i, seq - self.slots)
        struct.pack_into(f"<{count + 1}q", self._mm, self._offset(seq), count, *ids)
        self.sent = seq
        self._flags[self._index].value = seq
        shm._wake(self._libc, self._base + self._index * shm._FLAG_STRIDE, len(self._receivers))

    def arrived(self) -> bool:
        """Receiver: whether the next message is there (never blocks)."""
        if not self.is_receiver or self._mm is None:
            raise ValueError(f"rank {self.rank} is not a receiver of {self!r} (or it is closed)")
        return shm._reached(self._flags[self._src_index].value, self.sent + 1)

    def recv(self, count: int) -> list[int]:
        """Receiver: the next message (blocking until it arrives), which must hold
        ``count`` ids (a :class:`CommunicationError` says both counts otherwise)."""
        if not self.is_receiver or self._mm is None:
            raise ValueError(f"rank {self.rank} is not a receiver of {self!r} (or it is closed)")
        seq = self.sent + 1
        self._wait(self._src_index, seq, shm._PIPE_SPIN_S)
        offset = self._offset(seq)
        (sent,) = struct.unpack_from("<q", self._mm, offset)
        got = list(struct.unpack_from(f"<{min(count, sent)}q", self._mm, offset + 8))
        self.sent = seq
        self._flags[self._index].value = seq  # read: the sender may reuse the buffer
        shm._wake(self._libc, self._base + self._index * shm._FLAG_STRIDE, 1)
        if sent != count:
            raise CommunicationError(
                f"return_tokens failed: rank {self.rank} expects {count} token ids in "
                f"message {seq}, rank {self.src} sent {sent}"
            )
        return got

    def _wait(self, index: int, seq: int, spin_s: float | None = None) -> None:
        flag = self._flags[index]
        addr = self._base + index * shm._FLAG_STRIDE
        if not shm._wait_flag(self._libc, flag, addr, seq, self.timeout_s, spin_s):
            who = self.src if index == self._src_index else "a receiver"
            raise CommunicationError(
                f"return_tokens failed: rank {who} did not reach message {seq} of the "
                f"shared-memory channel within {self.timeout_s:.0f} s"
            )

    def close(self) -> None:
        """Unmap the buffer (idempotent); no message follows."""
        self._flags = []
        if self._mm is not None:
            with contextlib.suppress(BufferError, ValueError):
                self._mm.close()
            self._mm = None
