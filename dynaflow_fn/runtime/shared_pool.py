"""Memory that several executables share because they never run at once: the plans of one function's
batch buckets (see `jitting.bucketing`).

An executable owns the memory it runs in: its arena of scratch buffers, its output buffers, on CUDA
its static input buffers and the private pool its graph's capture allocates from. Plans of the same
function at 35 batch sizes would hold 35 of each, though only one of them runs at a time. So, as
vLLM and SGLang do for their CUDA graphs of many batch sizes, they share one of each, sized by the
largest plan:

* one arena and one output buffer: each plan views the first bytes it needs of the buffer the first
  (largest) plan allocated; a plan needing more than that gets a buffer of its own;
* one static buffer per copied-in input: a smaller plan's is a view of the largest's (its first rows,
  when only the batch dimension differs and the view has the strides the plan was traced with);
* one CUDA graph pool (`torch.cuda.graph_pool_handle()`), captured into from one capture stream and
  one set of side streams, so that what one capture freed (temporaries, cuBLAS's workspace) the next
  capture reuses: the caching allocator reuses a freed block only on the stream that freed it.

Sharing is sound because the executables take one set of `Turns`: a call (or a capture, which runs
the plan once to warm up) holds them while it writes the shared buffers, and nothing in them outlives
a call. Arena buffers are scratch; outputs are handed out while no caller holds the last ones, which
takes one `Handouts` per output buffer, seen by every bucket (or, with `static_outputs`, overwritten by
the next call, whichever bucket it runs); setup results are constants of each plan, allocated apart.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from .handouts import Handouts
from .interpreter import byte_buffer
from .turns import Turns


class SharedPool:
    """The memory the executables of one function's buckets share, and the turns they take (module docstring).

    `shared_bytes` counts the buffers held here; `own_bytes` those handed out because the shared one
    was too small (a plan larger than the first)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.turns = Turns(device)
        self.graph_pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.shared_bytes = self.own_bytes = 0
        self._bytes: dict[str, torch.Tensor] = {}
        self._inputs: dict[tuple, torch.Tensor] = {}
        self._streams: dict[tuple[int, int], Any] = {}
        self._handouts: dict[str, Handouts] = {}
        self._lock = threading.Lock()

    def buffer(self, role: str, nbytes: int, sized_like: str | None = None) -> torch.Tensor:
        """`nbytes` of the buffer for `role` ("arena", "outputs"): the first request allocates it, at
        least as large as the buffer of `sized_like` if there is one (the first plan to ask for the
        outputs of a later capture may be any bucket's, not the largest's)."""
        with self._lock:
            held = self._bytes.get(role)
            if held is None:
                like = self._bytes.get(sized_like) if sized_like is not None else None
                held = self._bytes[role] = byte_buffer(max(nbytes, like.numel() if like is not None else 0),
                                                       self.device)
                self.shared_bytes += held.numel()
            elif held.numel() < nbytes:
                self.own_bytes += nbytes
                return byte_buffer(nbytes, self.device)
            return held[:max(nbytes, 16)]

    def handouts(self, role: str) -> Handouts:
        """What hands out the output buffer for `role` (see `runtime.handouts`): one for every plan bound
        in it, so that a call of any bucket sees what callers hold of another's results."""
        with self._lock:
            return self._handouts.setdefault(role, Handouts())

    def static_input(self, index: int, like: torch.Tensor) -> torch.Tensor:
        """A buffer for input `index` with the layout of `like`: a view of the first buffer of that input
        where one fits, else a new one (the first, or one of the executable's own)."""
        with self._lock:
            key = (index, like.dtype, like.dim())
            held = self._inputs.get(key)
            if held is not None:
                view = _view_like(held, like)
                if view is not None:
                    return view
            fresh = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=self.device)
            if held is None:
                self._inputs[key] = fresh
                self.shared_bytes += fresh.untyped_storage().nbytes()
            else:
                self.own_bytes += fresh.untyped_storage().nbytes()
            return fresh

    def stream(self, index: int, priority: int) -> "torch.cuda.Stream":
        """The stream every capture uses for plan stream `index` (0: the capture stream)."""
        with self._lock:
            stream = self._streams.get((index, priority))
            if stream is None:
                stream = self._streams[(index, priority)] = torch.cuda.Stream(self.device, priority=priority)
            return stream


def _view_like(held: torch.Tensor, like: torch.Tensor) -> torch.Tensor | None:
    """`held` cut to `like`'s shape along the one dimension they differ in, if `like` is no larger and
    the view has `like`'s strides exactly; else None."""
    differing = [d for d in range(held.dim()) if held.shape[d] != like.shape[d]]
    if len(differing) > 1 or any(like.shape[d] > held.shape[d] for d in differing):
        return None
    view = held.narrow(differing[0], 0, like.shape[differing[0]]) if differing else held
    return view if view.stride() == like.stride() else None
