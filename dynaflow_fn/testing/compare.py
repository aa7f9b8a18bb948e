"""Compare two results leaf by leaf and say, in words a user can act on, where they first differ."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import optree
import torch

from ..ir.tree import output_path_to_str


def first_difference(got: Any, expected: Any, exact: bool = False) -> str | None:
    """None if `got` matches `expected` (bit for bit with `exact`, else within the dtype's tolerance,
    as `torch.testing.assert_close` judges); otherwise what differs: the structure, or the first
    leaf (by its path, `out[1]['logits']`) with its largest difference and where it is."""
    got_paths, got_leaves, got_tree = optree.tree_flatten_with_path(got, none_is_leaf=True)
    _, expected_leaves, expected_tree = optree.tree_flatten_with_path(expected, none_is_leaf=True)
    if got_tree != expected_tree:
        return f"the result has structure {got_tree}, expected {expected_tree}"
    for path, a, b in zip(got_paths, got_leaves, expected_leaves):
        problem = _leaf_difference(a, b, exact)
        if problem is not None:
            return f"{output_path_to_str(path)} {problem}"
    return None


def _leaf_difference(got: Any, expected: Any, exact: bool) -> str | None:
    if isinstance(got, np.ndarray) and isinstance(expected, np.ndarray):   # compared as tensors are
        got, expected = torch.from_numpy(got), torch.from_numpy(expected)
    tensors = isinstance(got, torch.Tensor), isinstance(expected, torch.Tensor)
    if tensors == (False, False):
        return None if _same_number(got, expected, exact) else f"is {got!r}, expected {expected!r}"
    if not all(tensors):                        # `tensor == 3` is a tensor, no answer: say what each is
        return f"is {_described(got)}, expected {_described(expected)}"
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return (f"is {_kind(got)}, expected {_kind(expected)}")
    if got.is_meta or expected.is_meta:         # shapes and dtypes only: a meta tensor holds no values
        return None if got.is_meta and expected.is_meta else \
            f"is a {'meta' if got.is_meta else got.device.type} tensor, expected a " \
            f"{'meta' if expected.is_meta else expected.device.type} one: values of meta tensors cannot be compared"
    got, expected = got.detach().cpu(), expected.detach().cpu()
    try:
        torch.testing.assert_close(got, expected, equal_nan=True, **({"rtol": 0, "atol": 0} if exact else {}))
    except AssertionError:
        return _largest(got, expected, exact)
    return None


def _same_number(got: Any, expected: Any, exact: bool) -> bool:
    """Non-tensor leaves: equal, or (not `exact`) floats within float32's tolerance; NaN matches NaN,
    as it does in tensors."""
    if isinstance(got, float) and isinstance(expected, float):
        if math.isnan(got) and math.isnan(expected):
            return True
        return got == expected or (not exact and math.isclose(got, expected, rel_tol=1.3e-6, abs_tol=1e-5))
    same = got == expected
    return same if isinstance(same, bool) else False


def _tolerance(dtype: torch.dtype) -> float:
    """A rough per-dtype scale for ranking elements; `assert_close` decides what passes."""
    return {torch.float16: 1e-3, torch.bfloat16: 1.6e-2, torch.float64: 1e-7}.get(dtype, 1.3e-6)


def _described(value: Any) -> str:
    return f"a tensor {_kind(value)}" if isinstance(value, torch.Tensor) else f"{type(value).__name__} {value!r}"


def _kind(tensor: torch.Tensor) -> str:
    return f"{str(tensor.dtype).replace('torch.', '')}{list(tensor.shape)}"


def _largest(got: torch.Tensor, expected: torch.Tensor, exact: bool) -> str:
    """The worst element (the largest difference; within tolerance, the largest relative to the
    tolerance at that element) and its index. A NaN on one side only counts as infinitely far."""
    wide = torch.complex128 if got.dtype.is_complex else torch.float64   # float64 would drop imaginary parts
    a, b = got.to(wide), expected.to(wide)
    difference = (a - b).abs()
    difference = torch.where(torch.isnan(a) & torch.isnan(b), 0.0, difference)
    difference = torch.where(difference.isnan(), float("inf"), difference)
    badness = difference if exact else difference / (_tolerance(got.dtype) * (1 + b.abs()))
    flat = int(badness.reshape(-1).argmax()) if difference.numel() else 0
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), got.shape)) if got.dim() else ()
    how = "bit for bit" if exact else "within the dtype's tolerance"
    return (f"differs (compared {how}): {'largest' if exact else 'worst'} difference "
            f"{float(difference.reshape(-1)[flat]):.3g} at index {list(index)}, got {_number(a.reshape(-1)[flat])}, "
            f"expected {_number(b.reshape(-1)[flat])}")


def _number(value: torch.Tensor) -> str:
    return f"{complex(value):.6g}" if value.is_complex() else f"{float(value):.6g}"
