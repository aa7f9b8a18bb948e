"""Calls of one executable take turns.

An executable owns memory that every call reuses: the arena, and on the cudagraph runtime the static
input and output buffers. Two threads calling at once would write each other's inputs and read each
other's results, so calls hold a lock. On CUDA the lock is not enough: a call only enqueues work, so
the next call, if it comes from another stream (another thread's, or one the caller switched to),
first waits for everything the previous call's stream had enqueued, its output copies included.
Calls from the same stream are ordered by the stream itself and cost nothing more.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from .. import compat


class Turns:
    def __init__(self, device: torch.device):
        self.lock = threading.Lock()
        self.cuda = device.type == "cuda"
        self.device_index = device.index if device.index is not None else 0
        self.previous: Any = None

    def __enter__(self) -> "Turns":
        self.lock.acquire()
        if self.cuda:
            stream = compat.current_stream_id(self.device_index)
            if self.previous is not None and stream != self.previous:
                torch.cuda.current_stream(self.device_index).wait_stream(compat.stream_from_id(self.previous))
            self.previous = stream
        return self

    def __exit__(self, *exc: Any) -> None:
        self.lock.release()
