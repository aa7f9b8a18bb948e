"""Happens-before between the steps of a multi-stream plan, by vector clocks.

Steps run in issue order on their own stream; a step that waits on an event runs after everything
its stream had issued when the event was recorded. Step `a` happens before step `b` exactly when b's
clock has seen a's position on a's stream. Lowering uses this to decide which buffers may share
memory, and the verifier uses it to prove that every conflicting access pair is ordered.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from .plan import Step


class Clocks:
    """Vector clocks of a list of steps: `clock[i, s]` = how far into stream s step i is known to be."""

    def __init__(self, steps: Sequence[Step], num_streams: int):
        self.num_streams = num_streams
        self.stream = np.array([step.stream for step in steps], dtype=np.int64)
        self.clock = np.zeros((len(steps), num_streams), dtype=np.int64)
        stream_clock = np.zeros((num_streams, num_streams), dtype=np.int64)
        event_clock: dict[int, np.ndarray] = {}
        for i, step in enumerate(steps):
            current = stream_clock[step.stream].copy()
            for event in step.waits:
                if event in event_clock:
                    np.maximum(current, event_clock[event], out=current)
            current[step.stream] += 1
            stream_clock[step.stream] = current
            self.clock[i] = current
            for event in step.records:
                event_clock[event] = current
        self.position = self.clock[np.arange(len(steps)), self.stream] if len(steps) else np.zeros(0, np.int64)

    def before(self, a: int, b: int) -> bool:
        """Whether step a happens strictly before step b."""
        return a != b and self.clock[b, self.stream[a]] >= self.position[a]

    def before_all(self, a: int, later: np.ndarray) -> np.ndarray:
        """Vectorized `before(a, b)` for every b in `later`."""
        return (self.clock[later, self.stream[a]] >= self.position[a]) & (later != a)

    def after_all(self, b: int, earlier: np.ndarray) -> np.ndarray:
        """Vectorized `before(a, b)` for every a in `earlier`."""
        return (self.clock[b, self.stream[earlier]] >= self.position[earlier]) & (earlier != b)

    def release(self, accesses: Iterable[int]) -> np.ndarray:
        """Per stream, the last position among `accesses` (0 where none ran on that stream)."""
        result = np.zeros(self.num_streams, dtype=np.int64)
        for a in accesses:
            s = self.stream[a]
            result[s] = max(result[s], self.position[a])
        return result

    def acquire(self, accesses: Iterable[int]) -> np.ndarray:
        """Per stream s, the largest position p such that every access has seen stream s strictly past p.

        A set of accesses P happens entirely before a set Q iff release(P) <= acquire(Q) elementwise.
        """
        result = np.full(self.num_streams, np.iinfo(np.int64).max, dtype=np.int64)
        for b in accesses:
            seen = self.clock[b].copy()
            seen[self.stream[b]] -= 1
            np.minimum(result, seen, out=result)
        return result
