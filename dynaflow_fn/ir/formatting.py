"""How Programs and Plans are spelled as text: op names, values, calls, types and headers.

One spelling serves every reader: `print(program)` and `print(plan)` share their header (the passes
that ran, the streams, the static and closed-over inputs) and spell values and calls alike, and
`Program.python` writes runnable source with the same calls, passing its own `callee` and `literal`
where Python needs a full op path (`torch.ops.aten.mm.default`) or a value `repr` does not spell as
code. How a Plan lays out its steps and buffers is `plan.formatting`, built from these pieces.
"""

from __future__ import annotations

import operator
import re
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import torch
from torch import fx

from .ops import op_info
from ..compat import OpOverload
from .node_info import NodeInfo, info
from .scopes import ScopeKind
from .signature import Signature
from .tree import contiguous_strides

if TYPE_CHECKING:
    from .program import Program, Stream


def op_name(target: Any) -> str:
    """`aten.mm` for default overloads, `aten.add.Tensor` otherwise (`OpInfo.name`); Python callables by name."""
    info = op_info(target)
    if info is not None:
        return info.name
    if target is operator.getitem:
        return "getitem"
    return getattr(target, "__name__", str(target))


def _bracketed(items: Sequence[str], value: list | tuple) -> str:
    """`[a, b]` for a list, `(a, b)` for a tuple, and `(a,)` for a tuple of one, as Python writes it."""
    inner = ", ".join(items)
    if isinstance(value, list):
        return f"[{inner}]"
    return f"({inner}{',' if len(items) == 1 else ''})"


def format_arg(arg: Any, literal: Callable[[Any], str] = repr) -> str:
    """A value as source text, the one spelling of nodes' and steps' arguments: nodes by name, lists
    and tuples item by item, and any other value as `literal` spells it (`repr`: `torch.float32`,
    `-inf`, `device(type='cpu')`; a plan passes one that names its slots)."""
    if isinstance(arg, fx.Node):
        return arg.name
    if isinstance(arg, (list, tuple)):
        return _bracketed([format_arg(a, literal) for a in arg], arg)
    return literal(arg)


def format_call(node: fx.Node, callee: Callable[[Any], str] = op_name, literal: Callable[[Any], str] = repr) -> str:
    """`aten.mm(a, b)`, or `x[0]` for a getitem; `callee` names the target, `literal` spells constants."""
    args = [format_arg(a, literal) for a in node.args]
    args += [f"{k}={format_arg(v, literal)}" for k, v in node.kwargs.items()]
    if node.target is operator.getitem:
        return f"{args[0]}[{args[1]}]"
    return f"{callee(node.target)}({', '.join(args)})"


# --- types and sizes ----------------------------------------------------------------------------

_DTYPE_NAMES = {
    torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
    torch.bool: "b8", torch.complex64: "c64", torch.complex128: "c128",
}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def type_str(value: Any) -> str:
    """`f32[8, 32]`, with strides shown only when the layout is not contiguous."""
    if isinstance(value, torch.Tensor):
        shape = list(value.shape)
        text = f"{dtype_name(value.dtype)}{shape}"
        if value.dim() and tuple(value.stride()) != contiguous_strides(value.shape):
            text += f"/stride{tuple(value.stride())}"
        return text
    if isinstance(value, (list, tuple)):
        return _bracketed([type_str(v) for v in value], tuple(value))
    return type(value).__name__


