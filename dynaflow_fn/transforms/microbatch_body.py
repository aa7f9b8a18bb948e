"""What one micro-batch body does with the split inputs, read from a trace of it on abstract values.

`T.microbatch` merges each output leaf as `out_axes` says. Two questions about the body decide
whether that merge gives the unsplit function's result, and the values alone cannot answer them:

- Which outputs read no split input (a `w * 2` returned beside the batch outputs)? Every
  micro-batch computes the same value, the unsplit function's, so the merge takes the first
  micro-batch's value instead of concatenating `num` copies or adding them up. An output that reads
  no split input but is built from the micro-batch's size (`torch.ones(x.shape[0])`) differs from
  the unsplit one, so the body is traced at the micro-batch size and at the full size, and an output
  is *shared* only when its recipe (the ops, arguments, constants and shapes it is computed from) is
  the same in both traces.
- Which ops couple the rows of the batch (`batch_rows`), which read the batch size other than as a
  shape (`batch_size_reads`, from the same two traces: each micro-batch reads its own size), and
  which inputs the body updates in place (the update then runs once per micro-batch):
  micro-batching changes what those compute.

The body is traced outside whatever trace is running (`compat.outside_current_trace`), so this works
also while an outer trace is running (the micro-batched function being traced, or called inside a
traced function), and the eager call and the traced one reach the same answer. A body that cannot
be traced alone (Python control flow on tensor values, which the eager call runs fine) is not
studied: nothing is shared and nothing is reported. What the facts say of each output's merge is
`microbatch_merges`' to tell.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import optree
import torch
from torch import fx

from ..compat import outside_current_trace
from ..errors import TraceError
from ..ir import ops
from ..ir.program import Program
from ..ir.tree import TensorSpec
from ..tracing.tracer import trace_function
from .batch_rows import follow_rows, reads_values
from .batch_size_reads import SizeReads, returned_numbers, same_number, size_reads
from .row_states import Reduced, State, describe

_CHANGES_MEANING = ("Each micro-batch sees only its own rows, so the micro-batched function computes something "
                    "else than the unsplit one.")


@dataclass(frozen=True)
class BodyFacts:
    """shared: output paths (`out[1]`) whose value is the same in every micro-batch and the unsplit one's.
    rows: per output path, how its rows relate to the batch (a `batch_rows` state).
    warnings: ops and inplace updates whose meaning micro-batching changes, as warning texts."""

    shared: frozenset[str] = frozenset()
    rows: dict[str, State] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    target_means: tuple[str, ...] = ()
    """The losses that average over their targets, not over rows (`target_mean_losses`)."""
    batch_free_terms: dict[str, str] = field(default_factory=dict)
    """Per output path, the op that adds a term reading no batch row to a reduction over the rows
    (`batch_free_terms`): merged with "sum", each micro-batch adds that term once more."""
    size_numbers: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Per output path, where it is computed from the batch size read as a number (`size_reads`): each
    micro-batch reads its own size. Merged with "mean", a sum over the rows divided by their count (a
    mean's backward divides so) is right; merged otherwise, such an output is the micro-batches'."""


