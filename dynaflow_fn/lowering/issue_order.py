"""Issue order: the order lowering walks the program's nodes in, after checking the schedule.

`T.overlap` checks its Scheduler's stage-level answer; this checks what a Program carries, node by
node, whatever annotated it (a later pass may add nodes): every op has an issue position, runs on a
declared stream, and is issued after its inputs.
"""

from __future__ import annotations

from torch import fx

from ..errors import ScheduleError
from ..ir.program import Program, info
from .draft import PlanDraft
from .sub_pass import sub_pass


@sub_pass("issue order", reads=("program",), writes=("issue_order",))
def issue_order(draft: PlanDraft) -> bool:
    """The nodes in issue order; a change only where the program carries a schedule (else trace order)."""
    draft.issue_order = checked_issue_order(draft.program)
    return draft.program.is_scheduled()


def checked_issue_order(program: Program) -> list[fx.Node]:
    """The schedule's issue order (trace order when there is none); a ScheduleError if it is not one."""
    nodes = program.ops()
    if not program.is_scheduled():
        return nodes
    missing = [n.name for n in nodes if info(n).order is None]
    if missing:
        raise ScheduleError(f"the schedule gives no issue position to nodes {missing[:5]}")
    streams = len(program.streams)
    stray = [n.name for n in nodes if not 0 <= (info(n).stream or 0) < streams]
    if stray:
        raise ScheduleError(f"nodes {stray[:5]} are placed on streams the program does not declare "
                            f"(it has {streams})")
    ordered = program.issue_order()
    position = {n: i for i, n in enumerate(ordered)}
    for node in ordered:
        for dep in node.all_input_nodes:
            if dep in position and position[dep] > position[node]:
                raise ScheduleError(f"the schedule issues {node.name} before its input {dep.name}")
    return ordered