def format_bytes(nbytes: int) -> str:
    if nbytes < 1024:
        return f"{nbytes:.0f} B"
    size = nbytes / 1024
    for unit in ("KiB", "MiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


# --- the header Programs and Plans share --------------------------------------------------------


def title_line(what: str, provenance: Sequence[str]) -> str:
    """`# Program MLP  passes: trace -> ...`: what is printed, and the passes that made it."""
    return f"# {what}  passes: {' -> '.join(provenance) or '(none)'}"


def streams_line(streams: Sequence[Stream]) -> str | None:
    """`# streams: s0=main, s1=side(priority -1)`, or None on one stream, where there is nothing to say."""
    if len(streams) < 2:
        return None
    return "# streams: " + ", ".join(f"s{s.index}={s.name}" + (f"(priority {s.priority})" if s.priority else "")
                                     for s in streams)


def signature_lines(signature: Signature, closed_over_names: Sequence[str]) -> list[str]:
    """The static inputs, baked in, and the closed-over ones, each by the name the body reads it by
    (`closed_over_names`) and where it was found when that differs."""
    lines = []
    statics = [spec for spec in signature.inputs if not spec.is_tensor]
    if statics:
        lines.append("# static: " + ", ".join(f"{s.path}={s.static_value!r}" for s in statics))
    if signature.closed_over:
        pairs = zip(closed_over_names, signature.closed_over)
        lines.append("# closed over (resident, read every call): " +
                     ", ".join(f"{name}={c.name}" if name != c.name else name for name, c in pairs))
    return lines


def header(title: str, provenance: Sequence[str], streams: Sequence[Stream], signature: Signature,
           closed_over_names: Sequence[str]) -> list[str]:
    """The comment lines above a printed Program or Plan."""
    lines = [title_line(title, provenance), streams_line(streams), *signature_lines(signature, closed_over_names)]
    return [line for line in lines if line is not None]


# --- Programs -----------------------------------------------------------------------------------


def annotation_str(node_info: NodeInfo) -> str:
    """The trailing comment of a printed node: where it came from and how it is scheduled."""
    parts = []
    modules = [s for s in node_info.scopes if s.kind is ScopeKind.MODULE]
    if modules:
        parts.append(str(modules[-1]))
    parts += [str(s) for s in node_info.scopes if s.kind in (ScopeKind.REGION, ScopeKind.SUBSTITUTION)]
    if node_info.mb is not None:
        parts.append(f"mb={node_info.mb}")
    if node_info.stage is not None:
        parts.append(f"stage={node_info.stage}")
    if node_info.tags:
        parts.append("[" + ",".join(sorted(node_info.tags)) + "]")
    if node_info.kind is not None:
        parts.append(str(node_info.kind))
    if node_info.stream is not None:
        parts.append(f"s{node_info.stream}")
    if node_info.order is not None:
        parts.append(f"#{node_info.order}")
    return " ".join(parts)


def _lines_with_comments(rows: Iterable[tuple[str, str]], indent: str = "    ") -> list[str]:
    rows = list(rows)
    width = min(max((len(code) for code, _ in rows), default=0), 88)
    return [f"{indent}{code:<{width}}  # {comment}" if comment else f"{indent}{code}" for code, comment in rows]


SUMMARIZED_ARGUMENT_TENSORS = 8
"""An argument holding more tensors than this (a model's parameters) prints as one line of the signature."""


def _argument_name(path: str) -> str:
    """The top-level argument a leaf belongs to: `params` for `params['fc.weight']`."""
    return re.match(r"[^\[]*", path).group()


def _short_count(number: int) -> str:
    """`4.74M` for 4,738,560: three significant digits are enough to tell a model's size."""
    for unit, size in (("B", 10**9), ("M", 10**6), ("k", 10**3)):
        if number >= size:
            return f"{number / size:.3g}{unit}"
    return str(number)


def _parameter_entries(program: Program) -> list[str]:
    """`name: type` per input, except that an argument of many tensors becomes one summary entry:
    listing a model's hundreds of parameters would bury the ops below them. Their names still show
    where the body reads them, and `program.placeholders()` has every type."""
    argument_of = {spec.node_name: _argument_name(spec.path) for spec in program.inputs if spec.is_tensor}
    groups: dict[str, list[fx.Node]] = {}
    for placeholder in program.placeholders():
        groups.setdefault(argument_of.get(placeholder.name, placeholder.name), []).append(placeholder)
    entries = []
    for argument, placeholders in groups.items():
        if len(placeholders) <= SUMMARIZED_ARGUMENT_TENSORS:
            entries += [f"{p.name}: {type_str(p.meta.get('val'))}" for p in placeholders]
            continue
        tensors = [p.meta["val"] for p in placeholders if isinstance(p.meta.get("val"), torch.Tensor)]
        dtypes = "/".join(sorted({dtype_name(t.dtype) for t in tensors}))
        entries.append(f"{argument}: {len(placeholders)} tensors ({placeholders[0].name} ... {placeholders[-1].name}), "
                       f"{_short_count(sum(t.numel() for t in tensors))} {dtypes} elements")
    return entries


def program_header(program: Program) -> list[str]:
    """The comment lines above a printed program (and its `python()` source)."""
    return header(f"Program {program.name}", program.provenance, program.streams, program.signature,
                  [p.name for p in program.closed_over_placeholders()])


def format_program(program: Program) -> str:
    parameters = _parameter_entries(program)
    signature = ", ".join(parameters)
    if len(signature) > 80:
        signature = "\n" + "".join(f"    {p},\n" for p in parameters)
    rows = []
    for node in program.graph.nodes:
        if node.op == "call_function":
            rows.append((f"{node.name}: {type_str(node.meta.get('val'))} = {format_call(node)}",
                         annotation_str(info(node))))
        elif node.op == "get_attr":
            rows.append((f"{node.name}: {type_str(node.meta.get('val'))} = <constant>", ""))
        elif node.op == "output":
            rows.append((f"return {format_arg(node.args[0])}", ""))
    body = _lines_with_comments(rows)
    return "\n".join(program_header(program) + [f"def {program.name}({signature}):"] + body)
