"""How the nodes of a Program are spelled as text: op names, arguments and calls.

One spelling serves every reader: `print(program)` and `print(plan)` show calls with it, and
`Program.python` writes runnable source with it, passing its own `callee` and `literal` where
Python needs a full op path (`torch.ops.aten.mm.default`) or a value `repr` does not spell as code.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

from torch import fx

from .ops import op_info


def op_name(target: Any) -> str:
    """`aten.mm` for default overloads, `aten.add.Tensor` otherwise (`OpInfo.name`); Python callables by name."""
    info = op_info(target)
    if info is not None:
        return info.name
    if target is operator.getitem:
        return "getitem"
    return getattr(target, "__name__", str(target))


def format_arg(arg: Any, literal: Callable[[Any], str] = repr) -> str:
    """An argument of a node as source text: nodes by name, lists and tuples item by item, and any
    other value as `literal` spells it (`repr`: `torch.float32`, `-inf`, `device(type='cpu')`)."""
    if isinstance(arg, fx.Node):
        return arg.name
    if isinstance(arg, (list, tuple)):
        inner = ", ".join(format_arg(a, literal) for a in arg)
        return f"[{inner}]" if isinstance(arg, list) else f"({inner}{',' if len(arg) == 1 else ''})"
    return literal(arg)


def format_call(node: fx.Node, callee: Callable[[Any], str] = op_name, literal: Callable[[Any], str] = repr) -> str:
    """`aten.mm(a, b)`, or `x[0]` for a getitem; `callee` names the target, `literal` spells constants."""
    args = [format_arg(a, literal) for a in node.args]
    args += [f"{k}={format_arg(v, literal)}" for k, v in node.kwargs.items()]
    if node.target is operator.getitem:
        return f"{args[0]}[{args[1]}]"
    return f"{callee(node.target)}({', '.join(args)})"
