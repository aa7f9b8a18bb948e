"""The warning for a jitted function that keeps tracing: which argument keeps changing, by its path."""

from __future__ import annotations

from typing import Any, Callable

from ..errors import warn
from ..ir import tree
from ..ir.program import dtype_name

RETRACE_WARNING_ENTRIES = 8
"""Plans a jitted function holds before each further trace warns."""


def warn_retracing(fn: Callable[..., Any], previous: Any, key: Any, args: tuple, kwargs: dict, traced: int) -> None:
    """Warn that `fn` is traced for the `traced`-th signature, naming what differs from the `previous` key."""
    warn(
        f"{getattr(fn, '__name__', 'fn')} has been traced for {traced} different input "
        f"signatures ({_describe_change(previous, key, args, kwargs, fn)}). Each new shape, dtype, device "
        f"or static value traces and captures again; pad inputs to a few fixed shapes, or pass changing "
        f"scalars as tensors.")


def _describe_change(old: Any, new: Any, args: tuple, kwargs: dict, fn: Callable[..., Any]) -> str:
    """Say which argument differs between two cache keys, by its path."""
    old_tree, old_leaves, old_state = old
    new_tree, new_leaves, new_state = new
    if old_tree != new_tree:
        return f"the argument structure changed from {old_tree} to {new_tree}"
    if old_state != new_state:
        return ("process-wide settings changed (autocast, the default dtype or device, deterministic algorithms "
                "or matmul precision)")
    paths, _, _ = tree.flatten((args, kwargs))
    arg_names = tree.argument_names(fn, len(args))
    for path, a, b in zip(paths, old_leaves, new_leaves):
        if a != b:
            return f"{tree.path_to_str(path, arg_names)} changed from {_leaf_text(a)} to {_leaf_text(b)}"
    return ("the same signature: the Python state of a module it reads changed (a hook, submodule, parameter "
            "or attribute), or a train/eval mode")


def _leaf_text(leaf_key: tuple) -> str:
    if len(leaf_key) == 4:
        shape, _, dtype, device = leaf_key
        return f"{dtype_name(dtype)}{list(shape)} on {device}"
    kind, value = leaf_key[0], leaf_key[1]
    if kind is float:
        return "nan" if value == "nan" else repr(float.fromhex(value))
    return repr(value)
