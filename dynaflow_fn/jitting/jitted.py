"""`df.jit`: trace, transform and lower on the first call for each call signature; replay after.

A plan is built for one call signature (`call.CallSignature`) and one state of the caller's
program (see `guard`): a call that matches runs its executable straight away, which on CUDA is input
copies, one graph replay and output clones. Every call is checked, never assumed: the arguments'
structure and layouts, the process-wide settings tracing reads, the train/eval mode of the modules
whose flag the trace read, and the tensors the function closes over (resident, like parameters).

A call that would compute something other than `fn` is refused with a named error instead: arguments
that share memory with one the plan writes, or backward through a plan's outputs.

The path of a call: `Jitted.__call__` flattens the arguments by the structure of the last call and
the last plan's `Guard` admits the call (`Guard.admitted_leaves`: a function written for that
structure, `call.flattener`, flattens and checks its dicts in one pass, a tenth of a new flatten);
else it flattens them anew and the cache finds or builds a `Replayer` by the signature; a miss runs the
`Pipeline` (trace -> passes -> lower -> verify) and binds the Plan to the call (`Binding`);
`strategy="auto"` chooses among candidate functions (`autotune`). With `buckets`, `bucketing` pads the
call to its bucket first and gives each bucket the last plan it ran and one memory pool for all.

Called while ops are traced or transformed (inside another jitted function, `df.trace`, `torch.func.vmap`
or `torch.func.grad`), a jitted function runs its Python function, so that the trace or transform sees
its ops, as `jax.jit` inside `jax.jit` is inlined.
"""

from __future__ import annotations

import copy
import functools
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import optree
import torch

from .. import compat
from ..errors import InputError, ResidentInputMoved
from ..ir.program import Program
from ..ir.tree import Flat
from ..plan.plan import Plan
from ..runtime.shared_pool import SharedPool
from . import autotune, methods
from .binding import Binding
from .bucketing import Bucketing
from .call import RETRACE_WARNING_ENTRIES, CallSignature, warn_retracing
from .guard import call_state, modes_unchanged
from .inputs import TensorInputs, written_into_donated
from .object_watch import ObjectWatch
from .options import JitOptions
from .pipeline import ColdStart, Pipeline
from .replayer import Replayer

_PLAIN_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})
_mode_depth, _recording_mode, _interpreter = \
    compat.dispatch_mode_depth, compat.recording_mode_active, compat.functorch_interpreter


def ops_are_transformed() -> bool:
    """Whether the ops called now are recorded or transformed rather than only computed: a recording
    dispatch mode is active (any trace, a FlopCounterMode) or a torch.func transform runs (vmap, grad).
    A jitted function called then inlines its Python, as jax.jit does inside jax.jit. Two C calls
    where torch has them (`compat.dispatch_mode_depth`, `compat.functorch_interpreter`)."""
    return (_mode_depth() > 0 and _recording_mode()) or _interpreter() is not None


@dataclass(frozen=True)
class CacheInfo:
    """Counters of a jitted function: calls served from the cache, traces, graph captures, entries; with
    buckets, the rows padded and the real rows over all calls; and the device memory its CUDA graphs
    hold: arena, output and static input buffers, and the pool segments their captures added (see
    `runtime.cudagraph` for how each is counted)."""

    hits: int
    misses: int
    captures: int
    entries: int
    padded_rows: int = 0
    real_rows: int = 0
    graph_memory_bytes: int = 0

    @property
    def padding_waste(self) -> float:
        """Padded rows per real row, over all calls (0.25: a quarter more rows computed than asked for)."""
        return self.padded_rows / self.real_rows if self.real_rows else 0.0

    def __str__(self) -> str:
        text = (f"{self.hits} hits, {self.misses} misses, {self.captures} captures, {self.entries} plans, "
                f"graph memory {self.graph_memory_bytes / 2**20:.1f} MiB")
        if self.real_rows:
            text += (f", padding waste {self.padding_waste:.1%} ({self.padded_rows} padded rows for "
                     f"{self.real_rows} real ones)")
        return text


