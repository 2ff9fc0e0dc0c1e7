"""``PipeTransport.send`` (plain ``pickle`` and ``write_message``): every worker message
reaches the driver's end of the pipe (``Connection.recv``) equal, in order; and
``read_message`` / ``write_message`` speak ``Connection.send_bytes``' framing both
ways, whole messages of any size, split writes, the end of the pipe and a closed end."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import struct
import threading

import pytest

from medha_runtime.messages import Done, Failed, Ready, Step
from medha_runtime.plan import PlannedChunk, StepPlan
from medha_runtime.sampling_params import PromptLogprobs, Sampled
from medha_runtime.transport import PipeTransport, TransportClosed, read_message, write_message


def test_every_worker_message_reaches_the_driver_equal_and_in_order() -> None:
    driver, worker = mp.Pipe(duplex=True)
    transport = PipeTransport(worker)
    messages = [
        Ready(rank=1, pid=1234, stage=0, sampler=True),
        Done(rank=0, step_id=7, result=[Sampled(42)], compute_s=0.002, cpu_s=0.0019),
        Done(
            rank=0,
            step_id=8,
            result=[
                Sampled(5, -0.25, ((5, -0.25), (9, -1.5))),
                PromptLogprobs("r", 3, ({1: -0.5}, {2: -0.75, 4: -2.0})),
            ],
            compute_s=0.5,
            cpu_s=0.25,
            wait_s=0.125,
        ),
        Done(rank=1, step_id=8),
        Failed(rank=1, error="Traceback (most recent call last): ...\nValueError: x"),
    ]
    for m in messages:
        transport.send(m)
    got = [driver.recv() for _ in messages]
    assert got == messages
    assert [type(m) for m in got] == [type(m) for m in messages]
    assert not driver.poll(0)  # one pipe message per send
    driver.close()
    with pytest.raises(TransportClosed):
        transport.send(Done(rank=0, step_id=9))


SIZES = [0, 1, 4, 137, 16384, 16385, 70000, 1 << 20]


@pytest.mark.parametrize("duplex", [True, False])
def test_messages_read_and_written_raw_equal_the_connection_s(duplex: bool) -> None:
    reader, writer = mp.Pipe(duplex=duplex)
    payloads = [bytes((i * 7 + n) % 256 for i in range(n)) for n in SIZES]

    def send_all(send) -> threading.Thread:  # big messages fill the pipe: write from a thread
        t = threading.Thread(target=lambda: [send(p) for p in payloads])
        t.start()
        return t

    t = send_all(writer.send_bytes)  # Connection -> read_message
    assert [read_message(reader) for _ in payloads] == payloads
    t.join()
    t = send_all(lambda p: write_message(writer, p))  # write_message -> Connection
    assert [reader.recv_bytes() for _ in payloads] == payloads
    t.join()
    t = send_all(lambda p: write_message(writer, p))  # both raw
    assert [read_message(reader) for _ in payloads] == payloads
    t.join()
    assert not reader.poll(0)


def test_a_message_written_in_pieces_is_read_whole() -> None:
    reader, writer = mp.Pipe(duplex=False)
    data = pickle.dumps(Step(StepPlan(3, (PlannedChunk("r", 5, (1, 2, 3), (0,), ()),))))
    framed = struct.pack("!i", len(data)) + data

    def dribble() -> None:
        for i in range(0, len(framed), 3):
            os.write(writer.fileno(), framed[i : i + 3])

    t = threading.Thread(target=dribble)
    t.start()
    assert pickle.loads(read_message(reader)) == pickle.loads(data)
    t.join()


def test_the_end_of_the_pipe_and_a_closed_end_raise() -> None:
    reader, writer = mp.Pipe(duplex=False)
    os.write(writer.fileno(), struct.pack("!i", 10) + b"abc")  # cut short
    writer.close()
    with pytest.raises(EOFError):
        read_message(reader)
    with pytest.raises(EOFError):
        read_message(reader)  # nothing left at all
    reader.close()
    with pytest.raises(OSError):
        read_message(reader)
    with pytest.raises(OSError):
        write_message(reader, b"x")
    a, b = mp.Pipe(duplex=True)
    b.close()
    with pytest.raises(OSError):  # the peer is gone: BrokenPipeError
        write_message(a, b"x" * 10)
    transport = PipeTransport(a)
    with pytest.raises(TransportClosed):
        transport.recv()
