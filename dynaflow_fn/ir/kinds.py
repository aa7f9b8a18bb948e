"""The base of the package's kinds (`CostKind`, `ScopeKind`): enums whose members are strings.

A member equals and hashes as its value and prints as it, so code and users may write the plain
string (`T.Kind("comm")`, `scope.kind == "module"`) where the enum is expected.
"""

from __future__ import annotations

import enum


class StrKind(str, enum.Enum):
    """An enum of named kinds; `str(member)` and f-strings give the value (`comm`), not `CostKind.COMM`."""

    def __str__(self) -> str:
        return self.value