class Jitted:
    """A function compiled per call signature into a static Plan and run by its runtime."""

    def __init__(self, fn: Callable[..., Any], options: JitOptions):
        if not callable(fn):
            raise InputError(f"df.jit compiles a function, got {type(fn).__name__} {fn!r:.60}")
        self.fn = fn
        self.name = getattr(fn, "__name__", "fn")
        self.options = options
        self.pipeline = Pipeline(fn, options)
        self.choices: dict[str, autotune.Choice] = {}
        self._cache: dict[CallSignature, list[Replayer]] = {}
        self._compiling = threading.RLock()
        self._last: Replayer | None = None
        self.hits = self.misses = self.captures = 0
        self.bucketing = Bucketing(self) if options.buckets is not None else None
        functools.update_wrapper(self, fn, updated=())

    # --- public API ------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if ops_are_transformed():                  # inside a trace, vmap or grad: inlined, as jax.jit in jax.jit
            result = self.fn(*args, **kwargs)
            if self.options.donate_argnums:        # donated arguments updated in place, as a plan's call does
                return written_into_donated(self.fn, args, kwargs, result, self.options.donate_argnums)
            return result
        call, last = (args, kwargs), self._last
        if last is not None and last.guard is not None and self.bucketing is None:
            leaves = last.guard.admitted_leaves(call, call_state())       # by the last call's structure
            if leaves is not None:
                try:
                    outputs = last.replay(leaves)
                    self.hits += 1
                    return outputs
                except ResidentInputMoved:
                    pass
            last = None                                     # asked already
        if not kwargs and _PLAIN_TENSORS.issuperset(map(type, args)):
            leaves, treedef = list(args), _positional_treedef(len(args))     # what optree would return, sooner
        else:
            leaves, treedef = optree.tree_flatten(call)
        if self.bucketing is not None:
            return self.bucketing.call(leaves, treedef)
        outputs, self._last = self._run(leaves, treedef, last, call)
        return outputs

    def _replay(self, leaves: list[Any], treedef: Any, last: Replayer, call: tuple[tuple, dict] | None,
                state: tuple | None = None) -> tuple[Any, bool]:
        """Replay `last`'s plan if its guard admits the call: (outputs, True), else (None, False)."""
        if last.guard.admits(treedef, leaves, call_state() if state is None else state, call):
            try:
                outputs = last.replay(leaves)
                self.hits += 1
                return outputs, True
            except ResidentInputMoved:
                pass
        return None, False

    def _run(self, leaves: list[Any], treedef: Any, last: Replayer | None,
            call: tuple[tuple, dict] | None = None) -> tuple[Any, Replayer | None]:
        """Run the plan for a call flattened to `leaves`: `last`'s, if its guard admits the call, else the
        one the cache holds or a new one. Returns the outputs and the replayer to ask first next time
        (None when the call cannot be cached). `call` is the (args, kwargs) the leaves came from."""
        state = call_state()
        if last is not None and last.guard is not None:
            outputs, replayed = self._replay(leaves, treedef, last, call, state)
            if replayed:
                return outputs, last
        replayer, cached = self._entry(leaves, treedef, state, call)
        return replayer.call(treedef, leaves, state), replayer if cached else None

    def _entry(self, leaves: list[Any], treedef: Any, state: tuple,
              call: tuple[tuple, dict] | None = None) -> tuple[Replayer, bool]:
        """The cache's replayer for this call, built if there is none, and whether it is cached."""
        args, kwargs = call if call is not None else optree.tree_unflatten(treedef, leaves)
        flat = Flat(args, kwargs, leaves, treedef)
        signature = CallSignature.of(flat, state)
        replayer = self._find(signature) if signature is not None else None
        if replayer is None:
            with self._compiling:                      # threads missing at once build the plan once
                replayer = self._find(signature) if signature is not None else None
                if replayer is None:
                    return self._compile(flat, signature), signature is not None
        self.hits += 1
        return replayer, True

    def __deepcopy__(self, memo: dict) -> "Jitted":
        """A jitted deep copy of the function, with an empty cache. Plans hold the original's tensors,
        locks and graphs, which neither copy nor pickle; a module deep-copied along with its jitted
        forward (`self.fast = df.jit(self.body)`) gets one of the copy, through `memo`."""
        return Jitted(copy.deepcopy(self.fn, memo), self.options)

    def __reduce__(self) -> tuple:
        """Pickled (and `copy.copy`-ed) as the function and the options: the copy traces afresh."""
        return Jitted, (self.fn, self.options)

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        """As a method (`@df.jit` in a class body): the jitted function bound to `instance`, one per
        instance, kept while it lives (see `methods`)."""
        return self if instance is None else methods.bound(self, instance)

    def trace(self, *args: Any, **kwargs: Any) -> Program:
        """The Program (after transforms and the passes that choose its kernels' form, before lowering)
        that a call with these arguments runs."""
        flat = self._as_planned(Flat.of(args, kwargs))
        return self.pipeline.build(self.fn, flat, self._inputs(flat), until="causal masks").program

    def lower(self, *args: Any, **kwargs: Any) -> Plan:
        """The Plan that a call with these arguments runs (built, not run, if not cached yet; with
        strategy="auto" and no call yet, the plan without overlap, since choosing needs running)."""
        flat = self._as_planned(Flat.of(args, kwargs))
        signature = CallSignature.of(flat, call_state())
        replayer = self._find(signature) if signature is not None else None
        return replayer.plan if replayer is not None else self._replayer(self.fn, flat).plan

    def plans(self) -> list[Plan]:
        """The plans built so far, one per call signature and program state, oldest first."""
        return [replayer.plan for replayers in self._cache.values() for replayer in replayers]

    def cache_info(self) -> CacheInfo:
        replayers = [replayer for replayers in self._cache.values() for replayer in replayers]
        rows = (self.bucketing.padded_rows, self.bucketing.real_rows) if self.bucketing is not None else (0, 0)
        return CacheInfo(self.hits, self.misses, self.captures, len(replayers), *rows,
                         sum(replayer.graph_memory_bytes for replayer in replayers))

    def clear_cache(self) -> None:
        """Forget every plan (and free its CUDA graph and buffers once no output refers to them).

        Needed only after changing Python state that tracing read and no check can see, such as a
        global the function branches on, a closure variable rebound to another tensor, or a module's
        hook dict edited directly (see `object_watch`)."""
        with self._compiling:
            self._cache.clear()
            self._last = None
            if self.bucketing is not None:
                self.bucketing.clear()

    # --- compilation -----------------------------------------------------------------------------

    def _find(self, signature: CallSignature) -> Replayer | None:
        """The plan for this signature whose modules are in the modes they were traced in; plans whose
        closed-over tensors changed layout can never run again and are dropped."""
        replayers = self._cache.get(signature)
        if not replayers:
            return None
        live = [replayer for replayer in replayers if not replayer.binding.stale()]
        if len(live) < len(replayers):
            self._cache[signature] = live
        return next((r for r in live if modes_unchanged(r.binding.module_modes) and r.binding.watch.unchanged()), None)

    def _as_planned(self, flat: Flat) -> Flat:
        """The call as its plan takes it: padded to its bucket, with buckets."""
        return self.bucketing.padded(flat) if self.bucketing is not None else flat

    def _inputs(self, flat: Flat) -> TensorInputs:
        return TensorInputs.of(self.fn, flat, self.options.donate_argnums, self.options.persistent_argnums)

    def _replayer(self, fn: Callable[..., Any], flat: Flat, cold_start: ColdStart | None = None,
                  memory: SharedPool | None = None) -> Replayer:
        """`fn` (the function, or a candidate strategy of it) through the pipeline for this call, bound;
        its executable built in `memory` if given (shared by the plans of a function's buckets)."""
        inputs = self._inputs(flat)
        built = self.pipeline.build(fn, flat, inputs, cold_start)
        program = built.program
        binding = Binding(built.plan, program.module_modes, inputs, self.name, ObjectWatch(program.objects_read),
                          program.gradient_flow)
        return Replayer(binding, self.options.runtime(built.plan.device), self.options.static_outputs,
                        self._count_capture, cold_start, memory)

    def _count_capture(self) -> None:
        self.captures += 1

    def _compile(self, flat: Flat, signature: CallSignature | None) -> Replayer:
        memory, label = self.bucketing.compiling(flat) if self.bucketing is not None else (None, self.name)
        if self.options.strategy == "auto" and signature is not None:
            replayer = self._autotune(flat, signature, memory)
        else:
            replayer = self._replayer(self.fn, flat, ColdStart(label, self.options.progress), memory)
        self.misses += 1
        if signature is not None:
            entries = self.cache_info().entries
            if entries >= RETRACE_WARNING_ENTRIES:
                warn_retracing(self.fn, next(reversed(self._cache)), signature, flat, entries + 1)
            self._cache.setdefault(signature, []).append(replayer)
        return replayer

    def _autotune(self, flat: Flat, signature: CallSignature, memory: SharedPool | None) -> Replayer:
        """This signature's plan for the strategy `autotune` picks: stored on disk, or timed now. With
        buckets, micro-batched candidates are tried only where the bucket has rows for them."""
        described = repr(signature)
        measured_for = f"backend={self.options.backend!r} {described}"   # a choice made with other kernels may differ
        rows = self.bucketing.layout(flat.leaves, flat.treedef).rows(flat.leaves) if self.bucketing else None
        choice, replayer = autotune.tune(self.fn, self.options.in_axes, flat, measured_for,
                                         lambda candidate: self._replayer(candidate, flat, memory=memory),
                                         self.options.progress, rows)
        self.choices[described] = choice
        return replayer


