"""The receiving end of a message between ranks (see :mod:`batchgraph.pipeline.dist_comm`).

A :class:`RemoteRecv` takes the receive its communicator posted for the message's header
(or for the whole one-transfer message), waits for it, checks that it names the message
asked for, and returns the tensors: views of a one-transfer buffer, the buffers posted
ahead for a known signature, or buffers allocated from the header.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from batchgraph.pipeline.comm import MessageKey, Payload, RecvWork
from batchgraph.pipeline.dist_header import FRESH, decode_header, signature_of
from batchgraph.pipeline.dist_packing import HEADER_BYTES, unpack
from batchgraph.pipeline.errors import PipelineConfigError

if TYPE_CHECKING:
    from batchgraph.pipeline.dist_comm import DistCommunicator

__all__ = ["Expected", "RemoteRecv"]

#: For a one-transfer receive: the buffer's header part, the header it must hold (this
#: message with its known signature) and the tensors' views into the buffer.
Expected = tuple[Tensor, Tensor, Payload]


class RemoteRecv(RecvWork):
    """A message from another rank: its header, then the tensors the header describes."""

    def __init__(self, comm: DistCommunicator, key: MessageKey, peer: int) -> None:
        self._comm, self._key, self._peer = comm, key, peer
        self._header = comm._take_header(key, peer)
        self._payload: Payload | None = None

    def value(self, timeout: float | None = None) -> Payload:
        if self._payload is not None:
            return self._payload
        comm, key, peer = self._comm, self._key, self._peer
        work, buf, expect = self._header
        comm._wait(work, key, peer, timeout, "header of")
        if expect is not None and torch.equal(expect[0], expect[1]):
            # Exactly the header expected (this message, the known signature): the
            # tensors are in the same transfer, as the views made when it was posted.
            self._payload = expect[2]
            return self._payload
        packed = buf.dtype == torch.uint8  # posted for a known small signature: header + tensors
        known = comm._known.get(key)
        got, specs = decode_header(buf[:HEADER_BYTES].view(torch.int64) if packed else buf)
        if got != key:
            raise PipelineConfigError(
                f"rank {comm.rank} expected the {key} but rank {peer} sent the {got}: the ranks "
                "run different schedules"
            )
        sig = signature_of(specs)
        tensors: list[Tensor | None]
        if packed:
            if sig == known:  # (cannot happen: the same key and signature encode alike)
                self._payload = unpack(buf, sig)
                return self._payload
            # The signature changed: the tensors follow under fresh tags.
        elif known is not None:
            # The sender used the buffers posted ahead for the known signature: with the
            # payload if it still matches, with filler (to drain them) if it changed.
            posted = comm._take_ahead(key, peer)
            for item in posted:
                if item is not None:
                    comm._wait(item[0], key, peer, timeout, "payload of")
            if sig == known:
                tensors = [None if item is None else item[1] for item in posted]
                self._payload = tuple(tensors)
                return self._payload
        fresh = FRESH if known is not None else 0
        tensors, works = [], []
        for part, spec in enumerate(specs, start=1):
            if spec is None:
                tensors.append(None)
                continue
            t = torch.empty(spec[1], dtype=spec[0], device=comm.device)
            works.append(comm._post_recv(t, key, peer, part + fresh))
            tensors.append(t)
        for w in works:
            comm._wait(w, key, peer, timeout, "payload of")
        comm._known[key] = sig
        self._payload = tuple(tensors)
        return self._payload

    def is_completed(self) -> bool:
        return self._payload is not None
