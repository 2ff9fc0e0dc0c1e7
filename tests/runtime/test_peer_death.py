"""A rank's failed collective is reported as the consequence of a peer's death, even
when the dead process is not yet reaped at the moment the survivor's error arrives
(seen on a 16-core GPU machine: ``test_a_killed_worker_is_a_clear_error`` got rank 0's
gloo error without the dead rank's name)."""

from __future__ import annotations

import types

import pytest

from medha_runtime.executor import MultiprocExecutor, WorkerError


class _DyingProcess:
    """A process in exit, not yet reaped: alive for its first few polls."""

    def __init__(self, exitcode: int, polls: int = 3) -> None:
        self._exitcode = exitcode
        self.polls = polls

    def join(self, timeout: float | None = None) -> None:
        pass

    def is_alive(self) -> bool:
        self.polls -= 1
        return self.polls >= 0

    @property
    def exitcode(self) -> int | None:
        return None if self.polls >= 0 else self._exitcode


class _Healthy:
    exitcode = None

    def join(self, timeout: float | None = None) -> None:
        pass

    def is_alive(self) -> bool:
        return True


def _executor(processes: list) -> types.SimpleNamespace:
    ex = types.SimpleNamespace(processes=processes, failed=None, killed=False)
    ex._exitcode = lambda rank: MultiprocExecutor._exitcode(ex, rank)

    def kill() -> None:
        ex.killed = True

    ex._kill = kill
    ex._fail = lambda message: MultiprocExecutor._fail(ex, message)
    return ex


def test_a_peer_dying_but_not_yet_reaped_is_named_first() -> None:
    ex = _executor([_Healthy(), _DyingProcess(-9), _Healthy()])
    with pytest.raises(WorkerError) as info:
        MultiprocExecutor._fail_after_peer(ex, 0, "all_reduce on the tp group failed: closed")
    assert str(info.value) == (
        "worker rank 1 died (exit code -9); rank 0 then failed: "
        "all_reduce on the tp group failed: closed"
    )
    assert ex.killed and ex.failed == str(info.value)


def test_without_a_dead_peer_the_rank_s_own_error_stands() -> None:
    ex = _executor([_Healthy(), _Healthy()])
    with pytest.raises(WorkerError, match=r"^ValueError: bad$"):
        MultiprocExecutor._fail_after_peer(ex, 1, "ValueError: bad")