@functools.lru_cache(maxsize=None)
def _positional_treedef(count: int) -> Any:
    """The pytree structure of `count` positional leaves and no keywords."""
    return optree.tree_structure(((0,) * count, {}))


def jit(fn: Callable[..., Any] | None = None, *, backend: str = "auto", donate_argnums: Sequence[int] = (),
        persistent_argnums: Sequence[int] = (), static_outputs: bool = False, strategy: str | None = None,
        in_axes: Any = None, buckets: Sequence[int] | str | None = None, out_axes: Any = 0, pad_value: Any = 0,
        progress: bool = True) -> Any:
    """Compile `fn` into a static Plan per input signature and return a `Jitted` that runs it.

    `fast = df.jit(fn, **options)`, or a decorator, with or without options: `@df.jit(donate_argnums=(0, 1))`.

    fn: the function to compile, of tensors and pytrees of them (`df.pure(model)`'s, or a transform's).
        Tensors it closes over are inputs, never constants. Left out, `jit` returns a decorator.
    backend: "auto" (the default): Inductor's kernels in one CUDA graph on a CUDA device Triton serves,
        aten kernels in one CUDA graph on other CUDA devices, the interpreter elsewhere; "cudagraph": aten
        kernels (eager's own) in one CUDA graph; "inductor": Inductor's on any device; "eager": the interpreter.
    donate_argnums: positional arguments whose tensors the function may overwrite: an output with a donated
        tensor's layout is written into it and returned as it (`params, state = step(params, state, batch)`).
    persistent_argnums: positional arguments that persist across calls (KV caches passed as plain
        tensors): resident, read and written by the CUDA graph at their own address, never copied in;
        another tensor there captures again. Model state is resident unnamed (parameters, `df.pure`'s
        tensors, `mark_static_address`, donated, closed-over and updated tensors: see
        `dynaflow_fn.jitting.state`); a tensor given a new layout traces again, one moved captures again.
    static_outputs: CUDA graphs hand out their output buffers, replayed only while no caller holds them
        (README, aliasing rule); with this, one graph's on every call: the next call overwrites them.
    strategy: None (the default) runs `fn` as given (`df.jit(T.overlap(fn, strategy="tbo"))` fixes one);
        "auto" times candidate strategies on the device per input signature and keeps the fastest, never
        slower than no overlap, remembering the choice on disk (see `dynaflow_fn.jitting.autotune`).
    in_axes: the batch axis of each argument (None: not batched), a pytree prefix of the positional
        arguments as for `T.microbatch` (`(None, 0)` for `fn(params, x)`): what strategy="auto" also
        tries micro-batching, and what buckets pad.
    buckets: batch sizes to plan, smallest first, or "serving" (vLLM's 35 sizes up to 256). A call pads
        the in_axes axes to the next bucket, runs that bucket's plan and returns outputs cut to the real
        rows; the plans share the memory of the largest (see `dynaflow_fn.jitting.bucketing`). Padding is
        exact for functions whose rows are independent; others warn, as micro-batching does.
    out_axes: with buckets, each output's batch axis (a pytree prefix; None: returned as it is).
    pad_value: with buckets, what padded rows hold (default zeros): a scalar, or a pytree prefix of the
        positional arguments (a dummy KV cache slot for a slot index, so padded rows write nothing real).
    progress: show progress bars for a first call taking over two seconds (ending with each phase's
        time), Inductor's compilation and strategy="auto"'s measurements; one line each in a log.

    The returned `Jitted` is called like `fn`, and has these methods and attributes:

    fast(*args, **kwargs): runs the plan of this input signature (built on its first call).
    fast.trace(*args, **kwargs): the Program (after transforms) that a call with these arguments runs.
    fast.lower(*args, **kwargs): the Plan that such a call runs, built if need be but not run (with
        strategy="auto" before any call: the plan without overlap).
    fast.plans(): every Plan built so far, one per input signature and program state, oldest first.
    fast.cache_info(): `CacheInfo(hits, misses, captures, entries, padded_rows, real_rows, graph_memory_bytes)`:
        cached calls, planned calls, captures (for held results too), plans, padded and real rows, memory.
    fast.clear_cache(): forget every plan (freed once no output refers to it), after changing Python state
        tracing read and no per-call check sees (a module attribute other than `training`, a global).
    fast.pipeline: the stages a plan is built by; `fast.pipeline.run(*args, **kwargs)` returns every
        stage's result (Programs, then the Plan), each printable.
    fast.choices: with strategy="auto", the `Choice` per input signature: the strategy, its timings and
        the candidates skipped, with why.
    """
    options = JitOptions(backend=backend, donate_argnums=donate_argnums, persistent_argnums=persistent_argnums,
                         static_outputs=static_outputs, strategy=strategy, in_axes=in_axes, progress=progress,
                         buckets=buckets, out_axes=out_axes, pad_value=pad_value)
    if fn is None:
        return lambda fn: Jitted(fn, options)
    return Jitted(fn, options)
