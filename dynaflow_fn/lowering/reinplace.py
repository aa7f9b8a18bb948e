"""Re-inplacing: let a functional op write into its first argument when nothing needs the old value.

A training step that donates its parameters and optimizer state ends with chains such as
`p1 = _foreach_mul(params, c); p2 = _foreach_sub(p1, update)`, whose result lowering would copy back
into the donated `params`. Running those ops inplace (`_foreach_mul_(params, c)`, then
`_foreach_sub_`) leaves the result already in `params`: no copy, no intermediate buffers.

A step that updates a KV cache, `keys[slots] = k`, is traced as `new = index_put(keys, ...)` and a
write-back `copy_(keys, new)`: run as traced, every call copies the whole cache twice. Running
`index_put_(keys, ...)` instead updates the cache where it lives, and the write-back, which then
copies the input onto itself, is left out (emit steps).

An op `b = f(a, ...)` runs as `f_(a, ...)` when `f_` exists, `b` has `a`'s shape, strides and dtype,
(for ops that mutate several arguments, such as `_fused_adamw_`, this holds for each of them)
and the old value of `a` is dead: nothing reads `a` or a view of it later in the issue order (the
write-back's `copy_` into `a` writes it, reading nothing of it), it is not returned, it is neither a
program constant nor computed from constants alone (setup work, computed once when the plan is bound
and read by every call: `torch.zeros(2, d).index_add(0, index, x)` written into it would add each
call's rows onto the last call's), and if it is a program input its value is replaced anyway: it is
donated, or `f` is one of the updates the input's write-back copies back
(`analyses.written_back_updates`). A `cat` counts as an alias of its parts, since lowering may place
each part in the `cat`'s output. Only ops that would otherwise allocate their result, or whose first
argument is a replaced input, are rewritten; `out=` kernels already write into planned memory.
"""

from __future__ import annotations

import operator
from typing import Callable, Sequence

import optree
import torch
from torch import fx

from ..compat import has_internal_overlap
from ..ir import ops
from ..ir.analyses import fake_storage, is_write_back, setup_nodes, written_back_updates
from ..ir.tree import TensorSpec
from ..plan.plan import Layout
from .draft import PlanDraft
from .out_kernels import allocates
from .sub_pass import sub_pass


def mutated_arguments(node: fx.Node) -> list[object]:
    """The argument nodes the inplace variant of `node` writes, flattened in the order of its results."""
    written = sum(1 for a in ops.op_info(ops.inplace_variant(node.target)).arguments if a.written)
    flat: list[object] = []
    for arg in node.args[:written]:
        flat += list(arg) if isinstance(arg, (list, tuple)) else [arg]
    return flat


class _Aliases:
    """Union-find over nodes: the node whose memory each value lives in (its alias root)."""

    def __init__(self) -> None:
        self.parent: dict[fx.Node, fx.Node] = {}

    def root(self, node: fx.Node) -> fx.Node:
        while node in self.parent:
            node = self.parent[node]
        return node

    def join(self, node: fx.Node, into: fx.Node) -> None:
        node, into = self.root(node), self.root(into)
        if node is not into:
            self.parent[node] = into


@sub_pass("reinplace", reads=("program", "donate", "issue_order"), writes=("inplace",))
def reinplace(draft: PlanDraft) -> bool:
    """Choose the nodes that emit steps runs as their inplace variants."""
    program = draft.program
    placeholders = program.placeholders()
    donated = {placeholders[i] for i in draft.donate.values()}
    draft.inplace = plan_inplace(draft.issue_order, list(program.output_node().args[0]), donated, allocates,
                                 written_back_updates(program), setup_nodes(program))
    return bool(draft.inplace)


