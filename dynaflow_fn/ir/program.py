"""The Program: a traced, functional aten graph plus everything transforms and lowering need.

A Program is immutable from the outside: transforms build a new one (`Program.annotate`,
`Program.with_graph`) and append a provenance line, so `print(program)` shows what happened to it;
`program.python()` writes the same program as Python source that runs on its own.
Per-node annotations live in `node.meta["df"]` as a frozen `NodeInfo` (`node_info`); what callers
see of the traced function is its `Signature`, which the Plans lowered from it share.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import optree
import torch
from torch import fx

from .formatting import dtype_name, format_program, program_header
from .node_info import NodeInfo, info
from .python_source import python_source
from .signature import HasSignature, Signature

# NodeInfo and info (node_info.py) and dtype_name (formatting.py) are imported from here as well:
# a Program is where most readers meet them.
__all__ = ["NodeInfo", "Program", "Source", "Stream", "copy_graph_module", "dtype_name", "info"]


class Source(Protocol):
    """What a Program was traced from (tracing's `TraceSource`), as the passes that trace it again
    read it: `body` ran on the abstract `args` and `kwargs`; `fn` is the user's function, which names
    the arguments. A pass that changes what gets traced (microbatch) traces `fn` again with its own
    body wrapped around `body`."""

    @property
    def fn(self) -> Callable[..., Any]: ...

    @property
    def body(self) -> Callable[..., Any]: ...

    @property
    def args(self) -> tuple: ...

    @property
    def kwargs(self) -> dict: ...


@dataclass(frozen=True)
class Stream:
    """A stream of a schedule: `index` numbers it (a Scheduler's `streams()` returns them numbered 0,
    1, ... in order, and a schedule names a stream by its index), `name` is how plans print it, and
    `priority` follows CUDA: lower numbers run first when both are ready (the built-in schedulers
    give collectives -1)."""

    index: int
    name: str
    priority: int = 0


@dataclass(frozen=True)
class Program(HasSignature):
    """A traced function: an aten-level functional FX graph and the `Signature` it has for callers.

    The graph's placeholders are the tensor leaves of the arguments, in flatten order, then the
    `closed_over` tensors the function closes over (see `dynaflow_fn.tracing.closure`). `module_modes`
    records the `training` flag of every module whose flag the trace read, which the traced ops depend
    on (dropout, batch norm; see `dynaflow_fn.tracing.mode_reads`). `objects_read` are the modules the
    trace called or found in the function's closure and the instance of a bound method, whose Python
    attributes (hooks, submodules, parameters, plain attributes) the traced ops depend on too.
    `gradient_flow` says which outputs eager autograd would connect to which inputs, and which inputs
    the function updates in place while gradients are recorded (`dynaflow_fn.tracing.gradients`).
    Calling a Program runs its graph
    eagerly, which is handy as a reference. Printing it shows code.
    """

    graph_module: fx.GraphModule
    signature: Signature
    provenance: tuple[str, ...] = ()
    streams: tuple[Stream, ...] = (Stream(0, "main"),)
    sm_carveout: int | None = None   # T.overlap(comm_ctas=N): SMs each kernel beside a collective leaves it
    source: Source | None = field(default=None, compare=False)
    passes: tuple[Any, ...] = field(default=(), compare=False)
    module_modes: tuple[tuple[torch.nn.Module, bool], ...] = field(default=(), compare=False)
    objects_read: tuple[Any, ...] = field(default=(), compare=False)
    gradient_flow: Any = field(default=None, compare=False)

    @property
    def graph(self) -> fx.Graph:
        return self.graph_module.graph

    def placeholders(self) -> list[fx.Node]:
        return [n for n in self.graph.nodes if n.op == "placeholder"]

    def closed_over_placeholders(self) -> list[fx.Node]:
        """The placeholders bound to the `closed_over` tensors, which come after the arguments'."""
        placeholders = self.placeholders()
        return placeholders[len(placeholders) - len(self.closed_over):]

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
        flat_out = self.graph_module(*tensors, *(c.tensor for c in self.closed_over))
        return self.unflatten_outputs(flat_out)

    def constants(self) -> dict[str, torch.Tensor]:
        """The tensors the program holds rather than receives, by the names it prints: the closed-over
        tensors (the very objects, so a call reads them as they are then) and the graph's constants."""
        values = {node.name: c.tensor for node, c in zip(self.closed_over_placeholders(), self.closed_over)}
        values.update((node.name, operator.attrgetter(node.target)(self.graph_module))
                      for node in self.graph.nodes if node.op == "get_attr")
        return values

    def python(self) -> str:
        """This program as Python source that runs without dynaflow_fn: the printed header, `import
        torch`, and a function named after the program that calls each node's aten overload by its
        full path (`torch.ops.aten.mm.default`) and returns the flat list of output tensors.

        Its positional parameters are the tensor inputs, named as `print(program)` names them. The
        tensors of `constants()` (closed-over tensors and graph constants, which no literal can spell)
        are keyword-only parameters of the same names: `exec` the source, then
        `fn(*tensor_inputs, **program.constants())` returns what `program(*args)` flattens to.
        """
        return python_source(self, program_header(self))

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
