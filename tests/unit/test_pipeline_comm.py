"""ThreadCommunicator: keyed delivery in any order, abort wakes receivers, timeouts, close."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from batchgraph.pipeline import MessageKey, MessageKind, ThreadCommunicator
from batchgraph.pipeline.errors import (
    PipelineAbortedError,
    PipelineClosedError,
    PipelineTimeoutError,
)


def _key(mb: int, kind: MessageKind = MessageKind.ACTIVATION) -> MessageKey:
    return MessageKey(kind, 0, 1, mb)


def test_out_of_order_delivery_by_key() -> None:
    comm = ThreadCommunicator(default_timeout=5)
    for mb in (2, 0, 1):
        comm.send(_key(mb), (torch.full((1,), float(mb)),))
    assert [comm.recv(_key(mb))[0].item() for mb in range(3)] == [0.0, 1.0, 2.0]  # type: ignore[union-attr]
    comm.wait_sends()


def test_send_handles_kept_until_wait_sends() -> None:
    comm = ThreadCommunicator()
    work = comm.send(_key(0), (torch.ones(1),))
    assert work.is_completed()
    assert comm._inflight == [work]
    comm.wait_sends()
    assert comm._inflight == []


def test_abort_wakes_a_blocked_receiver() -> None:
    comm = ThreadCommunicator()
    caught: list[BaseException] = []

    def receiver() -> None:
        try:
            comm.recv(_key(0))
        except BaseException as exc:
            caught.append(exc)

    thread = threading.Thread(target=receiver)
    thread.start()
    time.sleep(0.05)
    comm.abort(ValueError("upstream failed"))
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert isinstance(caught[0], PipelineAbortedError)
    assert isinstance(caught[0].__cause__, ValueError)
    comm.reset()
    comm.send(_key(0), (None,))
    assert comm.recv(_key(0)) == (None,)


def test_timeout_names_the_message() -> None:
    comm = ThreadCommunicator(default_timeout=0.05)
    with pytest.raises(
        PipelineTimeoutError, match="activation of microbatch 3 from stage 0 to stage 1"
    ):
        comm.recv(_key(3))


def test_duplicate_send_and_closed_use_are_errors() -> None:
    comm = ThreadCommunicator()
    comm.send(_key(0), ())
    with pytest.raises(RuntimeError, match="sent twice"):
        comm.send(_key(0), ())
    comm.close()
    with pytest.raises(PipelineClosedError):
        comm.irecv(_key(1))


def test_irecv_completes_when_message_arrives() -> None:
    comm = ThreadCommunicator()
    recv = comm.irecv(_key(0, MessageKind.GRADIENT))
    assert not recv.is_completed()
    comm.send(_key(0, MessageKind.GRADIENT), (torch.zeros(2),))
    assert recv.is_completed()
    recv.wait()
    assert recv.value()[0] is not None
