"""The per-call check of a `guard.Guard` in one C++ call: torch.compile's guard manager on df.jit's leaves.

A call that the entry used last admits pays this check and then the replay, so the check is most of
what df.jit adds to a call. In Python, reading one tensor's shape, strides, dtype and device costs
about half a microsecond: for a model called with its parameters (hundreds of tensors) that is longer
than the replay. torch's C++ guards (`compat.leaf_checker`) compare the same fields in about a
tenth of that. What they check, with the meaning `Guard` gives each part:

* every tensor leaf, and every tensor the function closes over, by layout: TENSOR_MATCH compares the
  shape, strides, dtype and device, and also the Python type, dispatch keys and requires_grad, so a
  call that differs only there is checked in full and then runs the same plan;
* static leaves of the types whose `==` is their `static_key` equality (`_EQUAL_BY_KEY`: ints, bools,
  strings, bytes, dtypes, devices, and floats other than zeros and NaN), by exact type and `==`. The
  others are left to the caller (`NativeCheck.python_positions`): `==` calls -0.0 equal to 0.0 and no
  NaN equal to another, and a dataclass compares its float fields the same lossy way;
* the `training` flag of every module whose flag the trace read.

The pytree structure and `call_state` are compared in Python (a fraction of a microsecond, and about
a microsecond to read the state). DYNAFLOW_PYTHON_GUARD=1 builds every guard with the Python check
instead, to compare the two or to rule this one out.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .. import compat

PYTHON_GUARD_ENV = "DYNAFLOW_PYTHON_GUARD"

_EQUAL_BY_KEY = frozenset({int, bool, str, bytes, torch.dtype, torch.device, torch.layout, torch.memory_format})


@dataclass(frozen=True)
class NativeCheck:
    """A C++ check of a call's leaves (and of the modules and closed-over tensors it was built with),
    except for the static leaves at `python_positions`, which the caller compares by key."""

    check: Callable[[Sequence[Any]], bool]
    python_positions: tuple[int, ...]


def native_check(leaves: Sequence[Any], modules: Sequence[torch.nn.Module],
                 closed_over: Sequence[torch.Tensor]) -> NativeCheck | None:
    """The C++ check of calls like this one, or None where torch's guards are unavailable (or
    DYNAFLOW_PYTHON_GUARD=1): the caller then checks everything in Python."""
    if os.environ.get(PYTHON_GUARD_ENV) == "1":
        return None
    native = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) or _equal_by_key(leaf)]
    chosen = set(native)
    python_positions = tuple(i for i in range(len(leaves)) if i not in chosen)
    fixed = (*modules, *closed_over)
    if not fixed:
        check = compat.leaf_checker(list(leaves), [compat.LeafCheck((i,)) for i in native])
        return None if check is None else NativeCheck(check, python_positions)
    checks = [compat.LeafCheck((0, i)) for i in native]
    checks += [compat.LeafCheck((1, k), "training") for k in range(len(modules))]
    checks += [compat.LeafCheck((1, k)) for k in range(len(modules), len(fixed))]
    both = compat.leaf_checker((list(leaves), fixed), checks)
    if both is None:
        return None
    return NativeCheck(lambda leaves: both((leaves, fixed)), python_positions)


def _equal_by_key(leaf: Any) -> bool:
    """Whether `a == leaf` with `type(a) is type(leaf)` means `static_key(a) == static_key(leaf)`."""
    if type(leaf) is float:
        return leaf != 0.0 and leaf == leaf                    # not a zero (signed), not a NaN
    return type(leaf) in _EQUAL_BY_KEY