def study_body(body: Callable[..., Any], tree: optree.PyTreeSpec, leaves: Sequence[Any], paths: Sequence[str],
               split_axes: Sequence[int | None], rows: int) -> BodyFacts:
    """Trace `body` on one micro-batch of `rows` rows and read off its BodyFacts.

    `leaves` flatten the call's (args, kwargs) (None as a leaf), `paths` name them as trace does, and
    `split_axes` gives each split tensor leaf its batch axis (None for the others).
    """
    micro = [_narrowed(leaf, axis, rows) for leaf, axis in zip(leaves, split_axes)]
    program = _trace_aside(body, tree, micro)
    if program is None:
        return BodyFacts()
    split_paths = {path: axis for path, axis in zip(paths, split_axes) if axis is not None}
    split_nodes = {spec.node_name: split_paths[spec.path] for spec in program.inputs
                   if spec.is_tensor and spec.path in split_paths}
    outputs = _output_nodes(program)
    independent = {path: node for path, node in outputs.items()
                   if not any(n.op == "placeholder" and n.name in split_nodes for n in _ancestors(node))}
    shared, texts, full = frozenset(), [], None
    if independent or returned_numbers(program) or rows >= 2:
        full = _trace_aside(body, tree, [_abstract(leaf) for leaf in leaves])
        if full is not None:
            full_outputs = _output_nodes(full)
            shared = frozenset(path for path, node in independent.items()
                               if path in full_outputs and _recipe(program, node) == _recipe(full, full_outputs[path]))
            texts = _sized_numbers(program, full)
    if rows < 2:
        return BodyFacts(shared, warnings=tuple(texts))
    reads = SizeReads()
    if full is not None:
        batch = next(leaf.shape[axis] for leaf, axis in zip(leaves, split_axes) if axis is not None)
        reads = size_reads(program, full, rows, batch,
                           same_layouts=all(axis in (0, None) for axis in split_axes))   # a narrow of axis 0 keeps its layout
        texts += [f"microbatch: {finding}. Each micro-batch reads its own size there, not the batch's. "
                  f"{_CHANGES_MEANING} Compute such values outside the micro-batched function and pass them in."
                  for finding in reads.changes]
    flow = follow_rows(program.graph, split_nodes, rows)
    numbered = _row_numbers_read(program, reads)
    if numbered is not None:
        texts.append(f"microbatch: {numbered}. Each micro-batch numbers its own rows from 0, not by their place in "
                     f"the batch. {_CHANGES_MEANING} Pass the rows' numbers in as a split argument instead.")
    texts += [f"microbatch: {finding}. {_CHANGES_MEANING} Put train-mode layers such as BatchNorm in eval mode "
             f"(model.eval()), or compute such values outside the micro-batched function."
             for finding in flow.findings]
    updated = [spec.path for spec in program.inputs if spec.node_name in _written_inputs(program)
               and spec.node_name not in split_nodes]
    if updated:
        texts.append(f"microbatch: the function updates {', '.join(updated)} in place; micro-batched, the update "
                     f"runs once per micro-batch instead of once per call. Keep that update outside the "
                     f"micro-batched function (for BatchNorm's running statistics: eval mode).")
    return BodyFacts(shared, {path: flow.states[node] for path, node in outputs.items()}, tuple(texts),
                     target_mean_losses(program), batch_free_terms(outputs, flow.states),
                     _size_numbers(outputs, (*reads.numbers, *_loss_mean_backwards(program))))


def _row_numbers_read(program: Program, reads: SizeReads) -> str | None:
    """Where the body uses the numbers of its rows (`torch.arange(x.shape[0])`) other than as positions
    in a value of its own rows (`x[torch.arange(b)]`, as transformers' masks index; Mixtral's experts
    putting each token back at its number; an embedding bag's offsets): with the rows' values
    (`x + arange(b)[:, None]`), to read a tensor that holds no batch (`table[arange(b)]`), or returned."""
    numbers = reads.row_numbers
    returned = set(_output_nodes(program).values())
    for node in program.graph.nodes:
        if node in numbers and node in returned:
            return f"it returns the numbers of its rows ({describe(node)})"
        if node in numbers or node.op != "call_function":
            continue
        used = [argument for argument in node.all_input_nodes if argument in numbers]
        if not used:
            continue
        indexed = [argument for argument in node.all_input_nodes if argument not in numbers]
        if (getattr(getattr(node.target, "overloadpacket", None), "__name__", "") in _INDEXING
                and any(argument in reads.batched for argument in indexed)):
            continue
        return f"{describe(node)} uses the numbers of its rows (from {describe(used[0])})"
    return None


_INDEXING = frozenset({"index", "_unsafe_index", "index_put", "index_put_", "_unsafe_index_put", "index_select",
                       "gather", "scatter", "scatter_add", "scatter_reduce", "index_add", "index_copy", "index_fill",
                       "_embedding_bag", "_embedding_bag_forward_only"})
"""Ops that read or write tensors at positions that index tensors give (an embedding bag's offsets
into its flattened indices)."""


_IS_THE_NUMBER = (torch.ops.aten.lift_fresh_copy, torch.ops.aten.scalar_tensor, torch.ops.aten.full)
"""Ops whose result holds nothing but the number they read (`torch.tensor(b)`, `torch.full((), b)`)."""


