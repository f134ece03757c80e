"""The one-transfer message of :mod:`batchgraph.pipeline.dist_comm`: its byte layout.

With gloo, a message whose signature both ends know and that takes at most
``PACK_LIMIT`` bytes travels as one transfer: the header (``HEADER_BYTES``) and then each
tensor at a 64-byte aligned offset. The receiver takes the tensors as views of the buffer
(``unpack``); the sender keeps one ``PackedBuffer`` per message key and copies the tensors
into it every step.

Example:
    >>> sig = ((torch.float32, (2, 3)),)
    >>> spots, total = layout(sig)
    >>> spots[0][0] % 64, spots[0][1], total % 64
    (0, 24, 0)
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from batchgraph.pipeline.comm import Payload, Work
from batchgraph.pipeline.dist_header import HEADER_LEN, Signature

__all__ = ["HEADER_BYTES", "PACK_LIMIT", "PackedBuffer", "layout", "unpack"]

HEADER_BYTES = HEADER_LEN * 8
#: A message whose header and tensors take at most this many bytes travels as one transfer
#: (gloo): copying it into one buffer costs far less than a second transfer.
PACK_LIMIT = 256 * 1024
_ALIGN = 64


@functools.lru_cache(maxsize=256)
def layout(sig: Signature) -> tuple[tuple[tuple[int, int] | None, ...], int]:
    """Where each tensor of ``sig`` sits in a one-transfer message: (byte offset, bytes),
    after the header, each aligned to 64 bytes; and the message's total size in bytes,
    rounded up to 64 too, so the whole buffer can be viewed as any of its dtypes."""
    spots: list[tuple[int, int] | None] = []
    offset = HEADER_BYTES
    for spec in sig:
        if spec is None:
            spots.append(None)
            continue
        dtype, shape = spec
        offset = -(-offset // _ALIGN) * _ALIGN
        size = math.prod(shape) * dtype.itemsize
        spots.append((offset, size))
        offset += size
    return tuple(spots), -(-offset // _ALIGN) * _ALIGN


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


@functools.lru_cache(maxsize=256)
def _views(
    sig: Signature,
) -> tuple[tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int] | None, ...]:
    """Per tensor of ``sig``: (dtype, shape, strides, offset in elements of that dtype)
    in a one-transfer buffer, so each view is one ``as_strided`` of the buffer viewed
    as its dtype (offsets are 64-byte aligned, hence whole elements)."""
    out: list[tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int] | None] = []
    for spot, spec in zip(layout(sig)[0], sig):
        if spot is None or spec is None:
            out.append(None)
        else:
            dtype, shape = spec
            out.append((dtype, shape, _contiguous_strides(shape), spot[0] // dtype.itemsize))
    return tuple(out)


def unpack(buf: Tensor, sig: Signature) -> Payload:
    """The tensors of a one-transfer message: views into ``buf`` (no copy)."""
    return tuple(
        None if v is None else torch.as_strided(buf.view(v[0]), v[1], v[2], v[3])
        for v in _views(sig)
    )


class PackedBuffer:
    """A key's one-transfer send buffer for its known signature, reused step after step.

    The header is written once and the padding stays zero; a send copies each tensor
    into its slot (one copy per tensor, no concatenation). The buffer is reused only
    once the send that last used it has been waited (:meth:`Communicator.wait_sends` at
    the end of every step), so gloo never reads a buffer being overwritten; while it is
    still in flight a new one is allocated.
    """

    __slots__ = ("buf", "peer", "sig", "slots", "work")

    def __init__(self, header: Tensor, sig: Signature, peer: int, device: torch.device) -> None:
        self.sig = sig
        self.peer = peer
        self.buf = torch.zeros(layout(sig)[1], dtype=torch.uint8, device=device)
        self.buf[:HEADER_BYTES].view(torch.int64).copy_(header)
        self.slots = unpack(self.buf, sig)
        self.work: Work | None = None

    def matches(self, payload: Payload) -> bool:
        """Whether ``payload`` has exactly this buffer's signature (dtypes and shapes)."""
        sig = self.sig
        if len(payload) != len(sig):
            return False
        for t, spec in zip(payload, sig):
            if t is None or spec is None:
                if (t is None) != (spec is None):
                    return False
            elif t.dtype != spec[0] or t.shape != spec[1]:
                return False
        return True

    def fill(self, payload: Payload) -> None:
        """Copy ``payload`` into the slots (it matches)."""
        for t, slot in zip(payload, self.slots):
            if t is not None and slot is not None:
                slot.copy_(t.detach() if t.requires_grad else t)

    @property
    def free(self) -> bool:
        """Whether no send in flight still reads the buffer."""
        return self.work is None or self.work.is_completed()
