"""Progress bars that redraw on a terminal and stay quiet in a log.

tqdm redraws a bar by rewriting its line. On a terminal that line is overwritten in place; where
stderr is a file, a pipe or a CI log, every redraw stays, so a training loop of 300 steps left
300 copies of its bar. `progress_bar` makes every bar of the package and of its examples:

- on a terminal (or in a notebook, as tqdm's widget), it redraws at most every `MININTERVAL_S`;
- anywhere else it writes nothing while it runs, and when it closes, one line with its final
  state if it is a bar that stays (`leave=True`, and shown by tqdm's own rules, e.g. its `delay`).
"""

from __future__ import annotations

import sys
from typing import Any, Iterable

from tqdm import autonotebook, std
from tqdm.auto import tqdm as live_bar

MININTERVAL_S = 0.5


class _LogBar(std.tqdm):
    """A bar for an output that is not a terminal: tqdm runs as usual but draws only its final line."""

    _final = False

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        return super().display(msg, pos) if self._final else False

    def clear(self, nolock: bool = False) -> None:
        """Nothing was drawn, so there is nothing to clear."""

    def close(self) -> None:
        """Draw the final line of a bar that stays (tqdm's `leave`: by default the outermost bar)."""
        leave = getattr(self, "leave", None)           # a disabled bar has neither attribute
        self._final = abs(getattr(self, "pos", 0)) == 0 if leave is None else bool(leave)
        super().close()


def progress_bar(iterable: Iterable[Any] | None = None, **options: Any) -> std.tqdm:
    """A tqdm bar over `iterable` (options as for `tqdm`: desc, total, leave, delay, disable, ...):
    throttled on a terminal, and a single final line (or nothing, with `leave=False`) elsewhere."""
    options.setdefault("mininterval", MININTERVAL_S)
    if autonotebook.tqdm is not std.tqdm or _is_terminal(options.get("file") or sys.stderr):
        return live_bar(iterable, **options)
    return _LogBar(iterable, **options)


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):           # no stream (pythonw), or a closed one
        return False
