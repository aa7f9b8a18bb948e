"""A Dynamo graph's node in the words of the code it came from, for messages."""

from __future__ import annotations

import re

from torch import fx


def op_text(node: fx.Node) -> str:
    """A Dynamo graph's call as its user wrote it: `Tensor.view`, `mul`, `torch.full`."""
    target = node.target
    if node.op == "call_method":
        return f"Tensor.{target}"
    return getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)


def where(node: fx.Node) -> str:
    """` at file:line (`code`)` for the user's line in a node's stack trace; empty without one."""
    lines = [line.strip() for line in (node.stack_trace or "").strip().splitlines()]
    frames = [(i, frame) for i, line in enumerate(lines) if (frame := _FRAME.match(line))]
    if not frames:
        return ""
    index, frame = frames[-1]
    code = f" (`{lines[index + 1]}`)" if index + 1 < len(lines) else ""
    return f" at {frame['file']}:{frame['line']}{code}"


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')
