"""SM budget: leave SMs to the collectives of a program scheduled with `T.overlap(comm_ctas=...)`.

A persistent GEMM takes every SM, and a collective's thread blocks would wait for it to finish instead
of running beside it. So the kernels that may run while a collective does (neither ordered before nor
after it) are marked to leave `sm_carveout` SMs free.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..ir import ops
from ..plan.plan import StepKind
from .draft import PlanDraft
from .sub_pass import sub_pass


@sub_pass("sm budget", reads=("program", "steps", "clocks"), writes=("steps",))
def sm_budget(draft: PlanDraft) -> bool:
    steps, clocks, carveout = draft.steps, draft.clocks, draft.program.sm_carveout
    collectives = np.array([s.index for s in steps if ops.launches_collective(s.op)], dtype=np.int64)
    if carveout is None or not len(collectives):
        return False
    everything = np.arange(len(steps))
    beside = np.zeros(len(steps), dtype=bool)
    for c in collectives:
        beside |= ~clocks.before_all(c, everything) & ~clocks.after_all(c, everything)
    beside[collectives] = False
    marked = beside & np.array([s.kind in (StepKind.KERNEL, StepKind.ALLOC) for s in steps], dtype=bool)
    draft.steps = [replace(s, sm_carveout=carveout) if marked[s.index] else s for s in steps]
    return bool(marked.any())
