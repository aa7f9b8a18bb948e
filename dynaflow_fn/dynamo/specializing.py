"""A graph with symbolic sizes, planned once per concrete signature.

torch.compile marks a dimension dynamic once it sees it change, and Dynamo then hands over one graph
for every size: its inputs include the sizes themselves (SymInts such as `s27`, lifted from the
tensors' shapes), and the tensors' shapes are expressions of them. A dynaflow_fn Plan has fixed
shapes, so `Specialized` does what df.jit does per input signature: on the first call with new
concrete values it binds them into the graph and plans it for exactly those sizes; later calls with
the same values go straight to that plan. A float argument that changes between calls arrives as a
0-dim tensor the graph reads with `.item()` (torch.compile's `specialize_float=False`): each read
becomes an input of the graph (`lift_item_reads`), bound per call like a size.

With buckets (`df.compile_backend(buckets=...)`), the batch size is left out of the signature: the
graph's `batching.Batch` says which tensors hold it along dimension 0, and the one df.jit of each
remaining signature pads them to its buckets, binding the size inputs to the padded size while it
traces, so that every bucket plan of the graph shares one memory pool.

Each concrete signature gets a df.jit of its own, not one df.jit keyed on the sizes: a jitted
function checks a call first against the plan it ran last, so sizes that alternate (a few sequence
lengths) would miss that check on every call. One jitted function per signature keeps each call as
cheap as with `torch.compile(dynamic=False)`, where Dynamo holds a graph per size: building the key
of the sizes and one dictionary lookup. Many distinct signatures warn, as df.jit warns for a
function traced again and again.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import torch
from torch import fx

from ..errors import UnpaddableError, warn
from ..ir.tree import Flat, picker
from ..jitting.call import RETRACE_WARNING_ENTRIES, CallSignature, warn_retracing
from ..jitting.guard import call_state
from ..jitting.jitted import Jitted
from .batching import Batch

_EXACT = "exact sizes"
"""The mark in a key of a call whose padded tensors disagree on their rows: a plan of its own sizes."""


def has_symbolic_inputs(example_inputs: Sequence[Any]) -> bool:
    """Whether a graph takes sizes as inputs or tensors whose shapes are symbolic."""
    return any(not isinstance(value, torch.Tensor) or _symbolic_shape(value) for value in example_inputs)


def _symbolic_shape(tensor: torch.Tensor) -> bool:
    return any(isinstance(size, torch.SymInt) for size in tensor.shape)


def _scalar_key(value: Any) -> Any:
    """A bound scalar's part of the key: ints as they are; floats and bools by type and repr, so that
    -0.0 and 0.0, or True and 1, get plans of their own and a NaN finds its plan again."""
    return value if type(value) is int else (type(value), repr(value))


def lift_item_reads(graph_module: fx.GraphModule) -> tuple[fx.GraphModule, list[int]]:
    """A Dynamo graph whose `.item()` reads of input tensors are inputs of their own, appended after the
    others, and per new input the position of the tensor whose value it takes. Dynamo's own graph
    is left as it is (Dynamo reads it after the backend returns)."""
    def item_reads(graph: fx.Graph) -> list[tuple[int, fx.Node]]:
        placeholders = [node for node in graph.nodes if node.op == "placeholder"]
        return [(position, user) for position, node in enumerate(placeholders) for user in node.users
                if user.op == "call_method" and user.target == "item"]

    if not item_reads(graph_module.graph):
        return graph_module, []
    graph = fx.Graph()
    graph.output(graph.graph_copy(graph_module.graph, {}))
    reads = item_reads(graph)
    last = [node for node in graph.nodes if node.op == "placeholder"][-1]
    for index, (_, item) in enumerate(reads):
        with graph.inserting_after(last):
            last = graph.placeholder(f"{item.args[0].name}_value_{index}")
        last.meta = dict(item.meta)
        item.replace_all_uses_with(last)
        graph.erase_node(item)
    return fx.GraphModule(graph_module, graph), [position for position, _ in reads]


def named(fn: Callable[..., Any], name: str, parameters: Sequence[str]) -> Callable[..., Any]:
    """`fn` under `name`, with positional parameters of these names: what df.jit's messages print."""
    def call(*args: Any) -> Any:
        return fn(*args)

    call.__name__ = call.__qualname__ = name
    call.__signature__ = inspect.Signature(
        [inspect.Parameter(p, inspect.Parameter.POSITIONAL_ONLY) for p in parameters])
    return call


