"""`df.jit`: trace, transform and lower on the first call for each input signature; replay after.

A plan is built for one input signature and one state of the caller's program (see `guard`): a call
whose signature and state match an entry runs its executable straight away, which on CUDA is input
copies, one graph replay and output clones. Every call is checked, never assumed: the arguments'
structure and layouts, the process-wide settings tracing reads, the train/eval mode of the modules
whose flag the trace read, and the tensors the function closes over (read in place, like parameters).

A call that would compute something other than `fn` is refused with a named error instead: arguments
that share memory with one the plan writes, or backward through a plan's outputs.
"""

from __future__ import annotations

import functools
import operator
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import optree
import torch

from .. import compat, distributed
from ..errors import InputError, warn
from ..ir import tree
from ..ir.program import Program, dtype_name
from ..ir.tree import TensorSpec
from ..lowering.lower import lower
from ..passes.causal import use_causal_kernels
from ..passes.inductor import compile_stages
from ..plan.plan import Plan
from ..plan.verify import verify
from ..runtime.cudagraph import AdoptedInputMoved, CudaGraphExecutable
from ..runtime.eager import EagerExecutable
from ..tracing.tracer import trace
from . import autotune
from .guard import Guard, call_state, check_no_aliasing, modes_unchanged, picker, signature

BACKENDS = ("auto", "eager", "cudagraph", "inductor")
RETRACE_WARNING_ENTRIES = 8
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


@dataclass(frozen=True)
class CacheInfo:
    """Counters of a jitted function: calls served from the cache, traces, graph captures, entries."""

    hits: int
    misses: int
    captures: int
    entries: int


