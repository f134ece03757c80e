"""The header that goes before every message between ranks: what it is and what it holds.

The receiver allocates its buffers from the header, so a message can never be
truncated or misread, and checks that the header names the message it asked for.
"""

from __future__ import annotations

import torch
from torch import Tensor

from batchgraph.pipeline.comm import MessageKey, MessageKind, Payload
from batchgraph.pipeline.errors import PipelineConfigError

__all__ = [
    "FRESH",
    "HEADER_LEN",
    "KINDS",
    "MAX_TENSORS",
    "Signature",
    "decode_header",
    "encode_header",
    "encode_signature",
    "payload_specs",
    "signature_of",
]

#: dtypes a header can name (its code is the index).
_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_CODE = {dt: i for i, dt in enumerate(_DTYPES)}
HEADER_LEN = 64
_FIXED = 5  # kind, src, dst, microbatch, number of tensors
MAX_TENSORS = 15  # parts per message: the header plus up to 15 tensors
KINDS = (MessageKind.ACTIVATION, MessageKind.GRADIENT)
#: Tag offset of a message's tensors when they do not go into the buffers posted ahead.
FRESH = MAX_TENSORS + 1

Spec = tuple[torch.dtype, list[int]] | None
#: What a message holds: per tensor its dtype and shape (``None`` for an absent tensor).
Signature = tuple[tuple[torch.dtype, tuple[int, ...]] | None, ...]


def payload_specs(tensors: list[Tensor | None]) -> list[Spec]:
    """``(dtype, shape)`` per tensor, like :func:`decode_header` returns them."""
    return [None if t is None else (t.dtype, list(t.shape)) for t in tensors]


def signature_of(specs: list[Spec]) -> Signature:
    """A hashable, comparable signature of ``specs``."""
    return tuple(None if s is None else (s[0], tuple(s[1])) for s in specs)


def encode_header(key: MessageKey, payload: Payload) -> Tensor:
    """The int64 header describing ``payload`` sent under ``key``.

    Layout: ``[kind, src, dst, microbatch, n, (dtype, ndim, *shape) * n, 0...]``; a
    ``None`` entry is ``dtype = -1``.

    Raises:
        PipelineConfigError: if the payload has too many tensors or dimensions to describe.

    Example:
        >>> key = MessageKey(MessageKind.ACTIVATION, 0, 1, 3)
        >>> encode_header(key, (torch.zeros(2, 5), None))[:12].tolist()
        [0, 0, 1, 3, 2, 0, 2, 2, 5, -1, 0, 0]
    """
    return encode_signature(key, signature_of(payload_specs(list(payload))))


def encode_signature(key: MessageKey, sig: Signature) -> Tensor:
    """The header of a message under ``key`` whose tensors have signature ``sig``.

    The same as :func:`encode_header` for a payload of that signature: the header depends
    on the key and the signature only, so a sender can reuse it step after step and a
    receiver can compare what arrives with it instead of decoding.

    Raises:
        PipelineConfigError: like :func:`encode_header`.
    """
    if len(sig) > MAX_TENSORS:
        raise PipelineConfigError(
            f"{key}: {len(sig)} tensors in one message; at most {MAX_TENSORS} cross a cut"
        )
    values = [KINDS.index(key.kind), key.src, key.dst, key.microbatch, len(sig)]
    for spec in sig:
        if spec is None:
            values += [-1, 0]
        else:
            dtype, shape = spec
            if dtype not in _CODE:
                raise PipelineConfigError(f"{key}: cannot send dtype {dtype} between ranks")
            values += [_CODE[dtype], len(shape), *shape]
    if len(values) > HEADER_LEN:
        raise PipelineConfigError(
            f"{key}: the tensors' shapes {[None if s is None else s[1] for s in sig]} "
            f"need {len(values)} header entries, more than {HEADER_LEN}"
        )
    values += [0] * (HEADER_LEN - len(values))
    return torch.tensor(values, dtype=torch.int64)


def decode_header(header: Tensor) -> tuple[MessageKey, list[Spec]]:
    """Read a header back: the key it names and ``(dtype, shape)`` per tensor (``None`` if absent).

    Example:
        >>> key = MessageKey(MessageKind.GRADIENT, 2, 1, 0)
        >>> decode_header(encode_header(key, (torch.zeros(3),)))
        (MessageKey(kind=<MessageKind.GRADIENT: 'gradient'>, src=2, dst=1, microbatch=0), [(torch.float32, [3])])
    """
    v = header.tolist()
    key = MessageKey(KINDS[v[0]], v[1], v[2], v[3])
    specs: list[Spec] = []
    pos = _FIXED
    for _ in range(v[4]):
        code, ndim = v[pos], v[pos + 1]
        pos += 2
        if code < 0:
            specs.append(None)
            continue
        specs.append((_DTYPES[code], v[pos : pos + ndim]))
        pos += ndim
    return key, specs
