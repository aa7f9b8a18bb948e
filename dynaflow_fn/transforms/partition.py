"""`T.partition`: group the nodes of each micro-batch into stages, the units a Scheduler orders.

Rules name what should become a stage of its own, without touching model code:

    T.Op(r"all_reduce")          ops whose printed name matches a regex (re.search)
    T.Module(LlamaAttention)     calls of a module class (or a regex on its qualified name)
    T.Region("attn")             blocks of `with df.region("attn")`
    T.Kind("comm")               nodes of a cost-model kind: "compute", "memory" or "comm"

Walking each micro-batch in trace order, every match of a rule is cut out as its own stage (one
stage per module call or region block; contiguous runs for Op and Kind), and the nodes between
matches form the stages in between, as in DynaFlow's cut-around partitioning. A rule with
`merge=True` puts all of its matches in one micro-batch into a single stage instead, which can make
stages depend on each other in a cycle; that is reported with the nodes involved. Every node also
gets a `kind` from the cost model, and each stage the tags of the rule that made it.
"""

from __future__ import annotations

import re
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence

from torch import fx

from .. import cost, ops
from ..errors import TransformError
from ..program import NodeInfo, Program, info, op_name
from ..regions import Scope
from .base import Pass, apply_transform, record


@dataclass(frozen=True)
class Rule:
    """Base of partition rules. `tags` label the stages a rule makes; `merge` joins all its matches."""

    tags: frozenset[str] = field(default=frozenset(), kw_only=True)
    merge: bool = field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tags", frozenset(self.tags))

    def match(self, node: fx.Node, node_info: NodeInfo) -> Any:
        """None if the node does not match; else a key naming the match instance it belongs to."""
        raise NotImplementedError

    def default_tags(self) -> frozenset[str]:
        return frozenset()

    def stage_tags(self) -> frozenset[str]:
        return self.tags or self.default_tags()


@dataclass(frozen=True)
class Op(Rule):
    pattern: str

    def match(self, node: fx.Node, node_info: NodeInfo) -> Any:
        return "run" if re.search(self.pattern, op_name(node.target)) else None

    def default_tags(self) -> frozenset[str]:
        return frozenset({"comm"} if re.search(self.pattern, "all_reduce all_gather reduce_scatter all_to_all")
                         else {self.pattern})

    def __str__(self) -> str:
        return f"T.Op({self.pattern!r})"


@dataclass(frozen=True)
class Module(Rule):
    target: type | str

    def _matches(self, scope: Scope) -> bool:
        if scope.kind != "module":
            return False
        if isinstance(self.target, str):
            return bool(re.search(self.target, scope.name)) or (
                scope.module_type is not None and re.fullmatch(self.target, scope.module_type.__name__) is not None)
        return scope.module_type is not None and issubclass(scope.module_type, self.target)

    def match(self, node: fx.Node, node_info: NodeInfo) -> Any:
        for scope in node_info.scopes:
            if self._matches(scope):
                return scope.instance
        return None

    def default_tags(self) -> frozenset[str]:
        return frozenset({self.target if isinstance(self.target, str) else self.target.__name__})

    def __str__(self) -> str:
        target = self.target if isinstance(self.target, str) else self.target.__name__
        return f"T.Module({target})"


@dataclass(frozen=True)
class Region(Rule):
    name: str

    def match(self, node: fx.Node, node_info: NodeInfo) -> Any:
        for scope in node_info.scopes:
            if scope.kind == "region" and scope.name == self.name:
                return scope.instance
        return None

    def default_tags(self) -> frozenset[str]:
        return frozenset({self.name})

    def __str__(self) -> str:
        return f"T.Region({self.name!r})"


KINDS = ("compute", "memory", "comm")


@dataclass(frozen=True)
class Kind(Rule):
    kind: str

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kind not in KINDS:
            raise TransformError(f"T.Kind takes one of {KINDS}, got {self.kind!r}")

    def match(self, node: fx.Node, node_info: NodeInfo) -> Any:
        return "run" if node_info.kind == self.kind else None

    def default_tags(self) -> frozenset[str]:
        return frozenset({self.kind})

    def __str__(self) -> str:
        return f"T.Kind({self.kind!r})"


class PartitionPass(Pass):
    def __init__(self, rules: Sequence[Rule], warn_unmatched: bool = True):
        for rule in rules:
            if not isinstance(rule, Rule):
                raise TransformError(f"partition rules are T.Op, T.Module, T.Region or T.Kind; got {rule!r}")
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
                warnings.warn(f"partition rule {rule} matched no node of {program.name}; check its pattern "
                              f"(op names print like aten.mm, module names like layers.0.self_attn)", stacklevel=3)
        _check_acyclic(nodes, stage_of, tags_of)
        by_name = {node.name: (stage_of[node], tags_of[stage_of[node]], kinds[node]) for node in nodes}

        def update(node: fx.Node, node_info: NodeInfo) -> NodeInfo:
            if node.name not in by_name or node.op != "call_function":
                return node_info
            stage, tags, kind = by_name[node.name]
            return node_info.replace(stage=stage, tags=tags, kind=kind)

        return record(program, program.annotate(update), self)


def _assign_stages(nodes: Sequence[fx.Node], kinds: dict[fx.Node, str], rules: Sequence[Rule]):
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
        if key is None and kinds[node] == "view":
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
    if ops.is_collective(node.target) and "wait" in op_name(node.target):
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
    """Label each node with a stage (and tags) by rules; see the module docstring.

    >>> step = T.partition(step, rules=[T.Module(LlamaAttention), T.Op(r"all_reduce")])
    """
    if isinstance(fn, (list, tuple)) and not rules:
        fn, rules = None, fn
    return apply_transform(fn, PartitionPass(rules))
