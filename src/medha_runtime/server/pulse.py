"""A liveness pulse from the engine process that long steps cannot delay.

The engine loop sends its gauges (a ``Heartbeat``) between steps, but one
step may legitimately take many seconds (a non-preemptive prefill of a long
prompt on a CPU). :class:`Pulse` runs a daemon thread with its own ZeroMQ
PUSH socket (sockets are not shared between threads) that sends an
``Alive`` message every ``period_s``, so the HTTP process declares the engine
dead only when the process is gone or frozen, not when it is busy.
"""

from __future__ import annotations

import pickle
import threading
from typing import Any


class Pulse:
    """Send ``message`` to ``address`` every ``period_s`` until :meth:`stop`."""

    def __init__(self, ctx: Any, address: str, message: object, *, period_s: float) -> None:
        import zmq

        self._sock = ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 4)  # a reader that stalls gets no backlog of pulses
        self._sock.connect(address)
        self._payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self._period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="medha-engine-pulse", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        while not self._stop.wait(self._period_s):
            try:
                self._sock.send(self._payload, zmq.NOBLOCK)
            except zmq.Again:
                pass  # the reader is behind; it already has pulses to read
            except zmq.ZMQError:
                return  # the context is closing

    def stop(self) -> None:
        """Stop the thread and close its socket (before the context terminates)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._sock.close(linger=0)
