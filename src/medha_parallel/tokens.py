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

    Attributes:
        rank: this rank's global rank.
        src: the sending rank.
        uses_shared_memory: whether broadcasts of up to :data:`SHM_MAX_IDS`
            ids go through shared memory.
    """

    def __init__(
        self, state: ParallelState, *, src: int, shared_memory: bool | None = None
    ) -> None:
        world = state.layout.world_size
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < world:
            raise ValueError(f"src must be a rank in [0, {world}), got {src!r}")
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
                self._shm = _ShmTokens.create(
                    self.group, src=src, timeout_s=state.timeout.total_seconds()
                )
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
