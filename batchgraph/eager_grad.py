"""Whether a recorded value would require grad had its call run eagerly.

A batched call runs on the stacked inputs of many examples: when one example's input
requires grad, the stack does, and so does every row of the output, also those of
examples whose inputs do not. Eagerly each example's result requires grad iff it was
computed with grad on and something it was computed from requires grad: a tensor
argument (a constant, or another call's result, recursively), or a tensor the callable
itself reads (a module's parameters, a function's captured tensors); under no_grad only
a call that returns its input itself gives one that does. Values are handed
out (``handle.value``, ``bg.compute``, ``await bg.value(h)``) detached where that is not
so; their gradients, where it is, are untouched.

The answer is worked out here, when a value that requires grad is handed out, and not
while recording: recording is the hot path, and most values handed out do not require
grad at all (inference, a decoder's tokens), which costs one flag check. Per graph, each
node is looked at once (memoised), walking back through the nodes it was computed from.

Example:
    >>> import batchgraph as bg, torch
    >>> a, b = torch.ones(2, requires_grad=True), torch.ones(2)
    >>> with bg.BatchingPolicy():
    ...     ha, hb = bg.batched_func(torch.tanh)(a), bg.batched_func(torch.tanh)(b)
    >>> [t.requires_grad for t in bg.compute([ha, hb])]      # as tanh(a), tanh(b)
    [True, False]
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_leaves

from batchgraph.keys import BatchKey, ConstantKey
from batchgraph.specs import CallSignature
from batchgraph.torch_callables import torchs_own

if TYPE_CHECKING:
    from batchgraph.graph import Graph

__all__ = ["eager_requires_grad", "reads_grad"]

# Per key (equal keys share it), across graphs: ``_hides_grad``. One fake run per key,
# so not per batch; a tensor found so is taken to require grad for good.
_FAKE_RUNS: weakref.WeakKeyDictionary[BatchKey, bool] = weakref.WeakKeyDictionary()


def eager_requires_grad(graph: Graph, node: int) -> bool:
    """Whether the value of ``node`` would require grad had its call run eagerly.

    True where it cannot be told (a graph bound from a portable batch keeps no
    inputs): the value is then handed out as computed. Asked while a compute runs
    (``Executor._detach_borrowed_grad``), about nodes that compute has not located
    yet, the answer is provisional: such a node counts as requiring grad where an
    input of it does (a comparison of an input that requires grad included), which
    is safe for a batch (nothing is detached that eagerly would not be), but kept
    only until the graph's next stamp, not as the node's answer: the value handed out
    afterwards is judged by what its batch stored (no grad for the comparison).
    """
    memo = graph.node_grad
    found = memo.get(node)
    if found is not None:
        return found
    inputs = graph.node_inputs
    if node >= len(inputs):
        return True
    stamp, pending = graph.node_grad_pending
    if stamp != graph.stamp:
        pending = {}
        graph.node_grad_pending = (graph.stamp, pending)
    node_key, keys, key_grad = graph.node_key, graph.keys, graph.key_grad
    grad_constants = graph.grad_constants
    # Depth-first, without recursion (a decoder's chain is thousands of nodes deep);
    # node ids are a topological order, so the walk ends.
    stack = [node]
    while stack:
        n = stack[-1]
        if n in memo or n in pending:
            stack.pop()
            continue
        if type(keys[node_key[n]]) is ConstantKey:
            memo[n] = n in grad_constants
        elif not graph.stored_requires_grad(n):
            # No example's value does: recorded under no_grad (a view of an input
            # taken there included), or not differentiable (argmax, comparisons).
            memo[n] = False
        else:
            # Recorded with grad, or under no_grad by a call that returns its input
            # itself (dropout in eval mode): as its inputs, or what the callable reads.
            # Not located yet (this compute runs it): provisional, as is an answer
            # that read a provisional one.
            unsure = not graph.computed(n)
            kid = node_key[n]
            if key_grad.get(kid) is True and reads_grad(graph, kid):
                (pending if unsure else memo)[n] = True
                stack.pop()
                continue
            # One input at a time: the first that requires grad settles it, and the
            # others are then never walked.
            for source, _ in inputs[n]:
                flag = memo.get(source)
                if flag is None:
                    flag = pending.get(source)
                    if flag is None:
                        stack.append(source)
                        break
                    unsure = True
                if flag:
                    (pending if unsure else memo)[n] = True
                    stack.pop()
                    break
            else:
                (pending if unsure else memo)[n] = reads_grad(graph, kid) or _hides_grad(keys[kid])
                stack.pop()
            continue
        stack.pop()
    found = memo.get(node)
    return pending[node] if found is None else found


def reads_grad(graph: Graph, kid: int) -> bool:
    """Whether the callable of key ``kid`` reads a tensor that requires grad among
    those known: a module's parameters, a function's captured tensors (as they are at
    hand-out, for a module frozen or unfrozen since). Once per key per graph."""
    found = graph.key_reads_grad.get(kid)
    if found is None:
        fn = graph.keys[kid].fn
        found = not _pure(fn) and any(t.requires_grad for t in graph._parts_of(fn).params)
        graph.key_reads_grad[kid] = found
    return found


def _hides_grad(key: BatchKey) -> bool:
    """Whether calls of ``key`` give values that require grad from inputs that do not,
    through tensors found neither among a module's parameters nor a function's
    captured tensors (``self.cache.w``, a plain tensor attribute of a module)."""
    if _pure(key.fn):
        return False
    found = _FAKE_RUNS.get(key)
    if found is None:
        found = _FAKE_RUNS[key] = _fake_run_requires_grad(key.fn, key.call)
    return found


def _pure(fn: Any) -> bool:
    """Whether ``fn`` computes only from its arguments: C functions and methods, and
    torch's own Python functions (torch.nn.functional, Tensor.split...)."""
    return not isinstance(fn, torch.nn.Module) and torchs_own(fn)


def _fake_run_requires_grad(fn: Any, call: CallSignature) -> bool:
    """Whether ``call`` on fake inputs that do not require grad returns a value that
    does; True (hand values out as computed) when the fake run fails."""
    from batchgraph.inference import fake_apply  # inference imports much; only here

    try:
        with torch.inference_mode(False), torch.enable_grad():
            out = fake_apply(fn, call)
    except Exception:
        return True
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves(out))