def plan_inplace(order: Sequence[fx.Node], outputs: Sequence[fx.Node], donated: set[fx.Node],
                 allocates: Callable[[fx.Node], bool], updates: dict[fx.Node, fx.Node],
                 constants: set[fx.Node]) -> set[fx.Node]:
    """The nodes to run inplace, given the issue order, the returned nodes, the donated inputs, the
    updates of mutated inputs (each mapped to the input its write-back replaces) and the nodes whose
    values every call reads as they were computed once (`setup_nodes`)."""
    aliases = _Aliases()
    for node in order:
        if node.target is torch.ops.aten.cat.default:
            for part in node.args[0]:
                aliases.join(part, node)     # lowering may place each part inside the cat's output
            continue
        base = next((a for a in node.args if isinstance(a, fx.Node)), None)
        if base is None:
            continue
        storage, base_storage = fake_storage(node), fake_storage(base)
        if ops.is_view(node.target) or (node.target is operator.getitem and ops.is_view(base.target)) or (
                storage is not None and base_storage is not None and storage == base_storage):
            aliases.join(node, base)
    position = {node: i for i, node in enumerate(order)}
    last_read: dict[fx.Node, int] = {}
    for node in order:
        for source in node.all_input_nodes:
            if is_write_back(node) and source is node.args[0]:
                continue                         # written whole, not read
            root = aliases.root(source)
            last_read[root] = max(last_read.get(root, -1), position[node])
    returned = {aliases.root(node) for node in outputs}
    chosen: set[fx.Node] = set()
    for node in order:
        if ops.inplace_variant(node.target) is None:
            continue
        selves = mutated_arguments(node)
        values = optree.tree_leaves(node.meta.get("val"), none_is_leaf=True)
        if not selves or len(selves) != len(values) or not all(isinstance(s, fx.Node) for s in selves):
            continue
        roots = [aliases.root(s) for s in selves]
        replaced = donated | ({updates[node]} if node in updates else set())
        if not (allocates(node) or any(r in replaced for r in roots)):
            continue
        others = {aliases.root(a) for a in node.all_input_nodes if a not in selves}
        if len(set(selves)) == len(selves) and _disjoint(selves, roots) and all(
                _dead_after(node, s, r, v, position, last_read, returned, replaced, others, constants)
                for s, r, v in zip(selves, roots, values)):
            chosen.add(node)
            _merge_results(node, roots, aliases, last_read, returned)
    return chosen


def _disjoint(selves: list[fx.Node], roots: list[fx.Node]) -> bool:
    """Arguments that share memory (slices of one bucket, say) must cover disjoint bytes of it."""
    spans: dict[fx.Node, list[tuple[int, int]]] = {}
    for node, root in zip(selves, roots):
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            return False
        spans.setdefault(root, []).append(Layout.of(value).byte_range())
    for ranges in spans.values():
        ranges.sort()
        if any(end > start for (_, end), (start, _) in zip(ranges, ranges[1:])):
            return False
    return True


def _dead_after(node: fx.Node, self_node: fx.Node, root: fx.Node, result: object, position: dict,
                last_read: dict, returned: set, replaced: set, others: set, constants: set) -> bool:
    """Whether `self_node`'s memory may take `node`'s result: its old value is never needed again, and
    if it is an input's, that input's value is `replaced` anyway."""
    old = self_node.meta.get("val")
    if not isinstance(old, torch.Tensor) or not isinstance(result, torch.Tensor):
        return False
    if TensorSpec.of(old) != TensorSpec.of(result):
        return False
    if has_internal_overlap(old):
        return False
    if root in constants or (root.op == "placeholder" and root not in replaced):
        return False
    return root not in returned and root not in others and last_read.get(root, -1) <= position[node]


def _merge_results(node: fx.Node, roots: list[fx.Node], aliases: _Aliases, last_read: dict, returned: set) -> None:
    """After `node` runs inplace, each of its results lives in the memory of the argument it mutated."""
    for result, flat_index in _result_nodes(node):
        root = roots[flat_index]
        result_root = aliases.root(result)
        last_read[root] = max(last_read.get(root, -1), last_read.get(result_root, -1))
        if result_root in returned:
            returned.add(root)
        aliases.join(result, root)


def _result_nodes(node: fx.Node, start: int = 0) -> list[tuple[fx.Node, int]]:
    """The nodes that stand for single results of `node` (itself, or its getitem chains), with their
    positions among its flat results."""
    value = node.meta.get("val")
    if not isinstance(value, (list, tuple)):
        return [(node, start)]
    found = []
    for user in node.users:
        if user.target is operator.getitem:
            offset = sum(len(optree.tree_leaves(v, none_is_leaf=True)) for v in value[:user.args[1]])
            found += _result_nodes(user, start + offset)
    return found
