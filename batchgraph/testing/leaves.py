"""The leaves of a per-example result, by path, and how two of them are compared.

``assert_batched_matches_eager`` walks an eager and a batched result the same way:
lists, tuples, dicts and dataclasses (as ``bg.compute`` and ``run_all`` hand them back)
down to tensors and plain values. Plain values count too: a coroutine decoder returns
the token ids it chose (``int(await bg.value(logits.argmax()))``), and a check that
compared only tensors would pass a batched run that chose other tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from batchgraph.specs import dataclass_fields

__all__ = ["Leaf", "first_difference", "flatten", "scalar_differs"]

# A leaf: its path ("example 2: output[0].logits") and its value, a tensor or a plain
# value (int, float, complex, bool, str, bytes or None). Other objects are not leaves:
# their equality means nothing in general (a fresh object per call compares unequal).
Leaf = tuple[str, Any]

_PLAIN = (int, float, complex, bool, str, bytes, type(None))


def flatten(value: Any, path: str, out: list[Leaf]) -> None:
    """Append ``value``'s leaves to ``out``, each with its path below ``path``.

    Example:
        >>> import dataclasses
        >>> @dataclasses.dataclass
        ... class Out:
        ...     h: Any
        ...     n: int
        >>> leaves: list[Leaf] = []
        >>> flatten([Out(torch.zeros(2), 3), {"k": None}], "out", leaves)
        >>> [path for path, _ in leaves]
        ['out[0].h', 'out[0].n', "out[1]['k']"]
    """
    if isinstance(value, (torch.Tensor, *_PLAIN)):
        out.append((path, value))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            flatten(v, f"{path}[{i}]", out)
    elif isinstance(value, dict):
        for k, v in value.items():
            flatten(v, f"{path}[{k!r}]", out)
    elif (names := dataclass_fields(value)) is not None:
        for name in names:
            flatten(getattr(value, name), f"{path}.{name}", out)


def first_difference(eager: list[Leaf], batched: list[Leaf]) -> str | None:
    """Where the two results' structures first part, or None where they match.

    Example:
        >>> first_difference([("a[0]", 1), ("a[1]", 2)], [("a[0]", 1)])
        'eager has a[1], batched has nothing more'
    """
    for (e, _), (b, _) in zip(eager, batched):
        if e != b:
            return f"eager has {e}, batched has {b}"
    if len(eager) != len(batched):
        longer, name = (eager, "eager") if len(eager) > len(batched) else (batched, "batched")
        other = "batched" if name == "eager" else "eager"
        return f"{name} has {longer[min(len(eager), len(batched))][0]}, {other} has nothing more"
    return None


def scalar_differs(eager: Any, batched: Any, rtol: float, atol: float) -> bool:
    """Whether two plain leaves differ: numbers within the tolerances (NaN matching
    NaN), anything else by type and equality (``1`` and ``True`` differ).

    Example:
        >>> scalar_differs(1.0, 1.0 + 1e-9, 1e-5, 1e-6), scalar_differs(1, True, 0, 0)
        (False, True)
    """
    if type(eager) is not type(batched):
        return True
    if isinstance(eager, (float, complex)):
        eager_nan, batched_nan = eager != eager, batched != batched  # complex NaN too
        if eager_nan or batched_nan:
            return not (eager_nan and batched_nan)
        if eager == batched:  # equal infinities, whose difference is NaN
            return False
        # As torch.allclose(batched, eager, rtol, atol) compares tensors.
        return not abs(eager - batched) <= atol + rtol * abs(eager)
    return bool(eager != batched)