def _size_numbers(outputs: dict[str, fx.Node], numbers: Sequence[tuple[fx.Node, str]]) -> dict[str, tuple[str, ...]]:
    """Per output path, the reads of the batch size as a number it is computed from (`numbers`: each
    reading op and its text), other than the output itself being that number (`torch.tensor(b)`: its
    micro-batches' values add up to the batch's)."""
    if not numbers:
        return {}
    found = {}
    for path, output in outputs.items():
        ancestors = set(_ancestors(output))
        if getattr(output.target, "overloadpacket", None) in _IS_THE_NUMBER:
            ancestors.discard(output)
        texts = tuple(text for node, text in numbers if node in ancestors)
        if texts:
            found[path] = texts
    return found


_ADDS = (torch.ops.aten.add, torch.ops.aten.sub, torch.ops.aten.rsub)


def batch_free_terms(outputs: dict[str, fx.Node], states: dict[fx.Node, State]) -> dict[str, str]:
    """Per output path, the first op on its way that adds a term reading no batch row (a penalty on
    the weights, its gradient `2 * w`, a constant) to a value reduced over the rows (a summed loss):
    `x.sum() + w.pow(2).sum()`. Summed over micro-batches, the reduction adds up to the batch's, but
    the term is counted once per micro-batch; outputs that read no batch row at all come back once,
    as the unsplit function computes them."""
    found = {}
    for path, output in outputs.items():
        for node in _ancestors(output):
            if node.op != "call_function" or getattr(node.target, "overloadpacket", None) not in _ADDS:
                continue
            terms = [states.get(arg) if isinstance(arg, fx.Node) else (None if arg != 0 else "zero")
                     for arg in node.args[:2]]
            if any(isinstance(term, Reduced) for term in terms) and None in terms:
                found[path] = describe(node)
                break
    return found


def _loss_mean_backwards(program: Program) -> list[tuple[fx.Node, str]]:
    """The backward ops of losses with reduction "mean" that divide by their element count inside the
    kernel (`mse_loss_backward`, `smooth_l1_loss_backward`, ...): a read of the batch size as a number,
    as `x.mean()`'s backward reads it in `div`, though no number in the graph shows it. Cross-entropy's
    divides by the weight of its targets instead (`target_mean_losses`)."""
    found = []
    for node in program.graph.nodes:
        name = getattr(getattr(node.target, "overloadpacket", None), "__name__", "")
        if not name.endswith("_backward") or name.startswith("nll_loss"):
            continue
        if ops.bind_arguments(node.target, node.args, node.kwargs).get("reduction") == 1:
            found.append((node, f"{describe(node)} divides by its element count, which counts the batch rows "
                                f"(reduction='mean')"))
    return found


_TARGET_MEANS = (torch.ops.aten.nll_loss_forward, torch.ops.aten.nll_loss2d_forward)


def target_mean_losses(program: Program) -> tuple[str, ...]:
    """The negative log-likelihood losses (cross-entropy's) of `program` with reduction "mean": each
    divides by the summed weight of its targets other than `ignore_index`, not by its rows. Where
    micro-batches hold different shares of ignored targets (padding, prompt tokens labelled -100) or
    of class weight, the mean of their means, weighted by rows, is not the batch's mean."""
    found = []
    for node in program.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "overloadpacket", None) in _TARGET_MEANS:
            bound = ops.bind_arguments(node.target, node.args, node.kwargs)
            if bound.get("reduction") == 1:
                found.append(describe(node))
    return tuple(found)


def _sized_numbers(micro: Program, full: Program) -> list[str]:
    """Warnings for numbers the body returns that differ between a micro-batch and the whole batch
    (`x.shape[0]`): the micro-batched function returns the first micro-batch's, not the batch's."""
    whole = returned_numbers(full)
    return [f"microbatch: {path} is {value!r} for a micro-batch but {whole.get(path)!r} for the whole batch, a "
            f"number computed from the batch size; the micro-batched function returns the micro-batch's. Compute "
            f"it outside the micro-batched function."
            for path, value in returned_numbers(micro).items() if not same_number(whole.get(path), value)]


_aside = threading.local()


@dataclass
class Study:
    """What a trace made only to study a function met: `microbatched`, a micro-batched call, which it
    ran unsplit (see `studying`)."""

    microbatched: bool = False


