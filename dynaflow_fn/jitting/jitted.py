"""`df.jit`: trace, transform and lower on the first call for each input signature; replay after.

A plan is built for one input signature and one state of the caller's program (see `guard`): a call
whose signature and state match an entry runs its executable straight away, which on CUDA is input
copies, one graph replay and output clones. Every call is checked, never assumed: the arguments'
structure and layouts, the process-wide settings tracing reads, the train/eval mode of the modules
whose flag the trace read, and the tensors the function closes over (read in place, like parameters).

A call that would compute something other than `fn` is refused with a named error instead: arguments
that share memory with one the plan writes, or backward through a plan's outputs.

Called while ops are traced or transformed (inside another jitted function, `df.trace`, `torch.func.vmap`
or `torch.func.grad`), a jitted function runs its Python function, so that the trace or transform sees
its ops, as `jax.jit` inside `jax.jit` is inlined.

`Jitted` is the cache; what it runs on a miss is `pipeline` (trace, passes, lower), what it keeps is
an `entry.Entry` per plan, and `strategy="auto"` picks among candidate functions in `autotune`.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import optree
import torch

from .. import compat
from ..errors import InPlaceInputMoved, InputError
from ..ir.program import Program
from ..plan.plan import Plan
from . import autotune, methods, pipeline
from .cold_start import ColdStart
from .donation import match_donations
from .entry import Entry
from .guard import call_state, modes_unchanged, signature
from .inputs import TensorInputs, argnums
from .object_watch import ObjectWatch
from .retrace import RETRACE_WARNING_ENTRIES, warn_retracing

BACKENDS = ("auto", "eager", "cudagraph", "inductor")
_ops_are_transformed = compat.ops_are_transformed
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


@dataclass(frozen=True)
class CacheInfo:
    """Counters of a jitted function: calls served from the cache, traces, graph captures, entries."""

    hits: int
    misses: int
    captures: int
    entries: int


class Jitted:
    """A function compiled per input signature into a static Plan and run by a backend."""

    def __init__(self, fn: Callable[..., Any], backend: str, donate_argnums: Sequence[int],
                 persistent_argnums: Sequence[int], static_outputs: bool, strategy: str | None = None,
                 in_axes: Any = None, progress: bool = True):
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        if strategy not in (None, "auto"):
            raise ValueError(f"jit takes strategy=None or 'auto', got {strategy!r}; to fix a strategy, transform "
                             f"the function: df.jit(T.overlap(fn, strategy={strategy!r}))")
        if in_axes is not None and strategy != "auto":
            raise ValueError("in_axes tells strategy='auto' how to micro-batch; pass strategy='auto' with it")
        self.fn = fn
        self.name = getattr(fn, "__name__", "fn")
        self.strategy, self.in_axes, self.progress = strategy, in_axes, progress
        self.choices: dict[str, autotune.Choice] = {}
        self.backend = backend
        self.donate_argnums = argnums(donate_argnums, "donate_argnums")
        self.persistent_argnums = argnums(persistent_argnums, "persistent_argnums")
        self.static_outputs = static_outputs
        self._cache: dict[Any, list[Entry]] = {}
        self._compiling = threading.RLock()
        self._last: Entry | None = None
        self.hits = self.misses = self.captures = 0
        functools.update_wrapper(self, fn, updated=())

    # --- public API ------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _ops_are_transformed():                 # inside a trace, vmap or grad: inlined, as jax.jit in jax.jit
            return self.fn(*args, **kwargs)
        if not kwargs and all(type(arg) in _PLAIN_TENSORS for arg in args):
            leaves, treedef = list(args), _positional_treedef(len(args))     # what optree would return, sooner
        else:
            leaves, treedef = optree.tree_flatten((args, kwargs))
        state = call_state()
        last = self._last
        if last is not None and last.guard is not None and last.guard.admits(treedef, leaves, state):
            try:
                outputs = last.replay(leaves)
                self.hits += 1
                return outputs
            except InPlaceInputMoved:
                pass
        try:
            key = (treedef, signature(leaves), state)
            entry = self._find(key)
        except TypeError:
            key, entry = None, None
        if entry is None:
            with self._compiling:                      # threads missing at once build the entry once
                entry = self._find(key) if key is not None else None
                if entry is None:
                    entry = self._compile(args, kwargs, key)
                else:
                    self.hits += 1
        else:
            self.hits += 1
        self._last = entry if key is not None else None
        return entry.call(treedef, leaves, state)

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        """As a method (`@df.jit` in a class body): the jitted function bound to `instance`, one per
        instance, kept while it lives (see `methods`)."""
        return self if instance is None else methods.bound(self, instance)

    def trace(self, *args: Any, **kwargs: Any) -> Program:
        """The Program (after transforms) that a call with these arguments runs."""
        return pipeline.traced(self.fn, args, kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> Plan:
        """The Plan that a call with these arguments runs (built, not run, if not cached yet; with
        strategy="auto" and no call yet, the plan without overlap, since choosing needs running)."""
        leaves, treedef = optree.tree_flatten((args, kwargs))
        entry = self._find((treedef, signature(leaves), call_state()))
        return entry.plan if entry is not None else self._entry(self.fn, args, kwargs).plan

    def plans(self) -> list[Plan]:
        """The plans built so far, one per input signature and program state, oldest first."""
        return [entry.plan for entries in self._cache.values() for entry in entries]

    def cache_info(self) -> CacheInfo:
        return CacheInfo(self.hits, self.misses, self.captures, sum(map(len, self._cache.values())))

    def clear_cache(self) -> None:
        """Forget every plan (and free its CUDA graph and buffers once no output refers to them).

        Needed only after changing Python state that tracing read and no check can see, such as a
        global the function branches on, a closure variable rebound to another tensor, or a module's
        hook dict edited directly (see `object_watch`)."""
        with self._compiling:
            self._cache.clear()
            self._last = None

    def resolve_backend(self, device: torch.device) -> str:
        """The runtime of a plan: Inductor's stages run inside the same CUDA graph or interpreter."""
        if self.backend in ("auto", "inductor"):
            return "cudagraph" if device.type == "cuda" else "eager"
        if self.backend == "cudagraph" and device.type != "cuda":
            raise InputError(f"backend='cudagraph' needs CUDA tensors, but the arguments are on {device}; "
                             f"use backend='auto' or 'eager'")
        return self.backend

    # --- compilation -----------------------------------------------------------------------------

    def _find(self, key: Any) -> Entry | None:
        """The entry for this key whose modules are in the modes they were traced in; entries whose
        closed-over tensors changed layout can never run again and are dropped."""
        entries = self._cache.get(key)
        if not entries:
            return None
        live = [entry for entry in entries if not entry.stale()]
        if len(live) < len(entries):
            self._cache[key] = live
        return next((entry for entry in live if modes_unchanged(entry.module_modes) and entry.watch.unchanged()), None)

    def _entry(self, fn: Callable[..., Any], args: tuple, kwargs: dict, cold_start: ColdStart | None = None
               ) -> Entry:
        """Trace, compile and lower `fn` for these arguments (see `pipeline`), timing each phase."""
        cold_start = cold_start or ColdStart(self.name, show=False)
        inputs = TensorInputs.of(self.fn, args, kwargs, self.donate_argnums, self.persistent_argnums)
        with cold_start.phase("trace"):
            program = pipeline.traced(fn, args, kwargs)
        kernels = pipeline.kernels(self.backend, program.device)
        with cold_start.phase(kernels):
            program = pipeline.compiled(program, kernels, self.progress)
        with cold_start.phase("lower"):
            plan = pipeline.lowered(program, match_donations(program, inputs))
        return Entry(plan, program.module_modes, inputs, self.resolve_backend(plan.device), self.static_outputs,
                     self._count_capture, self.name, cold_start, ObjectWatch(program.objects_read),
                     program.gradient_flow)

    def _count_capture(self) -> None:
        self.captures += 1

    def _compile(self, args: tuple, kwargs: dict, key: Any) -> Entry:
        if self.strategy == "auto" and key is not None:
            entry = self._autotune(args, kwargs, key)
        else:
            entry = self._entry(self.fn, args, kwargs, ColdStart(self.name, self.progress))
        self.misses += 1
        if key is not None:
            entries = self.cache_info().entries
            if entries >= RETRACE_WARNING_ENTRIES:
                warn_retracing(self.fn, next(reversed(self._cache)), key, args, kwargs, entries + 1)
            self._cache.setdefault(key, []).append(entry)
        return entry

    def _autotune(self, args: tuple, kwargs: dict, key: Any) -> Entry:
        """This signature's entry for the strategy `autotune` picks: stored on disk, or timed now."""
        described = repr(key)
        measured_for = f"backend={self.backend!r} {described}"     # a choice made with other kernels may differ
        choice, entry = autotune.tune(self.fn, self.in_axes, args, kwargs, measured_for,
                                      lambda candidate: self._entry(candidate, args, kwargs), self.progress)
        self.choices[described] = choice
        return entry