class _Entry:
    """One cache entry: the plan for a signature, the state it was traced in, and its executable.

    The executable's tensor inputs are the argument tensors (flat, in order) and then the tensors
    the function closes over."""

    def __init__(self, jitted: "Jitted", plan: Plan, module_modes: Sequence[tuple[torch.nn.Module, bool]],
                 tensor_positions: tuple[int, ...], in_place: frozenset[int], names: Sequence[str]):
        self.jitted = jitted
        self.plan = plan
        self.module_modes = tuple(module_modes)
        self.tensor_positions = tensor_positions
        self.pick_tensors = picker(tensor_positions)
        self.captured = [c.tensor for c in plan.captured]
        self.captured_specs = [TensorSpec.of(t) for t in self.captured]
        self.in_place = in_place | set(range(len(tensor_positions), len(tensor_positions) + len(self.captured)))
        self.names = list(names) + [c.name for c in plan.captured]
        self.written = plan.written_inputs()
        returned_inputs = set(plan.input_slots)
        self.differentiable = [i for i, slot in enumerate(plan.output_slots) if slot not in returned_inputs]
        self.only_output = plan.out_tree.is_leaf() and len(plan.outputs) == 1 and plan.outputs[0].tensor_index == 0
        self.no_backward = (f"backward through the outputs of df.jit({getattr(jitted.fn, '__name__', 'fn')}): a "
                            f"compiled plan records no autograd graph. Differentiate inside the jitted function "
                            f"(df.value_and_grad / df.grad return the gradients), or call it under "
                            f"torch.no_grad() when no gradient is needed.").encode()
        self.backend = jitted.resolve_backend(plan.device)
        self.executable: Any = None
        self.guard: Guard | None = None
        self._building = threading.Lock()              # threads arriving at once capture once

    def stale(self) -> bool:
        """Whether a closed-over tensor has changed layout: this entry can never run again."""
        return any(TensorSpec.of(t) != spec for t, spec in zip(self.captured, self.captured_specs))

    def __call__(self, treedef: Any, leaves: Sequence[Any], state: tuple) -> Any:
        """Run on leaves whose full signature, state and modes are this entry's; remember them for `replay`."""
        outputs = self.run(self._tensors(leaves), rebuild_if_moved=True)
        self.guard = self._guard(treedef, leaves, state)
        return outputs

    def replay(self, leaves: Sequence[Any]) -> Any:
        """Run on leaves that `guard` admitted. Raises AdoptedInputMoved if a tensor read in place has
        new memory, which may also mean a new layout (`t.data = ...`): the caller checks in full."""
        return self.run(self._tensors(leaves), rebuild_if_moved=False)

    def _tensors(self, leaves: Sequence[Any]) -> list[torch.Tensor]:
        """The executable's inputs: the argument tensors, then the closed-over ones."""
        tensors = list(self.pick_tensors(leaves))
        if self.captured:
            tensors += self.captured
        return tensors

    def _guard(self, treedef: Any, leaves: Sequence[Any], state: tuple) -> Guard:
        adopted = set(self._pinned())
        arguments = len(self.tensor_positions)
        return Guard(treedef, leaves, [self.tensor_positions[i] for i in adopted if i < arguments], state,
                     [m for m, _ in self.module_modes],
                     captured_pinned=[self.captured[i - arguments] for i in adopted if i >= arguments],
                     captured_compared=[t for k, t in enumerate(self.captured) if arguments + k not in adopted])

    def _pinned(self) -> list[int]:
        """Tensor positions the executable reads in place and whose version counter can be read."""
        if not isinstance(self.executable, CudaGraphExecutable):
            return []
        return [i for i, adopted in enumerate(self.executable.adopt)
                if adopted and not self.executable.static_inputs[i].is_inference()]

    def _build(self, tensors: Sequence[torch.Tensor], replacing: Any) -> Any:
        """The executable, built for these tensors unless another thread built it meanwhile; `replacing`
        is the executable found unfit for them (its inputs read in place moved), or None."""
        with self._building:
            if self.executable is not replacing:
                return self.executable
            if replacing is None and distributed.collective_signature(self.plan):
                distributed.check_consistent(self.plan)
            if self.backend == "cudagraph":
                adopt = [(isinstance(t, torch.nn.Parameter) or i in self.in_place) and t.device == self.plan.device
                         for i, t in enumerate(tensors)]
                self.executable = CudaGraphExecutable(self.plan, self.plan.device, tensors, adopt,
                                                      self.jitted.static_outputs)
                self.jitted.captures += 1
            else:
                self.executable = EagerExecutable(self.plan, self.plan.device)
            return self.executable

    def run(self, tensors: list[torch.Tensor], rebuild_if_moved: bool) -> Any:
        if self.written:
            check_no_aliasing(tensors, self.written, self.names)
        executable = self.executable or self._build(tensors, None)
        try:
            outputs = executable(tensors)
        except AdoptedInputMoved:
            if not rebuild_if_moved:
                raise
            outputs = self._build(tensors, executable)(tensors)
        if torch.is_grad_enabled() and self.differentiable and any(map(_REQUIRES_GRAD, tensors)):
            outputs = self._without_backward(outputs)
        return outputs[0] if self.only_output else self.plan.unflatten_outputs(outputs)

    def _without_backward(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Outputs that, like eager ones computed from tensors requiring grad, require grad; their
        backward raises an error that says why df.jit has none and what to do instead."""
        chosen = [i for i in self.differentiable if outputs[i].is_floating_point() or outputs[i].is_complex()]
        if not chosen:
            return outputs
        outputs = list(outputs)
        for i, tensor in zip(chosen, compat.without_backward([outputs[i] for i in chosen], self.no_backward)):
            outputs[i] = tensor
        return outputs

    def benchmark(self, leaves: Sequence[Any]) -> Callable[[], Any]:
        """A call of this entry on the given arguments that leaves them unchanged: inputs the plan writes
        (donated, mutated) are replaced by copies, so timing it many times has no effect outside."""
        tensors = self._tensors(leaves)
        for i in self.written:
            tensors[i] = tensors[i].clone()
        return lambda: self.run(tensors, rebuild_if_moved=True)


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
        self.strategy, self.in_axes, self.progress = strategy, in_axes, progress
        self.choices: dict[str, tuple[str, dict[str, float]]] = {}
        self.backend = backend
        self.donate_argnums = _argnums(donate_argnums, "donate_argnums")
        self.persistent_argnums = _argnums(persistent_argnums, "persistent_argnums")
        self.static_outputs = static_outputs
        self._cache: dict[Any, list[_Entry]] = {}
        self._compiling = threading.RLock()
        self._last: _Entry | None = None
        self.hits = self.misses = self.captures = 0
        functools.update_wrapper(self, fn, updated=())

    # --- public API ------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
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
            except AdoptedInputMoved:
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
        return entry(treedef, leaves, state)

    def trace(self, *args: Any, **kwargs: Any) -> Program:
        """The Program (after transforms) that a call with these arguments runs."""
        return use_causal_kernels(trace(self.fn, *args, **kwargs))

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
        module attribute other than `training` or a global the function branches on."""
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

    def _find(self, key: Any) -> _Entry | None:
        """The entry for this key whose modules are in the modes they were traced in; entries whose
        closed-over tensors changed layout can never run again and are dropped."""
        entries = self._cache.get(key)
        if not entries:
            return None
        live = [entry for entry in entries if not entry.stale()]
        if len(live) < len(entries):
            self._cache[key] = live
        return next((entry for entry in live if modes_unchanged(entry.module_modes)), None)

    def _entry(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> _Entry:
        """Trace, transform and lower `fn` for these arguments."""
        paths, leaves, _ = tree.flatten((args, kwargs))
        arg_names = tree.argument_names(self.fn, len(args))
        kinds = tree.classify_leaves(paths, leaves, arg_names)
        names = [tree.path_to_str(paths[i], arg_names) for i in kinds.tensor_positions]

        def tensors_of(argnums: Sequence[int], option: str) -> frozenset[int]:
            for index in argnums:
                if not 0 <= index < len(args):
                    raise InputError(f"{option} names argument {index}, but the call passes {len(args)} "
                                     f"positional arguments")
                if not any(paths[i][:2] == (0, index) for i in kinds.tensor_positions):
                    name = arg_names[index] if index < len(arg_names) else f"args[{index}]"
                    raise InputError(f"{option} names argument {index} ({name}), which holds no tensor "
                                     f"(it is a {type(args[index]).__name__}); {option} applies to tensors only")
            return frozenset(k for k, i in enumerate(kinds.tensor_positions)
                             if paths[i] and paths[i][0] == 0 and paths[i][1] in argnums)

        donated = tensors_of(self.donate_argnums, "donate_argnums")
        persistent = tensors_of(self.persistent_argnums, "persistent_argnums")
        program = use_causal_kernels(trace(fn, *args, **kwargs))
        if self.backend == "inductor":
            program = compile_stages(program, self.progress)
        donation = _match_donations(program, donated, names,
                                    ["".join(f"[{key!r}]" for key in paths[i][1:]) for i in kinds.tensor_positions])
        plan = lower(program, donate=donation)
        if len(plan.streams) > 1:
            verify(plan)
        return _Entry(self, plan, program.module_modes, kinds.tensor_positions, donated | persistent, names)

    def _compile(self, args: tuple, kwargs: dict, key: Any) -> _Entry:
        if self.strategy == "auto" and key is not None:
            entry = self._autotune(args, kwargs, key)
        else:
            entry = self._entry(self.fn, args, kwargs)
        self.misses += 1
        if key is not None:
            entries = self.cache_info().entries
            if entries >= RETRACE_WARNING_ENTRIES:
                self._warn_retracing(next(reversed(self._cache)), key, args, kwargs, entries + 1)
            self._cache.setdefault(key, []).append(entry)
        return entry

    def _autotune(self, args: tuple, kwargs: dict, key: Any) -> _Entry:
        """Pick this signature's strategy: from the on-disk decision, or by timing the candidates."""
        import torch.distributed as dist

        leaves = optree.tree_leaves((args, kwargs))
        device = next((leaf.device for leaf in leaves if isinstance(leaf, torch.Tensor)), torch.device("cpu"))
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        described = repr(key)
        nccl = world > 1 and dist.get_backend() == "nccl"
        if self.in_axes is not None:
            autotune.check_in_axes(self.fn, self.in_axes, args, kwargs)
        options = {c.name: c.fn for c in autotune.candidates(self.fn, self.in_axes, autotune.COMM_CTAS if nccl else ())}
        decision = autotune.decision_key(self.fn, described, device, world, list(options))
        choice = autotune.load_decision(decision)
        if choice in options:
            self.choices[described] = (choice, {})
            return self._entry(options[choice], args, kwargs)
        kept: dict[str, _Entry] = {}
        keep = {autotune.NO_OVERLAP}                 # the reference stays built; the others are dropped

        def build(name: str) -> Callable[[], float]:
            entry = kept.get(name) or self._entry(options[name], args, kwargs)
            if name in keep:
                kept[name] = entry
            call = entry.benchmark(leaves)
            return lambda: autotune.median_ms(call, device)

        timings = autotune.measure(list(options), build, self.progress)
        choice = autotune.agree(autotune.choose(timings))
        if choice != autotune.NO_OVERLAP:
            # The fastest of many noisy timings is biased to look fast: time the winner again, alone
            # with no overlap, and keep it only if it still wins.
            keep.add(choice)
            rematch = autotune.measure([autotune.NO_OVERLAP, choice], build, self.progress)
            choice = autotune.agree(autotune.choose(rematch))
            timings = {**timings, **{f"{name} (rematch)": ms for name, ms in rematch.items()}}
        if world == 1 or dist.get_rank() == 0:
            autotune.store_decision(decision, choice, timings)
        self.choices[described] = (choice, timings)
        return kept.get(choice) or self._entry(options[choice], args, kwargs)

    def _warn_retracing(self, previous: Any, key: Any, args: tuple, kwargs: dict, traced: int) -> None:
        warn(
            f"{getattr(self.fn, '__name__', 'fn')} has been traced for {traced} different input "
            f"signatures ({_describe_change(previous, key, args, kwargs, self.fn)}). Each new shape, dtype, device "
            f"or static value traces and captures again; pad inputs to a few fixed shapes, or pass changing "
            f"scalars as tensors.")


@functools.lru_cache(maxsize=None)
def _positional_treedef(count: int) -> Any:
    """The pytree structure of `count` positional leaves and no keywords."""
    return optree.tree_structure(((0,) * count, {}))


def _argnums(argnums: Any, option: str) -> tuple[int, ...]:
    """`donate_argnums` / `persistent_argnums` as a tuple of ints (one int is accepted, as in JAX)."""
    if isinstance(argnums, int) and not isinstance(argnums, bool):
        return (argnums,)
    if not isinstance(argnums, (tuple, list)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in argnums):
        raise InputError(f"{option} takes positions of positional arguments (an int or a tuple of ints), got {argnums!r}")
    return tuple(argnums)


def _match_donations(program: Program, donated: frozenset[int], input_paths: Sequence[str],
                     input_positions: Sequence[str]) -> dict[int, int]:
    """Pair each donated tensor input with an output of the same shape, strides and dtype: the output at
    the same position (`params, state = step(params, state, ...)` pairs out[0][k] with argument 0's [k]),
    else the first unclaimed one in order."""
    if not donated:
        return {}
    placeholders = program.placeholders()
    outputs = list(program.output_node().args[0])
    output_positions = {spec.path[len("out"):]: spec.tensor_index for spec in program.outputs
                        if spec.tensor_index is not None}
    claimed: dict[int, int] = {}

    def fits(out_index: int | None, wanted: torch.Tensor) -> bool:
        value = outputs[out_index].meta.get("val") if out_index is not None else None
        return out_index not in claimed and isinstance(value, torch.Tensor) and (
            (value.shape, value.stride(), value.dtype) == (wanted.shape, wanted.stride(), wanted.dtype))

    for in_index in sorted(donated):
        node = placeholders[in_index]
        if node in outputs:
            warn(f"donated input {input_paths[in_index]} is returned unchanged, so nothing updates it "
                 f"in place; check that the function returns its new value, or do not donate it")
        wanted = node.meta["val"]
        same_place = output_positions.get(input_positions[in_index])
        candidates = [same_place] if fits(same_place, wanted) else [j for j in range(len(outputs)) if fits(j, wanted)]
        if candidates:
            claimed[candidates[0]] = in_index
        else:
            warn(f"donated input {input_paths[in_index]} matches no output of the same shape, strides and "
                 f"dtype, so nothing is written into it")
    return claimed


def _describe_change(old: Any, new: Any, args: tuple, kwargs: dict, fn: Callable[..., Any]) -> str:
    """Say which argument differs between two cache keys, by its path."""
    old_tree, old_leaves, old_state = old
    new_tree, new_leaves, new_state = new
    if old_tree != new_tree:
        return f"the argument structure changed from {old_tree} to {new_tree}"
    if old_state != new_state:
        return ("process-wide settings changed (autocast, the default dtype or device, deterministic algorithms "
                "or matmul precision)")
    paths, _, _ = tree.flatten((args, kwargs))
    arg_names = tree.argument_names(fn, len(args))
    for path, a, b in zip(paths, old_leaves, new_leaves):
        if a != b:
            return f"{tree.path_to_str(path, arg_names)} changed from {_leaf_text(a)} to {_leaf_text(b)}"
    return "no visible change"


def _leaf_text(leaf_key: tuple) -> str:
    if len(leaf_key) == 4:
        shape, _, dtype, device = leaf_key
        return f"{dtype_name(dtype)}{list(shape)} on {device}"
    kind, value = leaf_key[0], leaf_key[1]
    if kind is float:
        return "nan" if value == "nan" else repr(float.fromhex(value))
    return repr(value)


def jit(fn: Callable[..., Any] | None = None, *, backend: str = "auto", donate_argnums: Sequence[int] = (),
        persistent_argnums: Sequence[int] = (), static_outputs: bool = False, strategy: str | None = None,
        in_axes: Any = None, progress: bool = True) -> Any:
    """Compile `fn` into a static Plan per input signature and run it with a backend.

    backend: "auto" (a CUDA graph on CUDA, the eager interpreter elsewhere), "cudagraph", "eager", or
        "inductor": every stage compiled by TorchInductor, then run like "auto" (see `inductor`).
    donate_argnums: positional arguments whose tensors the function may overwrite: each output with the
        shape, strides and dtype of a donated tensor is written into it in place and returned as it.
    persistent_argnums: positional arguments that persist across calls (parameter dicts with buffers,
        KV caches): the CUDA graph reads them at their own address instead of copying them in. Pass the
        same tensors every call; a different tensor there captures the graph again. `nn.Parameter`s
        and donated arguments are always read in place. Such tensors are recognized per call by
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
