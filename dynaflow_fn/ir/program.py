"""The Program: a traced, functional aten graph plus everything transforms and lowering need.

A Program is immutable from the outside: transforms build a new one (`Program.annotate`,
`Program.with_graph`) and append a provenance line, so `print(program)` shows what happened to it;
`program.python()` writes the same program as Python source that runs on its own.
Per-node annotations live in `node.meta["df"]` as a frozen `NodeInfo`.
"""

from __future__ import annotations

import dataclasses
import operator
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import optree
import torch
from torch import fx

from .formatting import format_arg, format_call
from .python_source import python_source
from .scopes import Scope

_DTYPE_NAMES = {
    torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
    torch.bool: "b8", torch.complex64: "c64", torch.complex128: "c128",
}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


def type_str(value: Any) -> str:
    """`f32[8, 32]`, with strides shown only when the layout is not contiguous."""
    if isinstance(value, torch.Tensor):
        shape = list(value.shape)
        text = f"{dtype_name(value.dtype)}{shape}"
        if value.dim() and tuple(value.stride()) != contiguous_strides(value.shape):
            text += f"/stride{tuple(value.stride())}"
        return text
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(type_str(v) for v in value) + ")"
    return type(value).__name__


@dataclass(frozen=True)
class NodeInfo:
    """Annotations of one node. Written by transforms, read by lowering and printing.

    scopes: module calls, regions and micro-batch bodies the node was traced inside, outermost first.
    stage:  the stage (a group of nodes scheduled as one unit) that `partition` put it in.
    tags:   free-form labels from partition rules (e.g. "attn", "comm", "no-inductor").
    kind:   "compute", "memory", "comm" or "view", from the cost model.
    stream: the stream the schedule placed it on; order: its position in the issue order.
    after:  stages that must finish before this node starts, though it reads nothing of theirs: the
            schedule's pacing edges.
    """

    scopes: tuple[Scope, ...] = ()
    stage: int | None = None
    tags: frozenset[str] = frozenset()
    kind: str | None = None
    stream: int | None = None
    order: int | None = None
    after: tuple[int, ...] = ()

    @property
    def mb(self) -> int | None:
        """The micro-batch this node computes, or None for nodes shared by all micro-batches."""
        for scope in reversed(self.scopes):
            if scope.kind == "microbatch":
                return scope.index
        return None

    def replace(self, **changes: Any) -> "NodeInfo":
        return dataclasses.replace(self, **changes)


_EMPTY_INFO = NodeInfo()


def info(node: fx.Node) -> NodeInfo:
    return node.meta.get("df", _EMPTY_INFO)


@dataclass(frozen=True)
class InputSpec:
    """One leaf of the (args, kwargs) pytree: a tensor input (a placeholder) or a static value."""

    path: str
    node_name: str | None
    static_value: Any = None

    @property
    def is_tensor(self) -> bool:
        return self.node_name is not None


@dataclass(frozen=True)
class OutputSpec:
    """One leaf of the returned pytree: the index of a tensor in the output node, or a static value."""

    path: str
    tensor_index: int | None
    static_value: Any = None


@dataclass(frozen=True, eq=False)
class Captured:
    """A tensor the traced function closes over, an input read in place on every call (`closure`):
    `name` is where it was found (`params['fc.weight']`)."""

    name: str
    tensor: torch.Tensor


@dataclass(frozen=True)
class Stream:
    """A stream of a schedule. Priority follows CUDA: lower numbers run first when both are ready."""

    index: int
    name: str
    priority: int = 0


