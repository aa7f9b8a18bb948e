"""`T.partition`: group the nodes of each micro-batch into stages, the units a Scheduler orders.

Rules name what should become a stage of its own, without touching model code:

    T.Op(r"all_reduce")          ops whose printed name matches a regex (re.search)
    T.Module(LlamaAttention)     calls of a module class (or a regex on its qualified name)
    T.Region("attn")             blocks of `with df.region("attn")`
    T.Kind("comm")               nodes of a cost-model kind: "compute", "memory" or "comm"

See `partition` for how rules cut a program into stages.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence

from torch import fx

from ..errors import InputError, TransformError, warn
from ..ir import cost, ops
from ..ir.cost import CostKind
from ..ir.program import NodeInfo, Program, info
from .base import Pass, apply_transform, record
from .partition_rules import Rule


class PartitionPass(Pass):
    def __init__(self, rules: Sequence[Rule], warn_unmatched: bool = True):
        if isinstance(rules, Rule) or not isinstance(rules, (list, tuple)):
            raise InputError(f"partition takes a list of rules, e.g. rules=[T.Region('attn')]; got {rules!r}")
        for rule in rules:
            if not isinstance(rule, Rule):
                raise InputError(f"partition rules are T.Op, T.Module, T.Region or T.Kind; got {rule!r}")
        self.rules = tuple(rules)
        self.warn_unmatched = warn_unmatched

    def describe(self) -> str:
        return f"partition({', '.join(str(r) for r in self.rules)})"

    def apply(self, program: Program) -> Program:
        if program.is_scheduled():
            raise TransformError("partition after overlap: the schedule is already fixed. Apply partition first.")
        nodes = program.ops()
        kinds = {node: cost.node_cost(node).kind for node in nodes}
        stage_of, tags_of, matched = _assign_stages(nodes, kinds, self.rules)
        for rule, hits in zip(self.rules, matched):
            if not hits and self.warn_unmatched:
                warn(f"partition rule {rule} matched no node of {program.name}: {rule.unmatched_hint(program)}")
        _check_acyclic(nodes, stage_of, tags_of)
        by_name = {node.name: (stage_of[node], tags_of[stage_of[node]], kinds[node]) for node in nodes}

        def update(node: fx.Node, node_info: NodeInfo) -> NodeInfo:
            if node.name not in by_name or node.op != "call_function":
                return node_info
            stage, tags, kind = by_name[node.name]
            return node_info.replace(stage=stage, tags=tags, kind=kind)

        return record(program, program.annotate(update), self)


def _assign_stages(nodes: Sequence[fx.Node], kinds: dict[fx.Node, CostKind], rules: Sequence[Rule]):
    """Stage index per node (dense, in order of first appearance), tags per stage, and hits per rule.

    Views move no data, so they never start a stage of their own: a view joins the stage of the node
    before it in its micro-batch, or, at the start of a micro-batch, the stage of the node after it.
    """
    key_of: dict[fx.Node, tuple] = {}
    previous: dict[Any, tuple] = {}        # micro-batch -> key of its previous node
    pending: dict[Any, list[fx.Node]] = defaultdict(list)   # leading views waiting for a stage
    runs: dict[Any, int] = defaultdict(int)
    matched = [0] * len(rules)
    collective_stage: dict[fx.Node, tuple] = {}
    for node in nodes:
        node_info = info(node).replace(kind=kinds[node])
        mb = node_info.mb
        key = _waited_collective(node, collective_stage) or _rule_key(node, node_info, rules, previous, runs, matched)
        if key is None and kinds[node] is CostKind.VIEW:
            if mb not in previous:
                pending[mb].append(node)
                continue
            key = previous[mb]
        if key is None:
            last = previous.get(mb)
            key = last if last is not None and last[1] == "between" else (mb, "between", _next_run(runs, mb))
        for view in pending.pop(mb, ()):
            key_of[view] = key
        key_of[node] = key
        previous[mb] = key
        if ops.is_collective(node.target):
            collective_stage[node] = key
    for mb, views in pending.items():
        key = (mb, "between", _next_run(runs, mb))
        for view in views:
            key_of[view] = key
    stage_index: dict[tuple, int] = {}
    tags: dict[int, frozenset[str]] = {}
    for node in nodes:
        key = key_of[node]
        if key not in stage_index:
            stage_index[key] = len(stage_index)
            tags[stage_index[key]] = rules[key[2]].stage_tags() if key[1] in ("rule", "merged") else frozenset()
    return {node: stage_index[key_of[node]] for node in nodes}, tags, matched


def _rule_key(node: fx.Node, node_info: NodeInfo, rules: Sequence[Rule], previous: dict[Any, tuple],
              runs: dict[Any, int], matched: list[int]) -> tuple | None:
    """The stage key of the first rule that matches the node, or None."""
    mb = node_info.mb
    for index, rule in enumerate(rules):
        instance = rule.match(node, node_info)
        if instance is None:
            continue
        matched[index] += 1
        if rule.merge:
            return (mb, "merged", index)
        if instance == "run":
            last = previous.get(mb)
            same_run = last is not None and last[1] == "rule" and last[2] == index
            return last if same_run else (mb, "rule", index, _next_run(runs, mb))
        return (mb, "rule", index, instance)
    return None


def _next_run(runs: dict[Any, int], mb: Any) -> int:
    runs[mb] += 1
    return runs[mb]


def _waited_collective(node: fx.Node, collective_stage: dict[fx.Node, tuple]) -> tuple | None:
    """A collective's wait joins the collective's stage, so the pair is scheduled as one unit."""
    if ops.is_collective_wait(node.target):
        for source in node.all_input_nodes:
            if source in collective_stage:
                return collective_stage[source]
    return None


def stage_edges(nodes: Sequence[fx.Node], stage_of: dict[fx.Node, int]) -> dict[int, set[int]]:
    """Stage -> the stages it needs (from node data edges)."""
    needs: dict[int, set[int]] = defaultdict(set)
    for node in nodes:
        for source in node.all_input_nodes:
            if source in stage_of and stage_of[source] != stage_of[node]:
                needs[stage_of[node]].add(stage_of[source])
    return needs


def _check_acyclic(nodes: Sequence[fx.Node], stage_of: dict[fx.Node, int], tags: dict[int, frozenset[str]]) -> None:
    needs = stage_edges(nodes, stage_of)
    state: dict[int, int] = {}
    path: list[int] = []

    def visit(stage: int) -> list[int] | None:
        state[stage] = 1
        path.append(stage)
        for dep in sorted(needs[stage]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state:
                cycle = visit(dep)
                if cycle:
                    return cycle
        state[stage] = 2
        path.pop()
        return None

    for stage in sorted(set(stage_of.values())):
        if stage not in state:
            cycle = visit(stage)
            if cycle:
                members = defaultdict(list)
                for node in nodes:
                    members[stage_of[node]].append(node.name)
                text = " -> ".join(f"stage {s} [{','.join(sorted(tags[s]))}] ({', '.join(members[s][:3])}"
                                   f"{', ...' if len(members[s]) > 3 else ''})" for s in cycle)
                raise TransformError(f"the partition makes stages depend on each other in a cycle: {text}. "
                                     f"A merged rule (merge=True) groups nodes that have other work between "
                                     f"them; drop merge=True or narrow the rule.")


def partition(fn: Any = None, rules: Sequence[Rule] = ()) -> Any:
    """Cut each micro-batch of `fn` (a function or a Program) into stages by `rules`: the units that
    `T.overlap`'s Scheduler orders and puts on streams. Returns the transformed function (or Program;
    with no `fn`, a transform to apply later).

    Rules name what becomes a stage of its own, without touching model code:

        T.Op(r"all_reduce")          ops whose printed name matches a regex (re.search)
        T.Module(LlamaAttention)     calls of a module class (or a regex on its qualified name)
        T.Region("attn")             blocks of `with df.region("attn")`
        T.Kind("comm")               nodes of a cost-model kind: "compute", "memory" or "comm"

    Walking each micro-batch in trace order, every match is cut out as its own stage: one stage per
    module call or region block, one per contiguous run of matching ops for Op and Kind. The nodes
    between matches form the stages in between (as in DynaFlow's cut-around partitioning). When
    several rules match a node, the first in `rules` wins. Views move no data, so they join the
    stage of a neighbour, and a collective's wait joins the collective's stage.

    Each stage made by a rule gets the rule's `tags` (default: the op pattern, the module class or
    path, the region name or the kind; "comm" for collectives) for Schedulers to read, and every
    node a `kind` from the cost model. A rule with `merge=True` puts all its matches in one
    micro-batch into a single stage instead; if other work sits between them the stages depend on
    each other in a cycle, which is a TransformError naming the nodes.

    A rule that matches no node warns, at the line that traced the program, with what the program
    has instead (its op names, modules called or regions entered). Apply partition before overlap;
    after it the schedule is fixed and partition is an error.

    >>> step = T.partition(step, rules=[T.Module(LlamaAttention), T.Op(r"all_reduce")])
    >>> print(df.trace(step, params, x))       # each node's stage, tags and kind as comments
    """
    if isinstance(fn, (list, tuple)) and not rules:
        fn, rules = None, fn
    return apply_transform(fn, PartitionPass(rules))
