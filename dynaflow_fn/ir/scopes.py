"""Scopes: the module call, `df.region` block or micro-batch a traced node came from.

Tracing tags every node with the scopes open when it appeared (`tracing.regions`); partition rules
and printing read them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ScopeKind = Literal["module", "region", "microbatch", "substitution"]


@dataclass(frozen=True)
class Scope:
    """One dynamic instance of a module call, a region block or a micro-batch body.

    `instance` distinguishes two calls of the same module (or two blocks with the same region
    name): partition rules cut around instances, never merge them unless asked to.
    """

    kind: ScopeKind
    name: str
    instance: int
    module_type: type | None = None
    index: int | None = None

    def __str__(self) -> str:
        if self.kind == "module":
            label = self.module_type.__name__ if self.module_type is not None else "?"
            return f"{self.name}:{label}" if self.name else label
        if self.kind == "microbatch":
            return f"mb{self.index}"
        if self.kind == "substitution":
            return f"substituted by {self.name}"
        return f"region({self.name})"
