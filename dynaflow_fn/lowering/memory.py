"""Arena planning: give every scratch buffer a byte offset so that buffers in use together never overlap.

Two buffers may share bytes only when one's every access happens before the other's every access
(`ordering.Clocks`): on one stream that is plain liveness; across streams a buffer is reused only once
its last reader is ordered, by events, before the new writer. Offsets are chosen greedily, largest
buffer first, into the smallest gap left by the buffers it conflicts with (the "greedy by size"
strategy of TFLite's arena planner), which packs activation memory close to the peak of live bytes.

`place_buffers`, lowering's last sub-pass, applies this to the plan under construction: it keeps the
storages that no elided `cat` placed inside another, packs the arena ones, and re-points every slot.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from ..plan.plan import Storage, StorageKind
from .draft import PlanDraft
from .sub_pass import sub_pass

ALIGNMENT = 256


def align(nbytes: int, alignment: int = ALIGNMENT) -> int:
    return (nbytes + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class ArenaLayout:
    offsets: tuple[int, ...]
    nbytes: int


def pack(sizes: Sequence[int], release: np.ndarray, acquire: np.ndarray) -> ArenaLayout:
    """Offsets for buffers of `sizes` bytes whose access sets have the given release/acquire clocks.

    Buffer p may share memory with q iff release[p] <= acquire[q] or release[q] <= acquire[p].
    """
    count = len(sizes)
    if count == 0:
        return ArenaLayout((), 0)
    sizes_arr = np.array([align(s) for s in sizes], dtype=np.int64)
    offsets = np.full(count, -1, dtype=np.int64)
    placed = np.zeros(count, dtype=bool)
    for i in sorted(range(count), key=lambda k: (-sizes_arr[k], k)):
        p_before = np.all(release[i] <= acquire, axis=1)
        p_after = np.all(release <= acquire[i], axis=1)
        conflicts = np.nonzero(placed & ~(p_before | p_after))[0]
        offsets[i] = _best_gap(offsets[conflicts], offsets[conflicts] + sizes_arr[conflicts], sizes_arr[i])
        placed[i] = True
    return ArenaLayout(tuple(int(o) for o in offsets), int((offsets + sizes_arr).max()))


def _best_gap(starts: np.ndarray, ends: np.ndarray, size: int) -> int:
    """The lowest-waste offset where `size` bytes fit between the occupied [start, end) ranges."""
    order = np.argsort(starts, kind="stable")
    best, best_waste, cursor = None, None, 0
    for start, end in zip(starts[order], ends[order]):
        gap = start - cursor
        if gap >= size and (best_waste is None or gap - size < best_waste):
            best, best_waste = cursor, gap - size
        cursor = max(cursor, end)
    return int(cursor if best is None else best)


@sub_pass("place buffers", reads=("storages", "steps", "slots", "clocks"),
          writes=("placed_storages", "placed_slots", "arena_nbytes"))
def place_buffers(draft: PlanDraft) -> bool:
    """Renumber the storages that remain, give arena buffers their offsets, and re-point the slots
    into them; a change where there are arena buffers to place."""
    top = [i for i, s in enumerate(draft.storages) if s.parent is None]
    accesses: dict[int, set[int]] = defaultdict(set)
    for step in draft.steps:
        for slot_index in (*step.reads(), *step.writes()):
            accesses[draft.memory_span(slot_index)[0]].add(step.index)
    clocks = draft.clocks
    used = [i for i in top if draft.storages[i].kind is StorageKind.ARENA and accesses[i]]
    release = np.array([clocks.release(accesses[i]) for i in used]).reshape(len(used), clocks.num_streams)
    acquire = np.array([clocks.acquire(accesses[i]) for i in used]).reshape(len(used), clocks.num_streams)
    layout = pack([draft.storages[i].nbytes for i in used], release, acquire)
    offsets = dict(zip(used, layout.offsets))
    new_index = {old: new for new, old in enumerate(top)}
    draft.placed_storages = tuple(
        Storage(new_index[old], draft.storages[old].kind, align(draft.storages[old].nbytes, 16),
                offsets.get(old, 0), draft.storages[old].input_index, draft.storages[old].constant)
        for old in top)
    slots = []
    for slot in draft.slots:
        storage, span = draft.memory_span(slot.index)
        slots.append(replace(slot, storage=new_index[storage], byte_offset=span[0] - slot.byte_range()[0]))
    draft.placed_slots = tuple(slots)
    draft.arena_nbytes = layout.nbytes
    return bool(used)
