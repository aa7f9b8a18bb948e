"""Synchronize: make the plan safe on several streams, with as few events as possible.

Side streams fork from and join the first stream. Each step depends on the writers of what it reads
(through views), on the readers and writers of what it overwrites, and on the schedule's pacing edges;
a dependency on another stream becomes an event wait (one event per producer) only where the step's
stream is not already ordered after the producer. Then the steps are numbered, and the happens-before
order of the final list is kept for the sub-passes that follow.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import numpy as np

from ..ir.program import info
from ..plan.ordering import Clocks
from ..plan.plan import Step, StepKind
from .draft import PlanDraft, new_step
from .sub_pass import sub_pass


@sub_pass("synchronize", reads=("program", "steps", "slots", "storages"), writes=("steps", "num_events", "clocks"))
def synchronize(draft: PlanDraft) -> bool:
    """Number the steps and order them; a change where they use several streams (fork, join, events)."""
    steps = draft.steps
    several_streams = any(s.stream != 0 for s in steps)
    if several_streams:
        steps = [new_step(StepKind.FORK, 0), *steps, new_step(StepKind.JOIN, 0)]
    waits, records, draft.num_events = _events(steps, _dependencies(draft, steps), len(draft.program.streams))
    draft.steps = [replace(step, index=i, waits=tuple(waits[i]), records=tuple(records[i]))
                   for i, step in enumerate(steps)]
    draft.clocks = Clocks(draft.steps, len(draft.program.streams))
    return several_streams


def _events(steps: list[Step], deps: list[set[int]], num_streams: int) -> tuple[list[list[int]], list[list[int]], int]:
    """Per step the events it waits on and records, and the number of events: a cross-stream dependency
    becomes a wait only if neither the step's stream order nor another wait of the same step already
    implies it (a transitive reduction)."""
    waits: list[list[int]] = [[] for _ in steps]
    records: list[list[int]] = [[] for _ in steps]
    stream_clock = np.zeros((num_streams, num_streams), dtype=np.int64)
    position = np.zeros(len(steps), dtype=np.int64)
    clock_after: list[np.ndarray] = []
    event_of_step: dict[int, int] = {}
    for i, step in enumerate(steps):
        clock = stream_clock[step.stream].copy()
        pending = [d for d in deps[i]
                   if steps[d].stream != step.stream and clock[steps[d].stream] < position[d]]
        needed = [a for a in pending
                  if not any(b != a and clock_after[b][steps[a].stream] >= position[a] for b in pending)]
        for dep in sorted(needed):
            if dep not in event_of_step:
                event_of_step[dep] = len(event_of_step)
                records[dep].append(event_of_step[dep])
            waits[i].append(event_of_step[dep])
            np.maximum(clock, clock_after[dep], out=clock)
        clock[step.stream] += 1
        stream_clock[step.stream] = clock
        position[i] = clock[step.stream]
        clock_after.append(clock.copy())
    return waits, records, len(event_of_step)


def _dependencies(draft: PlanDraft, steps: list[Step]) -> list[set[int]]:
    """For each step, the earlier steps it must run after: writers of what it reads (through views),
    readers and writers of what it overwrites; the schedule's pacing edges; and the fork before each
    side stream's first step, every side-stream step before the join."""
    writers: dict[int, list[tuple[int, tuple[int, int]]]] = defaultdict(list)
    readers: dict[int, list[tuple[int, tuple[int, int]]]] = defaultdict(list)
    deps: list[set[int]] = []
    for i, step in enumerate(steps):
        mine: set[int] = set()
        if step.kind is not StepKind.VIEW:
            for slot_index in step.reads():
                storage, span = draft.memory_span(slot_index)
                mine.update(j for j, other in writers[storage] if _overlap(span, other))
                readers[storage].append((i, span))
            for slot_index in step.writes():
                storage, span = draft.memory_span(slot_index)
                mine.update(j for j, other in writers[storage] + readers[storage] if _overlap(span, other) and j != i)
                writers[storage].append((i, span))
        deps.append(mine)
    _add_pacing(draft, steps, deps)
    if steps and steps[0].kind is StepKind.FORK:
        _add_fork_and_join(steps, deps)
    return deps


def _add_pacing(draft: PlanDraft, steps: list[Step], deps: list[set[int]]) -> None:
    """The schedule's pacing edges: a node's steps run after the last step of each stage in its `after`."""
    node_info = {n.name: info(n) for n in draft.program.ops()}
    if not any(i.after for i in node_info.values()):
        return
    last_of_stage: dict[int, int] = {}
    for i, step in enumerate(steps):
        if step.node not in node_info:
            continue
        deps[i].update(last_of_stage[s] for s in node_info[step.node].after if s in last_of_stage)
        last_of_stage[node_info[step.node].stage] = i


def _add_fork_and_join(steps: list[Step], deps: list[set[int]]) -> None:
    """Each side stream's first step runs after the fork; the join runs after every side-stream step."""
    first_on: dict[int, int] = {}
    for i, step in enumerate(steps):
        first_on.setdefault(step.stream, i)
        if step.stream != 0:
            deps[-1].add(i)
    for stream, i in first_on.items():
        if stream != 0:
            deps[i].add(0)


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]
