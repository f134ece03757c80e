"""What a handle answers from its spec, as a tensor would: ``shape``, ``dtype``,
``device``, ``numel()``, ``is_nested`` (a mixin of ``ResultHandle``).

Per-example code asks these of its tensors (``x / x.numel()``, torch's modules check
``query.is_nested``), and recording them would fail: they are not tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from batchgraph.specs import TensorSpec

if TYPE_CHECKING:
    from batchgraph.specs import OutSpec

__all__ = ["TensorMetadata"]


class TensorMetadata:
    """A handle's tensor metadata, known from its spec while recording.

    Example:
        >>> import batchgraph as bg, torch
        >>> with bg.BatchingPolicy():
        ...     h = bg.batched_value(torch.zeros(2, 3)) * 1
        ...     h.shape, h.dtype, h.numel(), h.is_nested
        (torch.Size([2, 3]), torch.float32, 6, False)
    """

    __slots__ = ()
    spec: OutSpec

    def _tensor_spec(self, what: str) -> TensorSpec:
        spec = self.spec
        if isinstance(spec, TensorSpec):
            return spec
        if spec is None:
            # A run on fake tensors could not tell the output: its shape depends on
            # the values (a mask's selection), or the call returns another structure.
            raise TypeError(
                f"the {what} of {self!r} is not known while recording: its call's output "
                "(or that of a call it reads) depends on values only computing tells "
                "(h[h > 0], h.nonzero(), torch.unique(h)). Compute it first "
                "(bg.compute(h) after the policy's block, or `await bg.value(h)` in a "
                f"coroutine example) and ask the tensor; or ask the {what} of the handle "
                "it was made from, where it is the same (h[h > 0] keeps h's dtype and "
                "device)."
            )
        raise TypeError(
            f"the {what} of {self!r}: it stands for several tensors, not one; ask one of "
            "them (index the result first)"
        )

    @property
    def shape(self) -> torch.Size:
        """Per-example shape (no batch dimension)."""
        return torch.Size(self._tensor_spec("shape").shape)

    @property
    def dtype(self) -> torch.dtype:
        return self._tensor_spec("dtype").dtype

    @property
    def device(self) -> torch.device:
        return self._tensor_spec("device").device

    @property
    def ndim(self) -> int:
        return len(self._tensor_spec("ndim").shape)

    def dim(self) -> int:
        return self.ndim

    ndimension = dim

    def size(self, dim: int | None = None) -> Any:
        shape = self.shape
        return shape if dim is None else shape[dim]

    # Known from the spec, as the attributes above: per-example code asks them of
    # tensors (`x / x.numel()`), and recording them would fail (they are not tensors).
    def numel(self) -> int:
        return self.shape.numel()

    nelement = numel

    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.numel() * self.dtype.itemsize

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def is_complex(self) -> bool:
        return self.dtype.is_complex

    def is_signed(self) -> bool:
        return self.dtype.is_signed

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def is_cpu(self) -> bool:
        return self.device.type == "cpu"

    @property
    def is_meta(self) -> bool:
        return self.device.type == "meta"

    # Batched values are dense: each example's is a row of a stacked tensor.
    # (nn.MultiheadAttention asks query.is_nested before anything else.)
    is_nested = is_sparse = False
    layout = torch.strided

    def get_device(self) -> int:
        # As a tensor answers: the device index, -1 on the CPU.
        index = self.device.index
        return -1 if self.device.type == "cpu" else (0 if index is None else index)

