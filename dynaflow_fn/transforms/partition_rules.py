"""Partition rules: what `T.partition` cuts out of a program as stages of its own.

Each rule answers, per node, whether it matches and which match instance (a module call, a region
block, a run of ops) the node belongs to; `partitioning` turns those answers into stages. A rule
that matches nothing explains why (`unmatched_hint`), from what the program has instead.
"""

from __future__ import annotations

import abc
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from ..errors import InputError, TransformError
from ..ir import cost
from ..ir.cost import CostKind
from ..ir.formatting import op_name
from ..ir.program import NodeInfo, Program, info
from ..ir.scopes import Scope, ScopeKind


@dataclass(frozen=True)
class Rule(abc.ABC):
    """Base of partition rules (subclass it for a matcher of your own). Every rule takes two options:

    tags: labels of the stages the rule makes, for Schedulers to read (default: the op pattern, the
        module class or path, the region name or the kind).
    merge: put all the rule's matches in one micro-batch into a single stage, instead of a stage each.
    """

    tags: frozenset[str] = field(default=frozenset(), kw_only=True)
    merge: bool = field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        if isinstance(self.tags, str) or not all(isinstance(tag, str) for tag in self.tags):
            raise InputError(f"{type(self).__name__}(tags=...) takes a set of strings, e.g. tags={{'attn'}}; "
                             f"got {self.tags!r}")
        object.__setattr__(self, "tags", frozenset(self.tags))

    @abc.abstractmethod
    def match(self, node: fx.Node, node_info: NodeInfo) -> Any:
        """None if the node does not match; else a key naming the match instance it belongs to."""

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
    the regex `pattern` (re.search); each contiguous run of matches is one stage. `tags` and `merge`
    as for every `T.Rule`."""

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
    name. Each call is one stage. `tags` and `merge` as for every `T.Rule`."""

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
        if scope.kind is not ScopeKind.MODULE:
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
        called = {str(scope) for scope in _scopes(program, ScopeKind.MODULE)}
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
    """Blocks of `with df.region(name)` in model code; each block is one stage. `tags` and `merge` as
    for every `T.Rule`."""

    name: str

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.name, str):
            raise InputError(f"T.Region takes the name given to df.region (a str), got {self.name!r}")

    def unmatched_hint(self, program: Program) -> str:
        seen = {scope.name for scope in _scopes(program, ScopeKind.REGION)}
        return f"no `with df.region({self.name!r})` block ran while tracing (regions entered: {_listing(seen)})"

    def match(self, node: fx.Node, node_info: NodeInfo) -> Any:
        for scope in node_info.scopes:
            if scope.kind is ScopeKind.REGION and scope.name == self.name:
                return scope.instance
        return None

    def default_tags(self) -> frozenset[str]:
        return frozenset({self.name})

    def __str__(self) -> str:
        return f"T.Region({self.name!r})"


RULE_KINDS = (CostKind.COMPUTE, CostKind.MEMORY, CostKind.COMM)
"""The kinds a `T.Kind` rule selects: every kind but `view`, since views move no data and never
start a stage of their own (they join the stage beside them, see `partitioning`)."""


def _compile(rule: str, pattern: str) -> re.Pattern:
    if not isinstance(pattern, str):
        raise InputError(f"{rule} takes a regular expression (a str), got {pattern!r}")
    try:
        return re.compile(pattern)
    except re.error as error:
        raise TransformError(f"{rule}({pattern!r}) is not a valid regular expression: {error}. Escape characters "
                             f"meant literally (re.escape, or a backslash in a raw string r'...')") from error


def _scopes(program: Program, kind: ScopeKind) -> list[Scope]:
    return [scope for node in program.ops() for scope in info(node).scopes if scope.kind is kind]


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
    collectives; the string or the `CostKind`); each contiguous run is one stage. `tags` and `merge`
    as for every `T.Rule`."""

    kind: CostKind

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kind not in RULE_KINDS:
            raise TransformError(f"T.Kind takes one of {tuple(k.value for k in RULE_KINDS)}, got {self.kind!r}")
        object.__setattr__(self, "kind", CostKind(self.kind))

    def match(self, node: fx.Node, node_info: NodeInfo) -> Any:
        return "run" if node_info.kind == self.kind else None

    def unmatched_hint(self, program: Program) -> str:
        kinds = {cost.node_cost(node).kind for node in program.ops()}
        return f"the cost model finds no {self.kind} work in the program (kinds present: {_listing(kinds)})"

    def default_tags(self) -> frozenset[str]:
        return frozenset({self.kind.value})

    def __str__(self) -> str:
        return f"T.Kind({self.kind.value!r})"
