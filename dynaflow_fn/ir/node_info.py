"""Per-node annotations: `node.meta["df"]` holds a frozen `NodeInfo`, which transforms replace and
lowering and printing read."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from torch import fx

from .cost import CostKind
from .scopes import Scope, ScopeKind


@dataclass(frozen=True)
class NodeInfo:
    """Annotations of one node. Written by transforms, read by lowering and printing.

    scopes: module calls, regions and micro-batch bodies the node was traced inside, outermost first.
    stage:  the stage (a group of nodes scheduled as one unit) that `partition` put it in.
    tags:   free-form labels from partition rules (e.g. "attn", "comm", "no-inductor").
    kind:   what the cost model says the node is (`CostKind`).
    stream: the stream the schedule placed it on; order: its position in the issue order.
    after:  stages that must finish before this node starts, though it reads nothing of theirs: the
            schedule's pacing edges.
    """

    scopes: tuple[Scope, ...] = ()
    stage: int | None = None
    tags: frozenset[str] = frozenset()
    kind: CostKind | None = None
    stream: int | None = None
    order: int | None = None
    after: tuple[int, ...] = ()

    @property
    def mb(self) -> int | None:
        """The micro-batch this node computes, or None for nodes shared by all micro-batches."""
        for scope in reversed(self.scopes):
            if scope.kind is ScopeKind.MICROBATCH:
                return scope.index
        return None

    def replace(self, **changes: Any) -> "NodeInfo":
        return dataclasses.replace(self, **changes)


_EMPTY_INFO = NodeInfo()


def info(node: fx.Node) -> NodeInfo:
    return node.meta.get("df", _EMPTY_INFO)
