"""`T.partition`: group the nodes of each micro-batch into stages, the units a Scheduler orders.

Rules name what should become a stage of its own, without touching model code:

    T.Op(r"all_reduce")          ops whose printed name matches a regex (re.search)
    T.Module(LlamaAttention)     calls of a module class (or a regex on its qualified name)
    T.Region("attn")             blocks of `with df.region("attn")`
    T.Kind("comm")               nodes of a cost-model kind: "compute", "memory" or "comm"

See `partition` for how rules cut a program into stages.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import fx

from ..errors import InputError, TransformError, warn
from ..ir import cost, ops
from ..ir.program import NodeInfo, Program, info, op_name
from ..ir.scopes import Scope
from .base import Pass, apply_transform, record


@dataclass(frozen=True)
class Rule:
    """Base of partition rules. `tags` label the stages a rule makes; `merge` joins all its matches."""

    tags: frozenset[str] = field(default=frozenset(), kw_only=True)
    merge: bool = field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        if isinstance(self.tags, str) or not all(isinstance(tag, str) for tag in self.tags):
            raise InputError(f"{type(self).__name__}(tags=...) takes a set of strings, e.g. tags={{'attn'}}; "
                             f"got {self.tags!r}")
        object.__setattr__(self, "tags", frozenset(self.tags))

    def match(self, node: fx.Node, node_info: NodeInfo) -> Any:
        """None if the node does not match; else a key naming the match instance it belongs to."""
        raise NotImplementedError

    def unmatched_hint(self, program: Program) -> str:
        """Why the rule may have matched no node of `program`, and what the program has instead."""
        return "check what its match() accepts"

    def default_tags(self) -> frozenset[str]:
        return frozenset()

    def stage_tags(self) -> frozenset[str]:
        return self.tags or self.default_tags()


@dataclass(frozen=True)
class Op(Rule):
    """Ops whose printed name (`aten.mm`, `aten.add.Tensor`, `_c10d_functional.all_reduce`) matches
    the regex `pattern` (re.search); each contiguous run of matches is one stage."""

    pattern: str
    _regex: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "_regex", _compile("T.Op", self.pattern))

    def match(self, node: fx.Node, node_info: NodeInfo) -> Any:
        return "run" if self._regex.search(op_name(node.target)) else None

    def unmatched_hint(self, program: Program) -> str:
        names = {op_name(node.target) for node in program.ops()}
        return f"the pattern is searched (re.search) in printed op names (this program's ops: {_listing(names)})"

    def default_tags(self) -> frozenset[str]:
        return frozenset({"comm"} if re.search(self.pattern, "all_reduce all_gather reduce_scatter all_to_all")
                         else {self.pattern})

    def __str__(self) -> str:
        return f"T.Op({self.pattern!r})"


@dataclass(frozen=True)
class Module(Rule):
    """Calls of a module: `target` is an `nn.Module` class (its subclasses match too) or a regex that
    is searched in the module's qualified name (`layers.0.self_attn`) or matches its whole class
    name. Each call is one stage."""

    target: type | str
    _regex: re.Pattern | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.target, type) and issubclass(self.target, torch.nn.Module):
            regex = None
        elif isinstance(self.target, str):
            regex = _compile("T.Module", self.target)
        else:
            raise InputError(f"T.Module takes an nn.Module subclass (T.Module(LlamaAttention)) or a regex on module "
                             f"names (T.Module(r'layers\\.\\d+\\.mlp')); got {self.target!r}")
        object.__setattr__(self, "_regex", regex)

    def _matches(self, scope: Scope) -> bool:
        if scope.kind != "module":
            return False
        if self._regex is not None:
            return bool(self._regex.search(scope.name)) or (
                scope.module_type is not None and self._regex.fullmatch(scope.module_type.__name__) is not None)
        return scope.module_type is not None and issubclass(scope.module_type, self.target)

    def match(self, node: fx.Node, node_info: NodeInfo) -> Any:
        for scope in node_info.scopes:
            if self._matches(scope):
                return scope.instance
        return None

    def unmatched_hint(self, program: Program) -> str:
        called = {str(scope) for scope in _scopes(program, "module")}
        if self._regex is None:
            what = f"no call of a {self.target.__name__} module (or a subclass) ran while tracing"
        else:
            what = ("the pattern is searched in module names (like layers.0.self_attn) and matched against whole "
                    "class names")
        return f"{what} (modules called: {_listing(called)})"

    def default_tags(self) -> frozenset[str]:
        return frozenset({self.target if isinstance(self.target, str) else self.target.__name__})

    def __str__(self) -> str:
        target = self.target if isinstance(self.target, str) else self.target.__name__
        return f"T.Module({target})"


@dataclass(frozen=True)
class Region(Rule):
    """Blocks of `with df.region(name)` in model code; each block is one stage."""

    name: str

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.name, str):
            raise InputError(f"T.Region takes the name given to df.region (a str), got {self.name!r}")

    def unmatched_hint(self, program: Program) -> str:
        seen = {scope.name for scope in _scopes(program, "region")}
        return f"no `with df.region({self.name!r})` block ran while tracing (regions entered: {_listing(seen)})"

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


def _compile(rule: str, pattern: str) -> re.Pattern:
    if not isinstance(pattern, str):
        raise InputError(f"{rule} takes a regular expression (a str), got {pattern!r}")
    try:
        return re.compile(pattern)
    except re.error as error:
        raise TransformError(f"{rule}({pattern!r}) is not a valid regular expression: {error}. Escape characters "
                             f"meant literally (re.escape, or a backslash in a raw string r'...')") from error


def _scopes(program: Program, kind: str) -> list[Scope]:
    return [scope for node in program.ops() for scope in info(node).scopes if scope.kind == kind]


def _listing(names: set[str], limit: int = 12) -> str:
    """`a, b, c` (sorted; at most `limit`, then how many more), or `none`."""
    names = sorted(names)
    if not names:
        return "none"
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


@dataclass(frozen=True)
class Kind(Rule):
    """Nodes the cost model gives `kind` ("compute": GEMM-like, "memory": bandwidth-bound, "comm":
    collectives); each contiguous run is one stage."""

    kind: str

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kind not in KINDS:
            raise TransformError(f"T.Kind takes one of {KINDS}, got {self.kind!r}")

    def match(self, node: fx.Node, node_info: NodeInfo) -> Any:
        return "run" if node_info.kind == self.kind else None

    def unmatched_hint(self, program: Program) -> str:
        kinds = {cost.node_cost(node).kind for node in program.ops()}
        return f"the cost model finds no {self.kind} work in the program (kinds present: {_listing(kinds)})"

    def default_tags(self) -> frozenset[str]:
        return frozenset({self.kind})

    def __str__(self) -> str:
        return f"T.Kind({self.kind!r})"


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
