"""A forward writing a buffer (or a plain tensor attribute) through a view of it and
reading it back: ``self.buf[:n].copy_(x)``, ``self.buf[0].add_(1)``,
``self.buf.narrow(0, 0, n).copy_(x)``, ``self.buf.view(-1)[:4] = ...``,
``torch.mul(..., out=self.buf[1])``, ``self.buf.data[0] = ...``.

Before: batchgraph's runs on fake tensors took the view of a real buffer as a fake
(``.data`` as a real alias), whose in-place change they did not see as the buffer's,
so such a forward looked like one keeping no state: a write of constants batched,
every call of a batch reading one step (``self.buf[0].add_(1)``, 3 calls: 1, 1, 1
where eagerly 1, 2, 3), and a write of the input ran one call at a time but not in
recorded order (coroutine examples interleaved, silently); and the fake run moved the
real buffer's version counter, so a second signature's calls were refused
(BufferChangedError) for a change batchgraph made itself. Now the view's change is
the buffer's: the calls run one at a time in recorded order, as for ``add_``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from tests.unit.test_forward_caches import ENTRIES, Keeping, check_as_eagerly
from tests.unit.test_forward_number_reads import plain_and_coroutine_calls_as_eagerly

Write = Callable[[torch.Tensor, torch.Tensor], object]

WRITES: dict[str, Write] = {
    "slice copy_": lambda buf, x: buf[:x.shape[0]].copy_(x.detach()),
    "narrow copy_": lambda buf, x: buf.narrow(0, 0, x.shape[0]).copy_(x.detach()),
    "row add_ of the input": lambda buf, x: buf[0].add_(x.detach().sum(0)),
    "row add_ of a constant": lambda buf, x: buf[0].add_(1),
    "view setitem": lambda buf, x: buf.view(-1).__setitem__(slice(0, 4), x.detach().sum(0)),
    "out= a row": lambda buf, x: torch.mul(x.detach().sum(0), 2, out=buf[1]),
    "data setitem": lambda buf, x: buf.data.__setitem__(0, x.detach().sum(0)),
    "data row add_": lambda buf, x: buf.data[2].add_(1),
    # directly (seen on 2fcebeb already)
    "index_copy_": lambda buf, x: buf.index_copy_(0, torch.arange(x.shape[0]), x.detach()),
    "masked_fill_": lambda buf, x: buf.masked_fill_(x.detach()[0] > 0, 1.0),
    "row setitem": lambda buf, x: buf.__setitem__(1, x.detach().sum(0)),
}


def _module(write: Write, buffer: bool) -> type[nn.Module]:
    class Writing(Keeping):
        def __init__(self) -> None:
            super().__init__()
            table = torch.zeros(3, 4)
            if buffer:
                self.register_buffer("buf", table)
            else:  # a plain tensor attribute (Holder.double() leaves it as it is)
                self.buf = table.double()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            write(self.buf, x)
            return self.lin(x) + self.buf.sum(0)

    return Writing


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("buffer", [True, False], ids=["buffer", "plain"])
@pytest.mark.parametrize("write", sorted(WRITES))
@pytest.mark.parametrize("lengths", [[2, 2, 2], [1, 2, 3, 2]], ids=str)
def test_a_buffer_written_through_a_view_and_read_computes_as_eagerly(
        entry: str, buffer: bool, write: str, lengths: list[int]) -> None:
    check_as_eagerly(entry, _module(WRITES[write], buffer), lengths, 0, in_order=True)


def test_the_runs_on_fake_tensors_leave_the_buffers_version_as_it_was() -> None:
    from batchgraph.inference import on_fake_tensors
    from batchgraph.module_state import state_kept

    module = _module(WRITES["row add_ of a constant"], buffer=True)()
    with state_kept(module) as kept, on_fake_tensors():
        module(torch.empty(2, 4))
        changed = list(kept.changed)  # the real tensors whose changes the run skipped
    assert module.buf._version == 0 and not module.buf.any()
    assert [t is module.buf for t in changed] == [True]


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("buffer", [True, False], ids=["buffer", "plain"])
@pytest.mark.parametrize("write", ["row add_ of a constant", "slice copy_", "data setitem"])
def test_a_grandchild_writing_through_a_view_called_on_handles_and_in_coroutines(
        write: str, buffer: bool, groups: int) -> None:
    plain_and_coroutine_calls_as_eagerly(_module(WRITES[write], buffer), groups)