@functools.lru_cache(maxsize=None)
def _positional_treedef(count: int) -> Any:
    """The pytree structure of `count` positional leaves and no keywords."""
    return optree.tree_structure(((0,) * count, {}))


def jit(fn: Callable[..., Any] | None = None, *, backend: str = "auto", donate_argnums: Sequence[int] = (),
        persistent_argnums: Sequence[int] = (), static_outputs: bool = False, strategy: str | None = None,
        in_axes: Any = None, progress: bool = True) -> Any:
    """Compile `fn` into a static Plan per input signature and run it with a backend.

    backend: "auto": on a CUDA device Triton serves, every stage compiled by TorchInductor and the plan
        replayed as one CUDA graph; aten kernels in a CUDA graph on other CUDA devices; the eager
        interpreter elsewhere. "cudagraph": aten kernels (eager's own) in one CUDA graph; "inductor":
        Inductor's kernels on any device (C++ on the CPU); "eager": the interpreter.
    donate_argnums: positional arguments whose tensors the function may overwrite: each output with the
        shape, strides and dtype of a donated tensor is written into it in place and returned as it.
    persistent_argnums: positional arguments that persist across calls (KV caches passed as plain
        tensors): the CUDA graph reads them at their own address instead of copying them in. Pass the
        same tensors every call; a different tensor there captures the graph again. A model's state
        needs no naming: `nn.Parameter`s, every tensor `df.pure` hands out (buffers included), tensors
        marked with `torch._dynamo.mark_static_address`, donated arguments and closed-over tensors are
        always read in place (see `state`). Such tensors are recognized per call by
        identity, version counter and address, not by re-reading their layout, so assigning
        `t.data = v` with `v` a view of t's own memory in another layout goes unnoticed: pass `v`.
    static_outputs: return the plan's own output buffers instead of fresh copies (CUDA-graph backend):
        faster, but the next call overwrites them.
    strategy: None runs `fn` as given (transform it to choose a strategy yourself); "auto" times candidate
        strategies on the device for each new input signature and keeps the fastest, never slower than no
        overlap, remembering the choice on disk (see `autotune`). `in_axes` (as for `T.microbatch`) lets
        it try micro-batched candidates; `progress` shows a progress bar while it measures.

    >>> fast = df.jit(fn)
    >>> y = fast(params, x)          # traces, lowers and captures on the first call
    >>> print(fast.lower(params, x)) # the Plan
    """
    options = dict(backend=backend, donate_argnums=donate_argnums, persistent_argnums=persistent_argnums,
                   static_outputs=static_outputs, strategy=strategy, in_axes=in_axes, progress=progress)
    if fn is None:
        return functools.partial(jit, **options)
    return Jitted(fn, **options)
