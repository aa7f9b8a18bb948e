"""A lowering sub-pass, and what it reads and writes of the draft.

Each sub-pass is a function of the `PlanDraft` that returns whether it changed the plan under
construction (the Plan's provenance names only those that did), declared with `@sub_pass(name,
reads=..., writes=...)`: the draft fields it reads, and those it writes (assigns, or fills in
place). The declarations say how the sub-passes depend on each other: a sub-pass may read only what
the draft starts with (`GIVEN`) or what an earlier one writes, which `unwritten_reads` checks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from ..errors import InternalError
from .draft import PlanDraft

GIVEN = ("program", "donate")
"""The fields a draft is made with; every other one starts empty until a sub-pass writes it."""

DRAFT_FIELDS = frozenset(f.name for f in dataclasses.fields(PlanDraft))


@dataclass(frozen=True)
class SubPass:
    """A named step of lowering: `run(draft)` reads the fields `reads` and writes the fields `writes`,
    and returns whether it changed the plan (False: it found nothing to do)."""

    name: str
    run: Callable[[PlanDraft], bool]
    reads: tuple[str, ...]
    writes: tuple[str, ...]

    def __call__(self, draft: PlanDraft) -> bool:
        return self.run(draft)


def sub_pass(name: str, *, reads: Sequence[str],
             writes: Sequence[str]) -> Callable[[Callable[[PlanDraft], bool]], SubPass]:
    """Declare a function of the draft a sub-pass named `name` that reads and writes these fields."""
    unknown = sorted((set(reads) | set(writes)) - DRAFT_FIELDS)
    if unknown:
        raise InternalError(f"lowering sub-pass {name!r} declares {unknown}, which are no fields of PlanDraft")
    return lambda run: SubPass(name, run, tuple(reads), tuple(writes))


def unwritten_reads(sub_passes: Sequence[SubPass], then_reads: Iterable[str] = ()) -> list[tuple[str, str]]:
    """(reader, field) for each field read before the draft has it: neither `GIVEN` nor written by an
    earlier sub-pass. `then_reads` are the fields read after the last sub-pass, by the reader "plan"."""
    written = set(GIVEN)
    missing = []
    for step in sub_passes:
        missing += [(step.name, name) for name in step.reads if name not in written]
        written.update(step.writes)
    return missing + [("plan", name) for name in then_reads if name not in written]
