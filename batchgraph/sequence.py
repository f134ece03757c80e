"""A custom ``BatchKey``: variable-length sequences through ``nn.LSTM``/``GRU``/``RNN``.

Per example, a recurrent layer takes an unbatched ``(T, features)`` sequence whose
length ``T`` differs between examples. The default key includes shapes, so these
calls would never meet; this key leaves ``T`` out of its identity and runs a group as
one packed call (``pack_sequence`` → the layer → ``pad_packed_sequence``), then hands
each example its own ``(T_i, hidden)`` output and ``(layers * directions, hidden)``
final state, exactly what the eager unbatched call returns.

It is the worked example for users writing their own key: say what must match in
``identity``, take the per-example inputs as a list (``combine = "list"``) and return a
list of per-example results from ``run``. It is registered for ``nn.LSTM``, ``nn.GRU``
and ``nn.RNN`` by default; other recurrent modules can use it through
``BatchingPolicy(rules={MyRNN: PackedSequenceKey})``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn.utils.rnn import pack_sequence, pad_packed_sequence

from batchgraph.keys import BatchKey, VmapKey
from batchgraph.specs import CallSignature

__all__ = ["PackedSequenceKey"]


class PackedSequenceKey(BatchKey):
    """Batches unbatched ``(T, features)`` sequences of any lengths in one packed call.

    Only the sequence (and optionally an initial state of matching shape per example)
    may be passed; the lengths are free.

    Example:
        >>> import batchgraph as bg, torch
        >>> lstm = bg.batched_func(torch.nn.LSTM(4, 8))
        >>> with bg.BatchingPolicy() as p:
        ...     outs = [lstm(torch.randn(n, 4)) for n in (3, 5, 2)]
        >>> [o[0].shape[0] for o in bg.compute(outs)]
        [3, 5, 2]
        >>> p.stats.launches
        1
    """

    combine: ClassVar[str] = "list"

    def identity(self) -> Hashable:
        # Everything of the signature except each sequence's length.
        specs = self.call.input_specs
        first = specs[0]
        assert first is not None
        rest = tuple(specs[1:])
        return (id(self.fn), first.shape[1:], first.dtype, first.device, rest)

    def run(self, fn: Callable[..., Any], inputs: Sequence[Any], size: int) -> Any:
        sequences: list[torch.Tensor] = list(inputs[0])
        lengths = [len(s) for s in sequences]
        packed = pack_sequence(sequences, enforce_sorted=False)
        if len(inputs) > 1:
            # Initial state per example: (layers * dirs, hidden) -> stacked on dim 1.
            state = tuple(torch.stack(list(column), dim=1) for column in inputs[1:])
            out, final = fn(packed, state[0] if len(state) == 1 else state)
        else:
            out, final = fn(packed)
        padded, _ = pad_packed_sequence(out, batch_first=True)
        results = []
        for i, length in enumerate(lengths):
            if isinstance(final, tuple):
                results.append((padded[i, :length], tuple(f[:, i] for f in final)))
            else:
                results.append((padded[i, :length], final[:, i]))
        return results


def packed_sequence_rule(
    module: nn.Module, call: CallSignature, *, deterministic: bool = True
) -> BatchKey:
    """The default rule for recurrent layers: packing for unbatched 2-D sequences."""
    spec = call.input_specs[0] if call.input_specs else None
    simple = len(call.args) <= 2 and not call.kwargs
    if spec is not None and len(spec.shape) == 2 and simple and spec.shape[0] > 0:
        return PackedSequenceKey(module, call, deterministic=deterministic)
    return VmapKey(module, call, deterministic=deterministic)