class Specialized:
    """`fn` (a graph's forward) planned by df.jit once per concrete signature of its symbolic inputs.

    `fn` takes the graph's inputs in order, named `names`; `example_inputs` are Dynamo's or
    AOTAutograd's (SymInts where sizes are inputs). Its non-tensor inputs are bound into each
    specialization, so the jitted function takes only the tensors (`tensors_of`). `plan` makes the
    df.jit of one specialization (the caller's options), given the function to jit and the tensors of
    the call it is made for. `reads` are the positions whose values `fn`'s last inputs take (see
    `lift_item_reads`); a call passes the others.
    With a `batch`, `plan` pads it to buckets, and `unpadded` plans a call whose padded tensors
    disagree on their rows (`Batch.agreeing`) for its exact sizes.
    """

    def __init__(self, fn: Callable[..., Any], names: Sequence[str], example_inputs: Sequence[Any], name: str,
                 plan: Callable[[Callable[..., Any], Sequence[torch.Tensor]], Jitted], reads: Sequence[int] = (),
                 batch: Batch | None = None,
                 unpadded: Callable[[Callable[..., Any], Sequence[torch.Tensor]], Jitted] | None = None):
        self.fn, self.names, self.name, self.plan, self.reads = fn, list(names), name, plan, list(reads)
        self.unpadded = unpadded
        self.bound = [i for i, value in enumerate(example_inputs) if not isinstance(value, torch.Tensor)]
        self.tensors = [i for i, value in enumerate(example_inputs) if isinstance(value, torch.Tensor)]
        self.symbolic = [i for i in self.tensors if _symbolic_shape(example_inputs[i])]
        self.tensors_of = picker(self.tensors)
        self._last_signature: CallSignature | None = None   # the signature of the latest specialization
        self._pad(batch)

    def _pad(self, batch: Batch | None) -> None:
        """Read calls as padded along `batch` (None: planned per size), with no specialization made yet."""
        self.batch = batch
        padded, sizes = (batch.tensors, batch.sizes) if batch is not None else ((), {})
        self.pick_bound = picker([i for i in self.bound if i not in sizes])
        self.pick_symbolic = picker([i for i in self.symbolic if i not in padded])
        self.pick_padded = picker([i for i in self.tensors if i in padded])
        self.pick_agreeing = picker(sorted(batch.agreeing)) if batch is not None and batch.agreeing else None
        self.first_padded = min(set(padded) - batch.agreeing) if batch is not None else None   # under the batch symbol
        self.by_signature: dict[tuple, Jitted] = {}

    def __call__(self, *args: Any) -> Any:
        given = args
        if self.reads:
            args = (*args, *[args[i].item() for i in self.reads])
        jitted = self.jitted_for(args)
        try:
            return jitted(*self.tensors_of(args))
        except UnpaddableError as error:
            if self.batch is None:
                raise
            self._plan_per_size(error)
            return self(*given)

    def _plan_per_size(self, error: UnpaddableError) -> None:
        """Give up padding: its plan found that padded rows would change the real rows' results (rows
        that interact, a tensor of the batch updated in place). Later calls are planned per size."""
        warn(f"df.compile_backend(buckets=...) cannot pad this graph: {error.reason}. It is planned for each batch "
             f"size instead, as without buckets.")
        self.plan = self.unpadded
        self._pad(None)

    def key(self, args: Sequence[Any]) -> tuple:
        """The concrete signature of a call: the bound scalars' values and the shapes of the tensors
        whose shapes are symbolic (Dynamo's guards already hold these to one graph), the batch's rows
        left out; and where a tensor under a second symbol has rows other than the batch's
        (`Batch.agreeing`), every padded tensor's rows, for a plan of those exact sizes."""
        key = (tuple(map(_scalar_key, self.pick_bound(args)))
               + tuple(tensor.shape for tensor in self.pick_symbolic(args))
               + tuple(tensor.shape[1:] for tensor in self.pick_padded(args)))
        if self.pick_agreeing is not None:
            rows = args[self.first_padded].shape[0]
            if any(tensor.shape[0] != rows for tensor in self.pick_agreeing(args)):
                return (*key, _EXACT, tuple(tensor.shape[0] for tensor in self.pick_padded(args)))
        return key

    def jitted_for(self, args: Sequence[Any]) -> Jitted:
        """The jitted specialization for this call's signature, made on its first call."""
        key = self.key(args)
        jitted = self.by_signature.get(key)
        if jitted is None:
            jitted = self._specialize(key, args)
        return jitted

    def _specialize(self, key: tuple, args: Sequence[Any]) -> Jitted:
        template, fn, positions = list(args), self.fn, self.tensors
        counted = self.batch.sizes if self.batch is not None else {}
        sizes = [(position, positions.index(tensor)) for position, tensor in sorted(counted.items())]

        def specialized(*tensors: torch.Tensor) -> Any:
            inputs = list(template)
            for position, tensor in zip(positions, tensors):
                inputs[position] = tensor
            for position, tensor in sizes:           # the rows it counts: padded ones, while traced
                inputs[position] = tensors[tensor].shape[0]
            result = fn(*inputs)
            return tuple(result) if isinstance(result, list) else result

        for position in positions:                   # keep no tensor of this call alive
            template[position] = None
        plan = self.unpadded if _EXACT in key else self.plan
        jitted = plan(named(specialized, self.name, [self.names[i] for i in positions]), self.tensors_of(args))
        self._warn_if_many(args)
        return self.by_signature.setdefault(key, jitted)

    def _warn_if_many(self, args: Sequence[Any]) -> None:
        """df.jit's warning for a function traced again and again, naming the input that changed."""
        flat = Flat.of(tuple(args), {})
        signature = CallSignature.of(flat, call_state())
        previous, self._last_signature = self._last_signature, signature
        if previous is not None and signature is not None and len(self.by_signature) >= RETRACE_WARNING_ENTRIES:
            warn_retracing(named(self.fn, self.name, self.names), previous, signature, flat,
                           len(self.by_signature) + 1)
