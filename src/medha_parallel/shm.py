"""All-gather through shared memory for the CPU ranks of one process group on one host.

A gloo collective crosses the TCP stack and wakes a transport thread and then
the caller on every rank. For the small states a KVP decode merges, that
latency is the whole cost, and on a busy machine each wake-up waits for a
core: on the 2-core development machine under load, a 272-byte gloo
all-gather between two processes took 0.7 ms (median) against 0.05 ms for
this exchange (``docs/benchmarks.md``). vLLM's and DeepSpeed's CPU backends
use shared memory for the same reason.

Protocol (Linux on x86-64: futexes, and total store order, so a store to a
flag is seen after the stores to the data before it):

- group rank 0 creates a file in ``/dev/shm``, sends its path to the group
  over the process group, every rank maps it, then rank 0 unlinks it (the
  mappings keep it alive; nothing is left behind if a rank dies);
- the file holds one int32 sequence flag per rank (64 bytes apart; next to
  it, in the same line, the rank's int32 *sleeping* word) and two buffers of
  ``n`` slots of ``slot_bytes``;
- all-gather number ``s``: each rank copies its bytes to its slot of buffer
  ``s % 2``, stores ``s`` in its flag and wakes waiters (a futex wake, made
  only if a peer's sleeping word is set: a decode's merges almost never find
  one, and the syscall was a third of a merge's cost); then waits until every
  flag is ``>= s`` (a short spin yielding the core, then futex waits with the
  sleeping word set) and copies the ``n`` slots out. Total store order lets a
  rank's load of a peer's sleeping word pass its own store to its flag, so a
  wake can be missed when both happen at once: a sleeper then wakes at the
  end of its futex slice (:data:`_GATHER_SLICE_S`, 1 ms), rechecks, and goes on;
- two buffers suffice: a rank writes buffer ``s % 2`` again at ``s + 2``,
  after every peer stored ``s + 1``, which each does only after reading ``s``;
- a rank that drops exchange ``s``'s result may only publish its part
  (:meth:`ShmAllGather.publish`): its next write (``s + 1``) then first waits
  for every peer to store ``s`` (so each read ``s - 1``, whose buffer it rewrites).

A wait longer than the group's timeout raises
:class:`~medha_parallel.errors.CommunicationError`.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import os
import platform
import socket
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from medha_parallel.errors import CommunicationError

_FLAG_STRIDE = 64  # bytes between two ranks' flags (one cache line each)
_SPINS = 64  # sched_yield rounds before a futex wait (ShmPipe)
#: ShmAllGather: how long a waiter keeps yielding its core before a futex wait. A futex
#: sleep and wake-up costs ~0.1 ms of wall on a virtual machine, more than the usual gap
#: between two KVP ranks reaching the same merge; 64 rounds of sched_yield last ~20 us.
#: While other processes are runnable each yield hands them the core (no CPU burned).
_GATHER_SPIN_S = 300e-6
#: ShmPipe.peek_buffer: how long the receiving stage keeps yielding its core before a futex
#: wait. It usually waits one stage's decode share (~1 ms on ``tiny``); a futex sleep
#: adds its wake-up (~0.1 ms of wall, on the pipeline's critical path) and makes the
#: sender's wake a context switch. While other processes are runnable each yield hands
#: them the core; a longer wait (a prefill chunk) still sleeps.
_PIPE_SPIN_S = 2e-3
_FUTEX_SLICE_S = 0.05  # a futex wait's bound, so deadlines are checked
#: ShmAllGather: a futex wait's bound, the longest a missed wake delays a sleeper
_GATHER_SLICE_S = 1e-3
_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def supported() -> bool:
    """Whether this platform has the futexes and store order the protocol needs."""
    return sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")


class ShmAllGather:
    """All-gather among the ranks of ``group``, all on this host, through shared memory.

    Build it with :meth:`create` (a collective over ``group``).

    Attributes:
        size: ranks in the group.
        index: this rank's index in the group.
        slot_bytes: the largest message :meth:`all_gather` takes.
    """

    def __init__(
        self, mm: mmap.mmap, *, size: int, index: int, slot_bytes: int, timeout_s: float
    ) -> None:
        self.size, self.index, self.slot_bytes = size, index, slot_bytes
        self.timeout_s = timeout_s
        self._mm = mm
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        self._flags = [ctypes.c_int32.from_buffer(mm, r * _FLAG_STRIDE) for r in range(size)]
        #: set by a rank while it sleeps (futex) waiting for a peer; written by it alone
        self._sleeping = [ctypes.c_int32.from_buffer(mm, r * _FLAG_STRIDE + 4) for r in range(size)]
        self._peers = [r for r in range(size) if r != index]
        data = torch.frombuffer(mm, dtype=torch.uint8, offset=size * _FLAG_STRIDE)
        self._flat = data[: 2 * size * slot_bytes].view(2, size * slot_bytes)
        self._buffers = self._flat.view(2, size, slot_bytes)
        self._seq = 0
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._own_flag = ctypes.c_void_p(self._base + index * _FLAG_STRIDE)
        self._cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        #: the last exchange :meth:`publish` made without waiting for the peers (0: none):
        #: the next write waits for them to reach it (:meth:`_settle`); and its op's name
        self._owed, self._owed_op = 0, ""

    def __repr__(self) -> str:
        return f"ShmAllGather(index={self.index}, size={self.size}, slot_bytes={self.slot_bytes})"

    @classmethod
    def create(
        cls,
        group: dist.ProcessGroup | None,
        *,
        slot_bytes: int,
        timeout_s: float,
    ) -> ShmAllGather | None:
        """Map one shared buffer for ``group``; None (on every rank) where it cannot be used.

        Collective over ``group``: every rank must call it. It returns None on
        every rank unless all of them run on this host on a supported platform.
        """
        size, index = dist.get_world_size(group), dist.get_rank(group)
        nbytes = size * _FLAG_STRIDE + 2 * size * slot_bytes
        mm = map_group_buffer(group, nbytes, prefix="medha-kvp")
        if mm is None:
            return None
        return cls(mm, size=size, index=index, slot_bytes=slot_bytes, timeout_s=timeout_s)

    def fits(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> bool:
        """Whether a tensor of this shape and dtype fits a slot."""
        return math.prod(shape) * dtype.itemsize <= self.slot_bytes

    def slot(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """This rank's slot of the next exchange, to fill before :meth:`gather`.

        Args:
            shape, dtype: the message, the same on every rank (see :meth:`fits`).

        Returns:
            A ``shape`` tensor of ``dtype`` over the shared buffer.
        """
        if self._owed:
            self._settle()
        return self._views(tuple(shape), dtype, self._seq + 1)[self.index]

    def next_buffer(self) -> torch.Tensor:
        """The whole buffer of the next exchange, ``[size * slot_bytes]`` uint8.

        For layouts other than :meth:`slot`'s (rank-major): each rank writes
        only bytes no other rank writes, then calls :meth:`exchange`; every
        rank then reads every rank's bytes until the next-but-one exchange.
        """
        if self._owed:
            self._settle()
        return self._flat[(self._seq + 1) % 2]

    def next_parity(self) -> int:
        """Which of the two buffers (:meth:`buffer`) the next exchange uses (to write
        this rank's bytes to it: after a :meth:`publish`, once the peers reached it)."""
        if self._owed:
            self._settle()
        return (self._seq + 1) % 2

    def buffer(self, parity: int) -> torch.Tensor:
        """Exchange buffer ``parity`` (0 or 1), ``[size * slot_bytes]`` uint8: exchanges
        alternate between the two (:meth:`next_buffer` is ``buffer(next_parity())``)."""
        return self._flat[parity]

    def exchange(self, op: str) -> None:
        """Publish what this rank wrote to :meth:`next_buffer` and wait for every rank."""
        self._wait_peers(self._post(), op)

    def publish(self, op: str) -> None:
        """Publish what this rank wrote to the next exchange's buffer, as :meth:`exchange`
        does, without waiting for the others: for an exchange whose result this rank does
        not read (a KVP merge whose output this rank drops). The peers' :meth:`exchange`
        of it completes as usual; this rank's next write (:meth:`slot`,
        :meth:`next_buffer`, :meth:`next_parity`, a :meth:`merger` call) first waits for
        every peer to reach it (:meth:`_settle`), so that no buffer is written while a
        peer may still read it."""
        if self._owed:
            self._settle()
        self._owed, self._owed_op = self._post(), op

    def _post(self) -> int:
        """Store this rank's next exchange number in its flag and wake any peer that
        sleeps waiting for it; returns that number."""
        self._seq += 1
        seq = self._seq
        self._flags[self.index].value = seq
        sleeping = self._sleeping
        for r in self._peers:
            if sleeping[r].value:
                self._libc.syscall(_SYS_FUTEX, self._own_flag, _FUTEX_WAKE, self.size, None)
                break
        return seq

    def _settle(self) -> None:
        """Wait for every peer to reach the exchange :meth:`publish` did not wait for:
        a peer there has read the buffer the next exchange writes (it read exchange
        ``s - 1`` before it published ``s``)."""
        seq, self._owed = self._owed, 0
        self._wait_peers(seq, self._owed_op)

    def _wait_peers(self, seq: int, op: str) -> None:
        """Wait for every peer to reach exchange ``seq`` (``op`` names it in a timeout)."""
        flags = self._flags
        for r in self._peers:
            if not _reached(flags[r].value, seq):
                self._wait(r, seq, op)

    def merger(
        self,
        views: tuple[tuple[torch.Tensor, torch.Tensor], ...],
        publish_merge: Callable[..., tuple[torch.Tensor, torch.Tensor] | None],
        merge: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        op: str,
    ) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """An exchange and merge of one state per rank as one native call, for a KVP
        decode's later layers (each runs cold, after its attention streamed the
        layer's KV shard through the caches: one call instead of the copies, the
        exchange's Python frames and the merge).

        Args:
            views: per buffer (0, 1), fp32 ``[num_q, size, num_heads, head_dim]``
                states and ``[num_q, size, num_heads]`` LSEs over it (what
                ``merge`` takes; this rank's slots at index :attr:`index`).
            publish_merge: ``medha_kernels``' native ``publish_merge_states``: this
                rank's state into its slots, its flag stored and sleepers woken as
                :meth:`exchange` does, a spin of :data:`_GATHER_SPIN_S` for the
                peers, then ``merge``'s result, or None if a peer is later.
            merge: the native ``merge_states`` (``views`` -> merged state).
            op: names the operation in a timeout's error.

        Returns:
            ``(out, lse) -> merge(*views[parity])`` with this rank's ``out``
            ``[num_q, num_heads, head_dim]`` and ``lse`` ``[num_q, num_heads]`` fp32,
            the shapes of ``views`` (not checked here: the native call checks them).
            A peer later than the spin is waited for as :meth:`exchange` waits
            (futex, then :class:`~medha_parallel.errors.CommunicationError` after
            the timeout).
        """
        base, index, spin = self._base, self.index, _GATHER_SPIN_S

        def exchange_merge(
            out: torch.Tensor, lse: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            if self._owed:
                self._settle()
            seq = self._seq + 1
            v, s = views[seq % 2]
            merged = publish_merge(out, lse, v, s, index, base, _FLAG_STRIDE, seq, spin)
            self._seq = seq  # published (a call refusing its arguments publishes nothing)
            if merged is None:  # published; a peer is later than the spin
                flags = self._flags
                for r in self._peers:
                    if not _reached(flags[r].value, seq):
                        self._wait(r, seq, op, spin=False)
                return merge(v, s)
            return merged

        return exchange_merge

    def gather(
        self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, op: str
    ) -> torch.Tensor:
        """Publish this rank's filled :meth:`slot` and wait for every rank's.

        Returns:
            ``[size, *shape]`` over the shared buffer, in group order: a view,
            valid until the next-but-one exchange overwrites it.
        """
        self.exchange(op)
        return self._views(tuple(shape), dtype, self._seq)

    def all_gather(self, x: torch.Tensor, op: str = "all_gather") -> torch.Tensor:
        """Every rank's ``x``, stacked in group order (a copy).

        Args:
            x: a CPU tensor, the same shape and dtype on every rank (see :meth:`fits`).
            op: names the operation in a timeout's error.

        Returns:
            ``[size, *x.shape]`` in ``x``'s dtype.
        """
        if x.device.type != "cpu" or not self.fits(x.shape, x.dtype):
            raise ValueError(
                f"{op}: {tuple(x.shape)} {x.dtype} on {x.device} does not fit {self!r}"
            )
        self.slot(x.shape, x.dtype).copy_(x)
        return self.gather(x.shape, x.dtype, op).clone()

    def _views(self, shape: tuple[int, ...], dtype: torch.dtype, seq: int) -> torch.Tensor:
        """``[size, *shape]`` views of buffer ``seq % 2`` (cached per shape and dtype)."""
        key = (shape, dtype)
        views = self._cache.get(key)
        if views is None:
            if not self.fits(shape, dtype):
                raise ValueError(f"{shape} {dtype} does not fit {self!r}")
            n = math.prod(shape) * dtype.itemsize
            views = tuple(
                self._buffers[b, :, :n].view(dtype).view(self.size, *shape) for b in (0, 1)
            )
            if len(self._cache) >= 64:
                self._cache.clear()
            self._cache[key] = views
        return views[seq % 2]

    def _wait(self, rank: int, seq: int, op: str, *, spin: bool = True) -> None:
        """Wait for ``rank``'s flag to reach ``seq``: a spin yielding the core for
        :data:`_GATHER_SPIN_S` (unless ``spin`` is False: the caller spun), then futex
        waits of :data:`_GATHER_SLICE_S` with this rank's sleeping word set (see the
        module docstring)."""
        flag = self._flags[rank]
        if spin and _spin(flag, seq, _GATHER_SPIN_S):
            return
        mine = self._sleeping[self.index]
        mine.value = 1
        try:
            addr = self._base + rank * _FLAG_STRIDE
            reached = _futex_wait(self._libc, flag, addr, seq, self.timeout_s, _GATHER_SLICE_S)
        finally:
            mine.value = 0
        if not reached:
            raise CommunicationError(
                f"{op} on the kvp group failed: rank {rank} of the shared-memory group "
                f"did not arrive within {self.timeout_s:.0f} s"
            )

    def close(self) -> None:
        """Unmap the buffer (idempotent)."""
        self._flags.clear()
        self._cache.clear()
        self._buffers = self._flat = torch.empty(0, dtype=torch.uint8)
        with contextlib.suppress(BufferError, ValueError):
            self._mm.close()


class ShmPipe:
    """A one-way channel of message slots from one process to one other on this host.

    The producer fills the next free slot (:meth:`reserve_buffer`, then
    :meth:`publish`); the consumer waits for it (:meth:`peek`), reads it and
    frees it (:meth:`release`). Messages arrive in the order they were
    published; at most ``slots`` are published and not yet released (the
    producer's :meth:`reserve_buffer` waits for the oldest: backpressure). Two int32
    counters, a cache line each, say how many messages were published and
    released; a waiter spins briefly (yielding the core), then sleeps on a
    futex that the other side wakes.

    Build the channels of a pipeline with :meth:`create_chain` (a collective).

    Attributes:
        slots: messages that may be in the channel at once.
        slot_bytes: the largest message.
        timeout_s: bound on every wait (a wait past it raises RuntimeError
            naming the time-out, which callers turn into a CommunicationError).
    """

    def __init__(
        self, mm: mmap.mmap, offset: int, *, slots: int, slot_bytes: int, timeout_s: float
    ) -> None:
        self.slots, self.slot_bytes, self.timeout_s = slots, slot_bytes, timeout_s
        self._mm = mm
        self._addr = ctypes.addressof(ctypes.c_char.from_buffer(mm)) + offset
        self._published = ctypes.c_int32.from_buffer(mm, offset)
        self._released = ctypes.c_int32.from_buffer(mm, offset + _FLAG_STRIDE)
        # the slots as memoryviews and addresses (struct and ctypes.memmove: no tensor op)
        first = offset + 2 * _FLAG_STRIDE
        whole = memoryview(mm)
        self._views = [
            whole[first + i * slot_bytes : first + (i + 1) * slot_bytes] for i in range(slots)
        ]
        self._slot_addrs = [self._addr + 2 * _FLAG_STRIDE + i * slot_bytes for i in range(slots)]
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._sent = 0  # producer: messages published
        self._taken = 0  # consumer: messages released

    def __repr__(self) -> str:
        return f"ShmPipe(slots={self.slots}, slot_bytes={self.slot_bytes})"

    @staticmethod
    def nbytes(*, slots: int, slot_bytes: int) -> int:
        """Bytes one channel takes in its shared buffer (a multiple of 64)."""
        return 2 * _FLAG_STRIDE + slots * _lines(slot_bytes)

    @classmethod
    def create_chain(
        cls,
        group: dist.ProcessGroup | None,
        *,
        slots: int,
        slot_bytes: int,
        timeout_s: float,
    ) -> list[ShmPipe] | None:
        """The channels from group rank ``i`` to ``i + 1``, for every ``i``; None (on every
        rank) where shared memory cannot be used.

        Collective over ``group``: every rank must call it. Each rank uses the
        channel it sends on (its own index) and the one it receives on (the
        previous index).
        """
        if slots < 1 or slot_bytes < 1:
            raise ValueError(f"slots={slots} and slot_bytes={slot_bytes} must be >= 1")
        slot_bytes = _lines(slot_bytes)
        size = dist.get_world_size(group)
        each = cls.nbytes(slots=slots, slot_bytes=slot_bytes)
        mm = map_group_buffer(group, max(1, size - 1) * each, prefix="medha-spp")
        if mm is None:
            return None
        return [
            cls(mm, i * each, slots=slots, slot_bytes=slot_bytes, timeout_s=timeout_s)
            for i in range(size - 1)
        ]

    def reserve_buffer(self) -> tuple[memoryview, int]:
        """The next slot to fill, once the consumer freed it: a writable ``memoryview``
        of its ``slot_bytes`` and its address."""
        i = self._free_slot()
        return self._views[i], self._slot_addrs[i]

    def _free_slot(self) -> int:
        seq = self._sent + 1
        if not _wait_flag(
            self._libc, self._released, self._addr + _FLAG_STRIDE, seq - self.slots, self.timeout_s
        ):
            raise RuntimeError(
                f"Timed out after {self.timeout_s:.0f} s: the receiving stage released no "
                f"slot of the shared-memory channel ({self.slots} messages unread)"
            )
        return (seq - 1) % self.slots

    def publish(self) -> None:
        """Hand the slot :meth:`reserve_buffer` returned (now filled) to the consumer."""
        self._sent += 1
        self._published.value = self._sent
        _wake(self._libc, self._addr, 1)

    def peek_buffer(self) -> tuple[memoryview, int]:
        """The next message's slot (blocking), readable until :meth:`release`: a
        ``memoryview`` of it and its address."""
        i = self._next_message()
        return self._views[i], self._slot_addrs[i]

    def _next_message(self) -> int:
        seq = self._taken + 1
        if not _wait_flag(
            self._libc, self._published, self._addr, seq, self.timeout_s, _PIPE_SPIN_S
        ):
            raise RuntimeError(
                f"Timed out after {self.timeout_s:.0f} s waiting for the sending stage's "
                "message on the shared-memory channel"
            )
        return (seq - 1) % self.slots

    def release(self) -> None:
        """Free the slot :meth:`peek_buffer` returned: the producer may fill it again."""
        self._taken += 1
        self._released.value = self._taken
        _wake(self._libc, self._addr + _FLAG_STRIDE, 1)

    @property
    def published(self) -> int:
        """Messages this producer published so far."""
        return self._sent

    def taken(self, seq: int) -> bool:
        """Whether the consumer released message ``seq`` (1-based)."""
        return _reached(self._released.value, seq)

    def wait_taken(self, seq: int) -> None:
        """Block until the consumer released message ``seq``."""
        if not _wait_flag(
            self._libc, self._released, self._addr + _FLAG_STRIDE, seq, self.timeout_s
        ):
            raise RuntimeError(
                f"Timed out after {self.timeout_s:.0f} s: the receiving stage did not take "
                f"message {seq} from the shared-memory channel"
            )

    def close(self) -> None:
        """Drop this channel's views (the mapping closes with its last user)."""
        self._views, self._slot_addrs = [], []


def map_group_buffer(
    group: dist.ProcessGroup | None, nbytes: int, *, prefix: str
) -> mmap.mmap | None:
    """Map one zeroed shared buffer of ``nbytes`` on every rank of ``group``; None (on every
    rank) unless all of them run on this host, on a supported platform, and can map it.

    Collective over ``group``. Group rank 0 creates the file in ``/dev/shm``
    and unlinks it once every rank mapped it (nothing is left behind if a
    rank dies).
    """
    here = f"{socket.gethostname()}:{_boot_id()}" if supported() else None
    hosts: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, here, group=group)
    if here is None or any(h != here for h in hosts):
        return None
    size, index = len(hosts), dist.get_rank(group)
    path = [None]
    if index == 0:
        path = [f"/dev/shm/{prefix}-{uuid.uuid4().hex}"]
        with open(path[0], "wb") as f:
            f.truncate(nbytes)
    dist.broadcast_object_list(path, group=group, group_src=0)
    mm = None
    with contextlib.suppress(OSError), open(path[0], "r+b") as f:
        mm = mmap.mmap(f.fileno(), nbytes)  # fails where /dev/shm is not shared
    mapped: list[bool | None] = [None] * size
    dist.all_gather_object(mapped, mm is not None, group=group)
    if index == 0:
        os.unlink(path[0])
    if not all(mapped):
        if mm is not None:
            mm.close()
        return None
    return mm


def _reached(value: int, seq: int) -> bool:
    """Whether an int32 sequence flag reading ``value`` has reached ``seq``, modulo
    2**32: a flag wraps after 2**31 - 1 steps (ctypes stores the low 32 bits), and
    ``value >= seq`` would then never hold again."""
    return (value - seq) & 0xFFFFFFFF < 0x80000000


def _wait_flag(
    libc: Any,
    flag: ctypes.c_int32,
    addr: int,
    seq: int,
    timeout_s: float,
    spin_s: float | None = None,
    slice_s: float = _FUTEX_SLICE_S,
) -> bool:
    """Wait until ``flag`` reached ``seq`` (:func:`_reached`: a short spin yielding the
    core, then futex waits on ``addr``, the flag's address, of at most ``slice_s``
    each); False after ``timeout_s``.

    The spin is :data:`_SPINS` rounds, or ``spin_s`` seconds when given.
    """
    return (
        _reached(flag.value, seq)
        or _spin(flag, seq, spin_s)
        or _futex_wait(libc, flag, addr, seq, timeout_s, slice_s)
    )


def _spin(flag: ctypes.c_int32, seq: int, spin_s: float | None) -> bool:
    """Yield the core until ``flag`` reached ``seq``, for :data:`_SPINS` rounds or
    ``spin_s`` seconds; whether it did."""
    if spin_s is None:
        for _ in range(_SPINS):
            os.sched_yield()
            if _reached(flag.value, seq):
                return True
        return False
    end = time.perf_counter() + spin_s
    while time.perf_counter() <= end:
        os.sched_yield()
        if _reached(flag.value, seq):
            return True
    return False


def _futex_wait(
    libc: Any, flag: ctypes.c_int32, addr: int, seq: int, timeout_s: float, slice_s: float
) -> bool:
    """Futex waits of at most ``slice_s`` on ``addr`` until ``flag`` reached ``seq``;
    False after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    where = ctypes.c_void_p(addr)
    slice_ = _Timespec(0, int(slice_s * 1e9))
    while not _reached(seen := flag.value, seq):
        if time.monotonic() > deadline:
            return False
        libc.syscall(_SYS_FUTEX, where, _FUTEX_WAIT, ctypes.c_int32(seen), ctypes.byref(slice_))
    return True


def _wake(libc: Any, addr: int, waiters: int) -> None:
    """Wake up to ``waiters`` processes in a futex wait on the flag at ``addr``."""
    libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, waiters, None)


def _lines(nbytes: int) -> int:
    """``nbytes`` rounded up to whole cache lines (``_FLAG_STRIDE``)."""
    return -(-nbytes // _FLAG_STRIDE) * _FLAG_STRIDE


def _boot_id() -> str:
    """This boot of this machine (two containers may share a host name)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""
