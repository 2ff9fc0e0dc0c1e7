"""``PipeTransport.send`` (plain ``pickle`` and ``send_bytes``): every worker message
reaches the driver's end of the pipe (``Connection.recv``) equal, in order."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from medha_runtime.messages import Done, Failed, Ready
from medha_runtime.sampling_params import PromptLogprobs, Sampled
from medha_runtime.transport import PipeTransport, TransportClosed


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
