"""`backend="inductor"`: compile the stages of a Program with TorchInductor, then plan as usual.

Lowering plans aten ops one at a time; Inductor fuses them into Triton (GPU) or C++ (CPU) kernels.
This pass sits between transforms and lowering. Each *run* (ops that follow each other in issue order
inside one stage) becomes one node that calls its Inductor-compiled subgraph, and lowering treats that
node like any op that allocates its results. Streams, events and the single CUDA graph work as before:
Inductor's kernels launch on the current stream, which is the step's stream, and allocate from the
caching allocator, which a graph capture serves from its private pool.

What stays aten:

* collectives and their waits (lowering puts them on the comm stream and orders their readers);
* random ops (Inductor draws different numbers than eager);
* multi-tensor optimizer updates (`_foreach_*`, `_fused_adamw`), which lowering runs inplace on
  donated parameters and state;
* the updates of a mutated input (`keys[slots] = k`, traced as `new = index_put(keys, ...)` and a
  write-back `copy_(keys, new)` at the end of the program) where they cannot join one run together
  with their write-back: lowering runs them inplace on the input. Where they can, the write-back
  joins the run of its updates (`_fused_write_backs`): Inductor updates the input in place, fused
  with the ops around the update (the rotary embedding that makes `k`, the gather that reads the
  cache next), and the compiled run's step writes the input. A run holding the updates without
  their write-back would write a new copy of the whole input, copied back at the end;
* work that depends on no input (lowering computes it once, at setup);
* stages tagged "no-inductor" by a partition rule (`T.Region("attn", tags={"no-inductor"})`);
* a run Inductor fails to compile, with a warning naming it.

Runs with the same code and input layouts (every layer of a stack, every micro-batch) compile once.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import fx

from ..compat import OpOverload, StorageWeakRef, compile_with_inductor, outside_current_trace
from ..errors import warn
from ..ir import ops
from ..ir.analyses import fake_storage, is_write_back, setup_nodes, written_back_updates
from ..ir.formatting import op_name
from ..ir.program import NodeInfo, Program, info
from ..ir.progress import progress_bar
from ..ir.tree import TensorSpec
from ..transforms.base import Pass, record

NO_INDUCTOR = "no-inductor"


class CompiledRun:
    """A node target: one run of a stage, compiled by Inductor. `graph_module` keeps its aten code.

    `updated_arguments` maps results to arguments, {result index: argument index}, for the inputs the
    run updates in place (a KV cache written by its write-back): that result is the argument itself,
    and lowering gives it the argument's slot, which the run's step then writes."""

    note = "Inductor kernels"

    def __init__(self, name: str, graph_module: fx.GraphModule, compiled: Callable[..., Any],
                 updated_arguments: dict[int, int]):
        self.__name__ = name
        self.graph_module = graph_module
        self.compiled = compiled
        self.updated_arguments = updated_arguments

    def __call__(self, *args: torch.Tensor) -> Any:
        results = self.compiled(*args)
        if not self.updated_arguments:
            return results
        results = list(results)
        for result, argument in self.updated_arguments.items():
            results[result] = args[argument]       # the very tensor, as lowering's slot says
        return results

    def __repr__(self) -> str:
        return f"<{self.__name__}: {sum(1 for n in self.graph_module.graph.nodes if n.op == 'call_function')} ops>"


class InductorPass(Pass):
    """Program -> Program: every run of compilable ops becomes a call of its compiled subgraph."""

    def __init__(self, progress: bool = True):
        self.progress = progress
        self.compiled = self.fallbacks = 0

    def describe(self) -> str:
        text = f"inductor({self.compiled} runs"
        return text + (f", {self.fallbacks} left as aten)" if self.fallbacks else ")")

    def apply(self, program: Program) -> Program:
        runs = _find_runs(program)
        cache: dict[Any, Callable | None] = {}
        calls: list[_Call] = []
        bar = progress_bar(runs, desc="inductor: compiling stages", unit="run", leave=False,
                           disable=not (self.progress and len(runs) > 1))
        for run in bar:
            graph_module, inputs, outputs = _extract(run)
            key = (_structure(graph_module.graph), tuple(_layout(node.meta["val"]) for node in inputs))
            if key not in cache:
                cache[key] = self._compile(graph_module, inputs, run)
            if cache[key] is not None:
                updated = {i: inputs.index(out.args[0]) for i, out in enumerate(outputs) if is_write_back(out)}
                target = CompiledRun(f"inductor_{len(calls)}", graph_module, cache[key], updated)
                calls.append(_Call(run, inputs, outputs, target))
        self.compiled, self.fallbacks = len(calls), len(runs) - len(calls)
        if not calls:
            return record(program, program, self)
        new_graph = _rewrite(program, calls)
        return record(program, program.with_graph(fx.GraphModule(program.graph_module, new_graph)), self)

    def _compile(self, graph_module: fx.GraphModule, inputs: Sequence[fx.Node], run: Sequence[fx.Node]
                 ) -> Callable | None:
        try:
            with torch.no_grad():
                with outside_current_trace():          # a jitted call inside torch's compiled code (AOTAutograd's modes)
                    return compile_with_inductor(graph_module, [node.meta["val"] for node in inputs])
        except Exception as error:     # only Inductor runs here; its failures (asserts too) fall back to aten
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
            warn(f"Inductor could not compile {_describe(run)}; it runs as aten ops instead "
                          f"({type(error).__name__}: {first_line})")
            return None


# --- finding runs --------------------------------------------------------------------------------


def _find_runs(program: Program) -> list[list[fx.Node]]:
    """Maximal runs of compilable ops that are consecutive in issue order and share a stage.

    A run is closed under the paths between its members (anything between two members in issue order
    is a member), so it can be replaced by one call. The `getitem`s of a member's tuple result join
    its run wherever they are issued. A view joins the run that is open only when it views one of that
    run's own values: views of anything else (a micro-batch's slice of an input, a rotary table an
    earlier stage made) neither join nor break a run. They cost nothing; keeping them outside lets the
    micro-batches' runs share one compiled graph, and it keeps every result of a run in memory the run
    itself allocates. A run that returned a view of one of its inputs would be a step that writes
    memory another step made, and which other streams may be reading.

    Work that depends on no input (`setup_nodes`: a mask, position ids) is computed once, at setup: to a
    run it is one more outside value, issued between two of its ops or not, so it neither joins nor
    breaks one (a break would cost the fusion of the ops on either side of it).

    The updates of a mutated input are compilable where their write-back can join their run
    (`_fused_write_backs`), which it then does, as the run's last op. The others stay aten.

    Reshapes of outside values that only one run reads then join that run (`_with_private_reshapes`).
    """
    setup, chains = setup_nodes(program), _update_chains(program)
    position = {node: index for index, node in enumerate(program.issue_order())}
    position[program.output_node()] = len(position)
    readers = _readers_of_memory(program)
    left_aten: set[fx.Node] = set()
    while True:
        runs = _runs(program, setup, left_aten)
        fused, split = _fused_write_backs(chains, left_aten, runs, position, readers)
        if not split:
            break
        left_aten |= split
    for write_back, index in fused.items():
        runs[index].append(write_back)
    return _with_private_reshapes(runs, program)


def _runs(program: Program, setup: set[fx.Node], left_aten: set[fx.Node]) -> list[list[fx.Node]]:
    """The runs of `_find_runs`, before write-backs join them."""
    runs: list[list[fx.Node]] = []
    run_of: dict[fx.Node, int] = {}
    open_key: Any = None
    for node in program.issue_order():
        if node.target is operator.getitem:
            parent = node.args[0]
            if parent in run_of:
                runs[run_of[parent]].append(node)
                run_of[node] = run_of[parent]
            continue
        if node in setup:
            continue
        node_info = info(node)
        key = (node_info.stage, node_info.mb, node_info.stream)
        if ops.is_view(node.target) and not (
                open_key == key and any(run_of.get(dep) == len(runs) - 1 for dep in node.all_input_nodes)):
            continue
        if not _compilable(node, left_aten):
            open_key = None
            continue
        if open_key != key:
            runs.append([])
            open_key = key
        runs[-1].append(node)
        run_of[node] = len(runs) - 1
    return [run for run in runs if any(not ops.is_view(n.target) and n.target is not operator.getitem for n in run)]


def _update_chains(program: Program) -> dict[fx.Node, list[fx.Node]]:
    """Each write-back of a mutated input, with the chain of updates it copies back
    (`analyses.written_back_updates`)."""
    chains: dict[fx.Node, list[fx.Node]] = {}
    for node, target in written_back_updates(program).items():
        write_back = next(u for u in target.users if is_write_back(u) and u.args[0] is target)
        chains.setdefault(write_back, []).append(node)
    return chains


def _fused_write_backs(chains: dict[fx.Node, list[fx.Node]], left_aten: set[fx.Node], runs: list[list[fx.Node]],
                       position: dict[fx.Node, int], readers: dict[StorageWeakRef | None, set[fx.Node]]
                       ) -> tuple[dict[fx.Node, int], set[fx.Node]]:
    """Which write-backs join the run of their updates ({write-back: run index}), and the updates of
    the others, which must stay aten (a run holding them would copy the whole input).

    A write-back `copy_(x, new)` is issued at the end of the program: until then `x` holds its old
    value. It may join the run that computes `new` from `x`, as its last op, when that run holds the
    whole chain of updates and

    * nothing outside the run reads `x`'s memory from the run's first op on (`x` itself, a view of it:
      they would see the new value early), the program's output included (`position` has it last);
    * the run reads no view of `x` from outside (Inductor would not know it aliases the input it updates);
    * no update but the last has a reader outside the run (that reader would need a copy of its own).

    Readers of `new` outside the run then read `x`, which holds it from the run on (`_rewrite`)."""
    run_of = {node: index for index, run in enumerate(runs) for node in run}
    fused: dict[fx.Node, int] = {}
    split: set[fx.Node] = set()
    for write_back, chain in chains.items():
        if chain[0] in left_aten:
            continue
        target, last = write_back.args
        index = run_of.get(chain[0])
        members = set(runs[index]) if index is not None else set()
        if (index is not None and all(node in members for node in chain)
                and _only_the_run_reads(target, members, position[runs[index][0]], write_back, position, readers)
                and all(user is write_back or user in members for node in chain if node is not last
                        for user in node.users)):
            fused[write_back] = index
        else:
            split.update(chain)
    return fused, split


def _only_the_run_reads(target: fx.Node, members: set[fx.Node], start: int, write_back: fx.Node,
                        position: dict[fx.Node, int], readers: dict[StorageWeakRef | None, set[fx.Node]]) -> bool:
    """Whether, from position `start` on, only the run's `members` (and the write-back) read the memory of
    input `target`, and they read it as `target` itself, not through a view made outside."""
    memory = fake_storage(target)
    return (all(reader in members or reader is write_back or position[reader] < start for reader in readers[memory])
            and all(value is target or value in members or fake_storage(value) != memory
                    for node in members for value in node.all_input_nodes))


def _readers_of_memory(program: Program) -> dict[StorageWeakRef | None, set[fx.Node]]:
    """The nodes that read each memory (a value or a view of it), by the fake storage of what they read."""
    readers: dict[StorageWeakRef | None, set[fx.Node]] = {}
    for node in program.graph.nodes:
        for value in node.all_input_nodes:
            readers.setdefault(fake_storage(value), set()).add(node)
    return readers


def _with_private_reshapes(runs: list[list[fx.Node]], program: Program) -> list[list[fx.Node]]:
    """Each run with the chains of reshapes (`ops.is_reshape`) that lead into it from outside values and
    that nothing else reads, in issue order.

    Inductor recognizes patterns by the ops around them: attention written as matmul, softmax and
    matmul becomes one fused attention kernel only when the transpose of the keys and the reshapes
    that `torch.matmul` inserts are in the graph it compiles. A reshape has no offset, so a
    micro-batch's copy of the chain is the same graph as another's (slices, which have one, stay
    outside), and no reshape becomes a result of the run, since only the run reads it.
    """
    in_a_run = {node for run in runs for node in run}
    position = {node: index for index, node in enumerate(program.issue_order())}
    extended = []
    for run in runs:
        members = set(run)
        frontier = [value for node in run for value in node.all_input_nodes]
        while frontier:
            node = frontier.pop()
            if (node not in members and node not in in_a_run and node.op == "call_function"
                    and ops.is_reshape(node.target) and all(user in members for user in node.users)):
                members.add(node)
                frontier.extend(node.all_input_nodes)
        extended.append(sorted(members, key=position.__getitem__))
    return extended


def _compilable(node: fx.Node, left_aten: set[fx.Node]) -> bool:
    op = node.target
    return (isinstance(op, OpOverload) and ops.is_pure(op) and not _returns_tensor_lists(op)
            and node not in left_aten and NO_INDUCTOR not in info(node).tags)


def _returns_tensor_lists(op: OpOverload) -> bool:
    """Multi-tensor ops (`_foreach_*`, `_fused_adamw`): optimizer updates, which lowering runs in place
    on donated parameters and state. Inside a compiled run they would write new tensors, copied back."""
    return any(r.type == "List[Tensor]" and not r.aliased for r in ops.op_info(op).returns)


# --- extracting and replacing a run ----------------------------------------------------------------


def _extract(run: Sequence[fx.Node]) -> tuple[fx.GraphModule, list[fx.Node], list[fx.Node]]:
    """The run as a standalone graph: its outside inputs become placeholders, and every tensor a
    non-member reads (or the program returns) becomes an output, but for the new value of an input the
    run writes back: its write-back is the output (the input, updated), and its readers read that."""
    members = set(run)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[fx.Node] = []

    def lookup(node: fx.Node) -> fx.Node:
        if node not in env:
            placeholder = graph.placeholder(f"in{len(inputs)}")
            placeholder.meta["val"] = node.meta["val"]
            env[node] = placeholder
            inputs.append(node)
        return env[node]

    for node in run:
        env[node] = graph.node_copy(node, lookup)
    written_back = {n.args[1] for n in run if is_write_back(n)}
    read_outside = lambda n: isinstance(n.meta.get("val"), torch.Tensor) and any(u not in members for u in n.users)
    outputs = [n for n in run if is_write_back(n) or (n not in written_back and read_outside(n))]
    graph.output(tuple(env[n] for n in outputs))
    return fx.GraphModule(torch.nn.Module(), graph), inputs, outputs


@dataclass(frozen=True)
class _Call:
    """A run to replace: its ops, the outside values it reads, the values it provides, the target."""

    run: list[fx.Node]
    inputs: list[fx.Node]
    outputs: list[fx.Node]
    target: CompiledRun


def _rewrite(program: Program, calls: Sequence[_Call]) -> fx.Graph:
    """A copy of the program's graph, in issue order, with each run replaced by its call.

    The call goes where the run's last op was issued (every outside input is issued before it, every
    outside reader after it) and takes that op's annotations; its results keep the names of the
    values they replace, so plans and printouts still read in terms of the traced program.
    """
    call_at = {next(n for n in reversed(c.run) if n.target is not operator.getitem and not is_write_back(n)): c
               for c in calls}
    replaced = {node for c in calls for node in c.run}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in program.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            env[node] = graph.node_copy(node, env.__getitem__)
    for node in program.issue_order():
        if node in call_at:
            _emit_call(graph, env, call_at[node], info(node))
        elif node not in replaced:
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(fx.node.map_arg(program.output_node().args[0], env.__getitem__))
    graph.lint()
    return graph


def _emit_call(graph: fx.Graph, env: dict[fx.Node, fx.Node], call: _Call, node_info: NodeInfo) -> None:
    node = graph.call_function(call.target, tuple(env[n] for n in call.inputs))
    node.meta["val"] = tuple(n.meta["val"] for n in call.outputs)
    node.meta["df"] = node_info
    for index, output in enumerate(call.outputs):
        result = graph.create_node("call_function", operator.getitem, (node, index), name=output.name)
        result.meta["val"] = output.meta["val"]
        result.meta["df"] = node_info
        env[output] = result
        if is_write_back(output):
            env[output.args[1]] = result           # the new value is the updated input's


def _structure(graph: fx.Graph) -> tuple:
    """The graph's computation with node names replaced by positions: equal for every layer's copy."""
    position = {node: index for index, node in enumerate(graph.nodes)}
    rename = lambda arg: fx.node.map_arg(arg, lambda node: position[node])
    return tuple((node.op, node.target, repr(rename(node.args)), repr(rename(node.kwargs)))
                 for node in graph.nodes)


def _layout(value: Any) -> Any:
    """What a compiled graph assumes about an input: shape, strides, dtype, device and whether it is
    16-byte aligned (Inductor's kernels may rely on it)."""
    if isinstance(value, torch.Tensor):
        aligned = value.storage_offset() * value.element_size() % 16 == 0
        return TensorSpec.of(value), aligned
    return repr(value)


def _describe(run: Sequence[fx.Node]) -> str:
    node_info = info(run[0])
    where = f"stage {node_info.stage}" if node_info.stage is not None else "the program"
    names = ", ".join(op_name(n.target) for n in run[:3]) + (", ..." if len(run) > 3 else "")
    return f"{where} ({len(run)} ops from {run[0].name}: {names})"