@dataclass(frozen=True)
class Program:
    """A traced function: an aten-level functional FX graph with input/output pytree specs.

    The graph's placeholders are the tensor leaves of the arguments, in flatten order, then the
    `captured` tensors the function closes over (see `closure`). `module_modes` records the
    `training` flag of every module whose flag the trace read, which the traced ops depend on
    (dropout, batch norm; see `mode_reads`). `objects_read` are the modules the trace called or found
    in the function's closure and the instance of a bound method, whose Python attributes (hooks,
    submodules, parameters, plain attributes) the traced ops depend on too. `gradient_flow` says which
    outputs eager autograd would connect to which inputs, and which inputs the function updates in
    place while gradients are recorded (`tracing/gradients.py`). Calling a Program runs its graph
    eagerly, which is handy as a reference. Printing it shows code.
    """

    graph_module: fx.GraphModule
    name: str
    inputs: tuple[InputSpec, ...]
    in_tree: optree.PyTreeSpec
    outputs: tuple[OutputSpec, ...]
    out_tree: optree.PyTreeSpec
    provenance: tuple[str, ...] = ()
    streams: tuple[Stream, ...] = (Stream(0, "main"),)
    sm_carveout: int | None = None   # T.overlap(comm_ctas=N): SMs each kernel beside a collective leaves it
    source: Any = field(default=None, compare=False)
    passes: tuple[Any, ...] = field(default=(), compare=False)
    captured: tuple[Captured, ...] = field(default=(), compare=False)
    module_modes: tuple[tuple[torch.nn.Module, bool], ...] = field(default=(), compare=False)
    objects_read: tuple[Any, ...] = field(default=(), compare=False)
    gradient_flow: Any = field(default=None, compare=False)

    @property
    def graph(self) -> fx.Graph:
        return self.graph_module.graph

    def placeholders(self) -> list[fx.Node]:
        return [n for n in self.graph.nodes if n.op == "placeholder"]

    @property
    def device(self) -> torch.device:
        """Where the program runs: the device of its first tensor input (the CPU if it has none)."""
        return next((n.meta["val"].device for n in self.placeholders() if isinstance(n.meta.get("val"), torch.Tensor)),
                    torch.device("cpu"))

    def captured_placeholders(self) -> list[fx.Node]:
        """The placeholders bound to the `captured` tensors, which come after the arguments'."""
        placeholders = self.placeholders()
        return placeholders[len(placeholders) - len(self.captured):]

    def output_node(self) -> fx.Node:
        return next(n for n in reversed(self.graph.nodes) if n.op == "output")

    def ops(self) -> list[fx.Node]:
        """The call_function nodes, in trace order."""
        return [n for n in self.graph.nodes if n.op == "call_function"]

    def is_scheduled(self) -> bool:
        return any(info(n).order is not None for n in self.ops())

    def issue_order(self) -> list[fx.Node]:
        """The call_function nodes in the order they are issued: the schedule's, else trace order.
        Nodes sharing a position keep their trace order."""
        nodes = self.ops()
        if not self.is_scheduled():
            return nodes
        return sorted(nodes, key=lambda n: -1 if info(n).order is None else info(n).order)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves = optree.tree_leaves((args, kwargs))
        tensors = [leaf for leaf, spec in zip(leaves, self.inputs) if spec.is_tensor]
        flat_out = self.graph_module(*tensors, *(c.tensor for c in self.captured))
        return self.unflatten_outputs(flat_out)

    def unflatten_outputs(self, tensors: Sequence[Any]) -> Any:
        leaves = [tensors[o.tensor_index] if o.tensor_index is not None else o.static_value for o in self.outputs]
        return optree.tree_unflatten(self.out_tree, leaves)

    def constants(self) -> dict[str, torch.Tensor]:
        """The tensors the program holds rather than receives, by the names it prints: the captured
        tensors (the very objects, so a call reads them as they are then) and the graph's constants."""
        values = {node.name: c.tensor for node, c in zip(self.captured_placeholders(), self.captured)}
        values.update((node.name, operator.attrgetter(node.target)(self.graph_module))
                      for node in self.graph.nodes if node.op == "get_attr")
        return values

    def python(self) -> str:
        """This program as Python source that runs without dynaflow_fn: the printed header, `import
        torch`, and a function named after the program that calls each node's aten overload by its
        full path (`torch.ops.aten.mm.default`) and returns the flat list of output tensors.

        Its positional parameters are the tensor inputs, named as `print(program)` names them. The
        tensors of `constants()` (captured tensors and graph constants, which no literal can spell)
        are keyword-only parameters of the same names: `exec` the source, then
        `fn(*tensor_inputs, **program.constants())` returns what `program(*args)` flattens to.
        """
        return python_source(self, header_lines(self))

    # --- functional updates -------------------------------------------------------------------

    def annotate(self, update: Callable[[fx.Node, NodeInfo], NodeInfo], **changes: Any) -> "Program":
        """A new Program whose nodes carry `update(node, info)`; this one is left untouched."""
        program = self.with_graph(copy_graph_module(self.graph_module)[0], **changes)
        for node in program.graph.nodes:
            node.meta["df"] = update(node, info(node))
        return program

    def with_graph(self, graph_module: fx.GraphModule, **changes: Any) -> "Program":
        return dataclasses.replace(self, graph_module=graph_module, **changes)

    # --- printing ------------------------------------------------------------------------------

    def __str__(self) -> str:
        return format_program(self)

    def __repr__(self) -> str:
        return f"<Program {self.name}: {len(self.ops())} ops, passes: {', '.join(self.provenance)}>"


def copy_graph_module(graph_module: fx.GraphModule) -> tuple[fx.GraphModule, dict[fx.Node, fx.Node]]:
    """Copy a GraphModule's graph (node metadata is shallow-copied; NodeInfo is immutable)."""
    graph = fx.Graph()
    node_map: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(graph_module.graph, node_map))
    return fx.GraphModule(graph_module, graph), node_map


# --- formatting ---------------------------------------------------------------------------------


def annotation_str(node_info: NodeInfo) -> str:
    """The trailing comment of a printed node: where it came from and how it is scheduled."""
    parts = []
    modules = [s for s in node_info.scopes if s.kind == "module"]
    if modules:
        parts.append(str(modules[-1]))
    parts += [str(s) for s in node_info.scopes if s.kind in ("region", "substitution")]
    if node_info.mb is not None:
        parts.append(f"mb={node_info.mb}")
    if node_info.stage is not None:
        parts.append(f"stage={node_info.stage}")
    if node_info.tags:
        parts.append("[" + ",".join(sorted(node_info.tags)) + "]")
    if node_info.kind is not None:
        parts.append(node_info.kind)
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


def _signature_entries(program: Program) -> list[str]:
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


def header_lines(program: Program) -> list[str]:
    """The comment lines above a printed program: its passes, streams, static and captured inputs."""
    header = [f"# Program {program.name}  passes: {' -> '.join(program.provenance) or '(none)'}"]
    if len(program.streams) > 1:
        header.append("# streams: " + ", ".join(f"s{s.index}={s.name}" + (f"(priority {s.priority})" if s.priority else "")
                                              for s in program.streams))
    statics = [spec for spec in program.inputs if not spec.is_tensor]
    if statics:
        header.append("# static: " + ", ".join(f"{s.path}={s.static_value!r}" for s in statics))
    if program.captured:
        names = [p.name for p in program.captured_placeholders()]
        header.append("# closed over (read in place every call): " +
                      ", ".join(f"{name}={c.name}" if name != c.name else name for name, c in zip(names, program.captured)))
    return header


def format_program(program: Program) -> str:
    parameters = _signature_entries(program)
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
    return "\n".join(header_lines(program) + [f"def {program.name}({signature}):"] + body)
