"""The states `batch_rows` gives values of a micro-batch body, and what its per-op rules see.

A state says where the rows of the micro-batch lie in a value (`Rows`), that the value already
mixes them (`Reduced`), that it reads none of them (`None`), or that the analysis cannot tell
(`UNKNOWN`). A rule (`row_rules`) gets a `RuleCall`: the node, its arguments by schema name and the
states so far, and returns the node's state or records a `Finding`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from ..ir.formatting import op_name
from ..ir.program import info
from ..ir.scopes import ScopeKind


@dataclass(frozen=True)
class Rows:
    """Row `b` of the micro-batch lies along `axis`. When views merged the batch with neighbouring
    dimensions, that axis holds `outer * rows * inner` elements, row `b` at `(o * rows + b) * inner + i`."""

    axis: int
    outer: int = 1
    inner: int = 1


@dataclass(frozen=True)
class Reduced:
    """The value mixes rows of the batch; `by` names the op where they were first mixed (see `describe`).

    `not_a_sum` names the first op that made it other than a sum or mean of one term per row (a max
    or a variance over the rows, a square root of a sum), or is None. Only such sums split: the
    micro-batches' sums add up to the batch's, and their means, weighted by rows, average to it.
    `mean` says it divides by the count of rows it reduced (`aten.mean`, a loss's "mean" reduction),
    so the micro-batches' values must be averaged, not added. `picked` says it is made from the first
    row only (`x[0]`): rows appended after the batch, as padding appends them, leave it as it is,
    while each micro-batch picks a row of its own."""

    by: str
    not_a_sum: str | None = None
    mean: bool = False
    picked: bool = False


class _Unknown:
    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN = _Unknown()
State = Any   # None | Rows | Reduced | UNKNOWN, or a tuple of states for an op with several results


@dataclass(frozen=True)
class Finding:
    """An op whose result changes when the batch is split, and why. `causal`: row `b` of its result
    reads only rows up to `b` (a cumulative sum along the batch), so rows appended after the batch,
    as padding appends them, leave the batch's rows as they are."""

    node: fx.Node
    reason: str
    causal: bool = False

    def __str__(self) -> str:
        return f"{describe(self.node)} {self.reason}"


def describe(node: fx.Node) -> str:
    """The op of a node and the module call it was traced in: `aten.mean.dim in encoder.norm (MyNorm)`."""
    modules = [scope for scope in info(node).scopes if scope.kind is ScopeKind.MODULE]
    if not modules:
        return op_name(node.target)
    module = modules[-1]
    kind = module.module_type.__name__ if module.module_type is not None else "module"
    return f"{op_name(node.target)} in {module.name} ({kind})" if module.name else f"{op_name(node.target)} in a {kind}"


@dataclass
class RowFlow:
    """The state of every node of a graph, and the findings on the way. `made` holds the values that
    read no batch row and that the function makes itself (`torch.zeros(b, d)`, views of it), not
    inputs: a write into one at positions the rows choose gives a new value that depends on how
    the batch is cut, where a write into an input (a KV cache at the rows' slots) updates state that
    every part of the batch shares."""

    states: dict[fx.Node, State]
    findings: list[Finding]
    made: set[fx.Node] = field(default_factory=set)


@dataclass(frozen=True)
class RuleCall:
    """What a rule sees: the node, its arguments by schema name, and the states so far."""

    node: fx.Node
    bound: dict[str, Any]
    flow: RowFlow
    rows: int

    def state(self, name: str) -> State:
        value = self.bound.get(name)
        return self.flow.states[value] if isinstance(value, fx.Node) else None

    def rank(self, value: Any = None) -> int:
        return _tensor_value(self.node if value is None else value).dim()

    def shape(self, value: Any = None) -> tuple[int, ...]:
        return tuple(_tensor_value(self.node if value is None else value).shape)

    def dims(self, name: str, rank: int) -> list[int] | None:
        """The normalized dims of a `dim` argument; None when it means every dimension."""
        value = self.bound.get(name)
        if value is None or value == []:
            return None
        return [d % max(rank, 1) for d in ((value,) if isinstance(value, int) else value)]

    def result(self, state: State) -> State:
        return each_result(self.node, state)

    def reduced(self, sum_of_rows: bool, mean: bool = False, picked: bool = False) -> Reduced:
        """The state of a value this node makes by mixing rows of the batch: a sum or mean of one
        term per row (`sum_of_rows`; a mean if `mean`), or not; `picked`: the first row alone (`x[0]`)."""
        by = describe(self.node)
        return Reduced(by, None if sum_of_rows else by, mean and sum_of_rows, picked)

    def report(self, reason: str, causal: bool = False) -> State:
        return record_finding(self.node, self.flow, reason, causal)


RULE_ARGUMENT_ERRORS = (KeyError, IndexError, TypeError, ValueError)
"""What a rule raises where an op's arguments are not as it expects them: the op is then not followed."""


def places_rows_into_made(bound: dict[str, Any], flow: RowFlow) -> bool:
    """Whether an op writes into a tensor the function makes (`RowFlow.made`) at positions that an
    index argument (`index`, or a tensor of `indices`) takes from the rows' data: `out = zeros(b, d);
    out[index] = x`, where data places the rows."""
    into = bound.get("self", bound.get("input"))
    if not isinstance(into, fx.Node) or into not in flow.made:
        return False
    indices = bound.get("indices")
    candidates = [bound.get("index"), *(indices if isinstance(indices, (list, tuple)) else ())]
    return any(isinstance(flow.states.get(index), Rows) for index in candidates if isinstance(index, fx.Node))


def arange_bounds(value: Any) -> tuple[Any, Any, Any] | None:
    """(start, end, step) of a node that is `torch.arange`, else None."""
    if not isinstance(value, fx.Node) or value.target not in _ARANGES:
        return None
    if value.target is _ARANGE:
        return 0, value.args[0], 1
    return (*value.args[:2], *(value.args[2:] or (1,)))


_ARANGE = torch.ops.aten.arange.default
_ARANGES = (_ARANGE, torch.ops.aten.arange.start, torch.ops.aten.arange.start_step)


def record_finding(node: fx.Node, flow: RowFlow, reason: str, causal: bool = False) -> State:
    """Record a finding; what follows from the node is not judged again (one finding per cause)."""
    flow.findings.append(Finding(node, reason, causal))
    return each_result(node, UNKNOWN)


def _value(node: fx.Node) -> Any:
    return node.meta["val"]


def _tensor_value(node: fx.Node) -> torch.Tensor:
    """The value of a node, or its first result for an op returning several (`sort`: values and
    indices, both of the input's shape but along `dim`), which is what the rules' ranks and shapes mean."""
    value = _value(node)
    if isinstance(value, (tuple, list)):
        return next(v for v in value if isinstance(v, torch.Tensor))
    return value


def each_result(node: fx.Node, state: State) -> State:
    """The state for every result of a node (one state, or a tuple for ops returning several)."""
    value = node.meta.get("val")
    if isinstance(value, (tuple, list)):
        return tuple(state if isinstance(v, torch.Tensor) else None for v in value)
    return state
