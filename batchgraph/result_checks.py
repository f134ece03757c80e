"""Checks of a batched call's results against what its calls, run one at a time, return.

Every call is recorded with the spec of its eager result (shape, dtype, device and
nesting, found on fake tensors). A batching rule, built-in or a user's ``BatchKey``,
that loses an example's meaning mostly shows there: the executor checks each step's
results once per step (``check_stacked``), or once per example for rules that return
per-example results (``check_columns``), so a wrong rule fails with
``BatchedCallError`` instead of handing out other values. The checks cost nothing per
call; one that keeps every spec right is caught by the property tests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from batchgraph.errors import BatchedCallError
from batchgraph.keys import BatchKey, UnbatchedKey, VmapKey, callable_name
from batchgraph.specs import OutSpec, TensorSpec, spec_leaves

__all__ = ["check_columns", "check_stacked", "rule_advice"]


def check_stacked(
    key: BatchKey, leaves: list[torch.Tensor], specs: Sequence[Any], size: int, *,
    autocast: bool,
) -> None:
    """The output leaves of a stacked step of ``size`` calls against their per-example
    ``specs``. Under ``autocast``, a leaf of another dtype is cast to the eager one in
    place (vmap runs some ops out of autocast's reach, prelu).

    Raises:
        BatchedCallError: for another number of leaves, a missing batch dimension, or
            another per-example shape, dtype or device.
    """
    if len(leaves) != len(specs):
        raise BatchedCallError(
            f"{key.label} returned {len(leaves)} tensors for a batch; its calls, run "
            f"one at a time, return {len(specs)}"
        )
    for i, (leaf, spec) in enumerate(zip(leaves, specs)):
        shape = leaf.shape
        if not shape or shape[0] != size:
            raise BatchedCallError(
                f"{key.label} returned shape {tuple(shape)} for a batch of {size} "
                f"calls; a batched output needs a leading dimension of {size}. If this "
                f"callable does not take a leading batch dimension, {rule_advice(key)}"
            )
        if not isinstance(spec, TensorSpec):
            continue
        if shape[1:] != spec.shape:
            raise BatchedCallError(
                f"{key.label} returned per-example shape {tuple(shape[1:])} for a batch "
                f"of {size} calls, where each call run alone returns {spec.shape}: its "
                f"batching rule does not keep each example's meaning. {rule_advice(key)}"
            )
        if leaf.dtype != spec.dtype:
            if not autocast:
                raise BatchedCallError(
                    f"{key.label} returned {leaf.dtype} for a batch of {size} calls, "
                    f"where each call run alone returns {spec.dtype}: its batching rule "
                    f"does not keep each example's type promotion. {rule_advice(key)}"
                )
            leaves[i] = leaf.to(spec.dtype)
        if leaf.device != spec.device:
            raise BatchedCallError(
                f"{key.label} returned a tensor on {leaf.device} for a batch of {size} "
                f"calls, where each call run alone returns one on {spec.device}: its "
                f"batching rule moves the results. {rule_advice(key)}"
            )


def check_columns(
    key: BatchKey, nodes: Sequence[int], flat: list[list[torch.Tensor]],
    node_spec: Sequence[OutSpec], *, autocast: bool,
    example_of: Callable[[int], int | None],
) -> None:
    """Each example's results of a ``combine="list"`` rule (``flat``: per node of
    ``nodes``, its leaves) against the spec its call was recorded with.

    Checked per example, not per batch: the examples of one list batch may have
    shapes of their own (``PackedSequenceKey``'s lengths), so a rule that hands
    them back in another order is caught too wherever their shapes differ.
    Leaves are fixed up in place where autocast explains a dtype.

    Raises:
        BatchedCallError: naming the example (``example_of``) and its row.
    """
    for row, (node, leaves) in enumerate(zip(nodes, flat)):
        # A graph bound from a PortableBatch has no specs; an output whose
        # structure was unknown when recorded (spec None) has nothing to check.
        spec = node_spec[node] if node < len(node_spec) else None
        if spec is None:
            continue
        specs = spec_leaves(spec)
        example = example_of(node)
        where = f"example {example}" if example is not None else f"node {node}"
        if len(leaves) != len(specs):
            raise BatchedCallError(
                f"{key.label} returned {len(leaves)} tensor(s) for {where} (row {row} "
                f"of a batch of {len(nodes)}), where its call run alone returns "
                f"{len(specs)}: its run() must return each example's result as the "
                "callable returns it."
            )
        for i, (leaf, leaf_spec) in enumerate(zip(leaves, specs)):
            if not isinstance(leaf_spec, TensorSpec):
                continue
            if leaf.shape != leaf_spec.shape or leaf.device != leaf_spec.device or (
                    leaf.dtype != leaf_spec.dtype and not autocast):
                if type(key) is UnbatchedKey:
                    # It ran the call as eager code does: the spec was wrong, not the rule.
                    raise BatchedCallError(
                        f"{callable_name(key.fn)} returned a {tuple(leaf.shape)} "
                        f"{leaf.dtype} tensor on {leaf.device} (output {i}) for {where}, "
                        f"run alone as eager code runs it, where its run on fake tensors "
                        f"gave {leaf_spec.describe()} when it was recorded: torch's fake "
                        "and real runs of it disagree (x.nansum(dim=[]) does; write it "
                        "another way, x.nansum()), or it reads state changed since."
                    )
                raise BatchedCallError(
                    f"{key.label} returned a {tuple(leaf.shape)} {leaf.dtype} tensor on "
                    f"{leaf.device} (output {i}) for {where} (row {row} of a batch of "
                    f"{len(nodes)}), where its call run alone returns "
                    f"{leaf_spec.describe()}: its batching rule "
                    "does not keep each example's meaning (or returns the examples "
                    f"in another order than it got them). {rule_advice(key)}"
                )
            if leaf.dtype != leaf_spec.dtype:  # under autocast, as for stacked results
                leaves[i] = leaf.to(leaf_spec.dtype)


def rule_advice(key: BatchKey) -> str:
    """What to do about a rule whose batched results do not match its calls: the
    general rule, or for vmap itself (an op it batches wrongly) one call at a time.

    Example:
        >>> from batchgraph.keys import StackKey
        >>> from batchgraph.specs import CallSignature
        >>> rule_advice(StackKey(torch.tanh, CallSignature((), (), (), None)))
        'Register VmapKey for it: BatchingPolicy(rules={torch.tanh: bg.VmapKey}).'
    """
    other = "UnbatchedKey" if isinstance(key, VmapKey) else "VmapKey"
    fn = key.fn
    target = type(fn).__name__ if isinstance(fn, torch.nn.Module) else callable_name(fn)
    return f"Register {other} for it: BatchingPolicy(rules={{{target}: bg.{other}}})."
