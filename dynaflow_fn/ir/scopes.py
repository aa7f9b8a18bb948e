"""Scopes: the module call, `df.region` block, micro-batch or gradient computation a traced node came from.

Tracing tags every node with the scopes open when it appeared (`tracing.regions`); partition rules
and printing read them.
"""

from __future__ import annotations

from dataclasses import dataclass

from .kinds import StrKind


class ScopeKind(StrKind):
    MODULE = "module"                # a call of an nn.Module
    REGION = "region"                # a `with df.region(name)` block
    MICROBATCH = "microbatch"        # one micro-batch body of `T.microbatch`
    SUBSTITUTION = "substitution"    # nodes `T.substitute` put in place of a match
    BACKWARD = "backward"            # the gradients `df.value_and_grad` and `df.grad` compute


@dataclass(frozen=True)
class Scope:
    """One dynamic instance of a module call, a region block or a micro-batch body.

    `instance` distinguishes two calls of the same module (or two blocks with the same region
    name): partition rules cut around instances, never merge them unless asked to. `kind` may be
    given as its string (`"module"`).
    """

    kind: ScopeKind
    name: str
    instance: int
    module_type: type | None = None
    index: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", ScopeKind(self.kind))

    def __str__(self) -> str:
        if self.kind is ScopeKind.MODULE:
            label = self.module_type.__name__ if self.module_type is not None else "?"
            return f"{self.name}:{label}" if self.name else label
        if self.kind is ScopeKind.MICROBATCH:
            return f"mb{self.index}"
        if self.kind is ScopeKind.SUBSTITUTION:
            return f"substituted by {self.name}"
        if self.kind is ScopeKind.BACKWARD:
            return "backward"
        return f"region({self.name})"
