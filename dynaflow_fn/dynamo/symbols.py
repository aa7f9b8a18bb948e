"""Dynamo's size symbols (`s0`, `s1`) as they appear in the sizes of a graph's values."""

from __future__ import annotations

import re
from typing import Any

import torch

SYMBOL = re.compile(r"[A-Za-z_]\w*")
"""A symbol's name: sizes print as expressions of them (`s0`, `2*s0 + 1`)."""


def mentions(value: Any, symbols: set[str]) -> bool:
    """Whether `value` is a symbolic number (a size, or a float or bool computed from sizes) whose
    expression names one of `symbols`."""
    return isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)) and bool(
        symbols & set(SYMBOL.findall(str(value))))
