"""The first call of a new input signature: its phases, timed and shown while they run.

A first call traces the function, compiles its kernels (seconds with Inductor, less when Inductor's
on-disk caches hold them from an earlier process), lowers the Program to a Plan and captures the
CUDA graph. `ColdStart` times each phase, and a progress bar names the phase running once the call
has taken `SHOW_AFTER_S` (a small function's first call stays silent), ending with the split:

    df.jit(LlamaLike), trace 2.1s, inductor 6.3s, lower 0.4s, capture 0.9s
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

from ..ir.progress import progress_bar

SHOW_AFTER_S = 2.0


class ColdStart:
    """Seconds per phase of one first call (`seconds`), with a progress bar of the phases."""

    def __init__(self, name: str, show: bool):
        self.name = name
        self.seconds: dict[str, float] = {}
        self._started = time.perf_counter()
        self._bar = progress_bar(desc=f"df.jit({name})", delay=SHOW_AFTER_S, disable=not show, leave=True,
                                 bar_format="{desc}{postfix}")

    @contextlib.contextmanager
    def phase(self, label: str) -> Iterator[None]:
        """Time one phase, named on the bar while it runs."""
        self._bar.set_postfix_str(f"{self._split()}{', ' if self.seconds else ''}{label}...", refresh=self._late())
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[label] = time.perf_counter() - start
            self._bar.update(1)

    def finish(self) -> None:
        """Show the split and close the bar."""
        self._bar.set_postfix_str(self._split(), refresh=False)
        self._bar.close()                              # prints the split only if the bar was shown

    def _late(self) -> bool:
        """Whether the call has run long enough to show the bar (tqdm's own delay covers updates only)."""
        return time.perf_counter() - self._started >= SHOW_AFTER_S

    def _split(self) -> str:
        return ", ".join(f"{label} {seconds:.1f}s" for label, seconds in self.seconds.items())