def studying() -> bool:
    """Whether this thread traces a function only to study what it computes: a body for `study_body`
    (whose findings the micro-batched call reports), or a padded call for `jitting.padding_check`.
    Micro-batched calls inside such a trace run their body once, on the whole batch, and report
    nothing (`ran_unsplit`): what a micro-batched function computes is its body's result on the
    batch, and the slices and merges of micro-batching would read, to the study, as rows picked and
    as numbers taken from the batch size."""
    return getattr(_aside, "study", None) is not None


def ran_unsplit() -> None:
    """Record, in the study under way, that a micro-batched call ran its body unsplit."""
    _aside.study.microbatched = True


@contextlib.contextmanager
def study_trace() -> Iterator[Study]:
    """Within: this thread traces only to study (see `studying`); what the study met, in the `Study`."""
    outer = getattr(_aside, "study", None)
    study = _aside.study = Study()
    try:
        yield study
    finally:
        _aside.study = outer
        if outer is not None and study.microbatched:
            outer.microbatched = True


def _trace_aside(body: Callable[..., Any], tree: optree.PyTreeSpec, leaves: Sequence[Any]) -> Program | None:
    """Trace `body` on its own, outside any trace in progress; None if it cannot be traced on its own."""
    args, kwargs = optree.tree_unflatten(tree, list(leaves))
    try:
        with study_trace(), outside_current_trace():
            return trace_function(body, args, kwargs)
    except TraceError:        # not studied: see the module docstring
        return None


def _abstract(leaf: Any) -> Any:
    return TensorSpec.of(leaf) if isinstance(leaf, (torch.Tensor, TensorSpec)) else leaf


def _narrowed(leaf: Any, axis: int | None, rows: int) -> Any:
    """The abstract value of `leaf.narrow(axis, 0, rows)`: same strides, `rows` along the axis."""
    spec = _abstract(leaf)
    if axis is None or not isinstance(spec, TensorSpec):
        return spec
    shape = list(spec.shape)
    shape[axis] = rows
    return TensorSpec(tuple(shape), spec.stride, spec.dtype, spec.device)


def _output_nodes(program: Program) -> dict[str, fx.Node]:
    returned = program.output_node().args[0]
    return {o.path: returned[o.tensor_index] for o in program.outputs if o.tensor_index is not None}


def _written_inputs(program: Program) -> set[str]:
    """Placeholders the function updates in place (traced as a final `copy_` into them)."""
    return {node.args[0].name for node in program.ops()
            if node.target is torch.ops.aten.copy_.default and node.args[0].op == "placeholder"}


def _ancestors(node: fx.Node) -> list[fx.Node]:
    """The nodes whose values `node` is computed from, itself included, in graph order."""
    seen, stack = {node}, [node]
    while stack:
        for source in reads_values(stack.pop()):
            if source not in seen:
                seen.add(source)
                stack.append(source)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _recipe(program: Program, output: fx.Node) -> list[tuple]:
    """How `output` is computed, comparable across traces: per node its op, arguments and result type."""
    nodes = _ancestors(output)
    index = {n: i for i, n in enumerate(nodes)}

    def key(value: Any) -> Any:
        if isinstance(value, fx.Node):
            # a node whose values are not read (the tensor of `zeros_like`): only its dtype and device count
            return ("node", index[value]) if value in index else ("like", value.meta["val"].dtype, value.meta["val"].device)
        if isinstance(value, (list, tuple)):
            return (type(value).__name__, tuple(key(v) for v in value))
        if isinstance(value, dict):
            return tuple(sorted((k, key(v)) for k, v in value.items()))
        if isinstance(value, torch.Tensor):
            return _tensor_key(value)
        return value

    recipe = []
    for node in nodes:
        if node.op == "get_attr":
            constant = getattr(program.graph_module, node.target)
            recipe.append(("constant", _tensor_key(constant), constant.tolist())
                          if isinstance(constant, torch.Tensor) else ("constant", constant))
        else:
            recipe.append((node.op, node.target, key(node.args), key(node.kwargs), key(node.meta.get("val"))))
    return recipe


def _tensor_key(tensor: torch.Tensor) -> tuple:
    return ("tensor", TensorSpec.of(tensor))
