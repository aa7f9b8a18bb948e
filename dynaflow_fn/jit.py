"""`df.jit`: trace, transform and lower on the first call for each input signature; replay after.

The cache key is the pytree structure of (args, kwargs) plus, per leaf, the shape, strides, dtype and
device of a tensor or the type and value of a static leaf, as in `jax.jit`. A call whose key is cached
runs its executable straight away: on CUDA that is input copies, one graph replay and output clones.

Hashing that key costs about half a microsecond per leaf, which for a decode step with hundreds of
weight tensors is as long as the replay itself. So a call first asks the entry used last whether it
admits the arguments (`_Guard`): the tensors a CUDA graph reads in place are recognized by identity
and version counter, and only the others are compared in full.
"""

from __future__ import annotations

import functools
import operator
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import optree
import torch

from . import autotune, distributed, tree
from .causal import use_causal_kernels
from .errors import InputError
from .inductor import compile_stages
from .lower import lower
from .plan import Plan
from .program import Program, dtype_name
from .runtime.cudagraph import AdoptedInputMoved, CudaGraphExecutable
from .runtime.eager import EagerExecutable
from .trace import trace
from .verify import verify

BACKENDS = ("auto", "eager", "cudagraph", "inductor")
RETRACE_WARNING_ENTRIES = 8


@dataclass(frozen=True)
class CacheInfo:
    """Counters of a jitted function: calls served from the cache, traces, graph captures, entries."""

    hits: int
    misses: int
    captures: int
    entries: int


def _signature(leaves: Sequence[Any]) -> tuple:
    """Per leaf: a tensor's shape, strides, dtype and device, or a static leaf's type and value."""
    return tuple([(leaf.shape, leaf.stride(), leaf.dtype, leaf.device) if isinstance(leaf, torch.Tensor)
                  else (type(leaf), leaf) for leaf in leaves])


def _picker(positions: Sequence[int]) -> Callable[[Sequence[Any]], tuple]:
    """A fast `lambda leaves: tuple(leaves[i] for i in positions)`."""
    if len(positions) > 1:
        return operator.itemgetter(*positions)
    return lambda leaves: tuple(leaves[i] for i in positions)


_VERSION = operator.attrgetter("_version")


class _Guard:
    """Whether a call's leaves fit the signature of the call that made this guard, cheaply.

    Pinned leaves are tensors a CUDA graph reads in place (parameters, donated and persistent
    arguments). Such a tensor is recognized by identity and version counter: every in-place change
    of its layout (resize_, set_, t_, unsqueeze_, ...) bumps the counter, and its address is checked
    by the executable on every call. What this cannot see is `t.data = v` with `v` at t's own address
    in another layout. Every other leaf is compared in full, as in the cache key.
    """

    def __init__(self, treedef: Any, leaves: Sequence[Any], pinned: Sequence[int]):
        self.treedef = treedef
        self.pick_pinned = _picker(pinned)
        chosen = set(pinned)
        self.pick_rest = _picker([i for i in range(len(leaves)) if i not in chosen])
        self.pinned = self.pick_pinned(leaves)
        self.versions = list(map(_VERSION, self.pinned))
        self.rest = _signature(self.pick_rest(leaves))

    def admits(self, treedef: Any, leaves: Sequence[Any]) -> bool:
        if treedef != self.treedef:
            return False
        pinned = self.pick_pinned(leaves)
        return (all(map(operator.is_, pinned, self.pinned)) and list(map(_VERSION, pinned)) == self.versions
                and _signature(self.pick_rest(leaves)) == self.rest)


class _Entry:
    """One cache entry: the plan for a signature and the executable that runs it."""

    def __init__(self, jitted: "Jitted", plan: Plan, tensor_positions: tuple[int, ...], donated: frozenset[int],
                 persistent: frozenset[int]):
        self.jitted = jitted
        self.plan = plan
        self.tensor_positions = tensor_positions
        self.pick_tensors = _picker(tensor_positions)
        self.in_place = donated | persistent
        self.backend = jitted.resolve_backend(plan.device)
        self.executable: Any = None
        self.guard: _Guard | None = None

    def _build(self, tensors: Sequence[torch.Tensor]) -> None:
        if self.executable is None and distributed.collective_signature(self.plan):
            distributed.check_consistent(self.plan)
        if self.backend == "cudagraph":
            adopt = [isinstance(t, torch.nn.Parameter) or i in self.in_place for i, t in enumerate(tensors)]
            self.executable = CudaGraphExecutable(self.plan, self.plan.device, tensors, adopt,
                                                  self.jitted.static_outputs)
            self.jitted.captures += 1
        else:
            self.executable = EagerExecutable(self.plan, self.plan.device)

    def __call__(self, treedef: Any, leaves: Sequence[Any]) -> Any:
        """Run on leaves whose full signature is this entry's; remember them for `replay`."""
        outputs = self.plan.unflatten_outputs(self.run(list(self.pick_tensors(leaves))))
        self.guard = _Guard(treedef, leaves, [self.tensor_positions[i] for i in self._pinned()])
        return outputs

    def replay(self, leaves: Sequence[Any]) -> Any:
        """Run on leaves that `guard` admitted. Raises AdoptedInputMoved if a tensor read in place has
        new memory, which may also mean a new layout (`t.data = ...`): the caller checks in full."""
        return self.plan.unflatten_outputs(self.executable(self.pick_tensors(leaves)))

    def _pinned(self) -> list[int]:
        """Tensor positions the executable reads in place and whose version counter can be read."""
        if not isinstance(self.executable, CudaGraphExecutable):
            return []
        return [i for i, adopted in enumerate(self.executable.adopt)
                if adopted and not self.executable.static_inputs[i].is_inference()]

    def run(self, tensors: Sequence[torch.Tensor]) -> list[Any]:
        if self.executable is None:
            self._build(tensors)
        try:
            return self.executable(tensors)
        except AdoptedInputMoved:
            self._build(tensors)
            return self.executable(tensors)

    def benchmark(self, leaves: Sequence[Any]) -> Callable[[], Any]:
        """A call of this entry on the given arguments that leaves them unchanged: inputs the plan writes
        (donated, mutated) are replaced by copies, so timing it many times has no effect outside."""
        tensors = [leaves[i] for i in self.tensor_positions]
        for i in self.plan.written_inputs():
            tensors[i] = tensors[i].clone()
        return lambda: self.run(tensors)


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
        self.donate_argnums = tuple(donate_argnums)
        self.persistent_argnums = tuple(persistent_argnums)
        self.static_outputs = static_outputs
        self._cache: dict[Any, _Entry] = {}
        self._last: _Entry | None = None
        self.hits = self.misses = self.captures = 0
        functools.update_wrapper(self, fn, updated=())

    # --- public API ------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, treedef = optree.tree_flatten((args, kwargs))
        last = self._last
        if last is not None and last.guard is not None and last.guard.admits(treedef, leaves):
            try:
                outputs = last.replay(leaves)
                self.hits += 1
                return outputs
            except AdoptedInputMoved:
                pass
        try:
            key = (treedef, _signature(leaves))
            entry = self._cache.get(key)
        except TypeError:
            key, entry = None, None
        if entry is None:
            entry = self._compile(args, kwargs, key)
        else:
            self.hits += 1
        self._last = entry if key is not None else None
        return entry(treedef, leaves)

    def trace(self, *args: Any, **kwargs: Any) -> Program:
        """The Program (after transforms) that a call with these arguments runs."""
        return use_causal_kernels(trace(self.fn, *args, **kwargs))

    def lower(self, *args: Any, **kwargs: Any) -> Plan:
        """The Plan that a call with these arguments runs (built, not run, if not cached yet; with
        strategy="auto" and no call yet, the plan without overlap, since choosing needs running)."""
        leaves, treedef = optree.tree_flatten((args, kwargs))
        entry = self._cache.get((treedef, _signature(leaves)))
        return entry.plan if entry is not None else self._plan(self.fn, args, kwargs)[0]

    def plans(self) -> list[Plan]:
        """The plans built so far, one per input signature, oldest first."""
        return [entry.plan for entry in self._cache.values()]

    def cache_info(self) -> CacheInfo:
        return CacheInfo(self.hits, self.misses, self.captures, len(self._cache))

    def clear_cache(self) -> None:
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

    def _plan(self, fn: Callable[..., Any], args: tuple, kwargs: dict
              ) -> tuple[Plan, tuple[int, ...], frozenset[int], frozenset[int]]:
        paths, leaves, _ = tree.flatten((args, kwargs))
        arg_names = tree.argument_names(self.fn, len(args))
        kinds = tree.classify_leaves(paths, leaves, arg_names)

        def tensors_of(argnums: Sequence[int], option: str) -> frozenset[int]:
            for index in argnums:
                if not 0 <= index < len(args):
                    raise InputError(f"{option} names argument {index}, but the call passes {len(args)} "
                                     f"positional arguments")
            return frozenset(k for k, i in enumerate(kinds.tensor_positions)
                             if paths[i] and paths[i][0] == 0 and paths[i][1] in argnums)

        donated = tensors_of(self.donate_argnums, "donate_argnums")
        persistent = tensors_of(self.persistent_argnums, "persistent_argnums")
        program = use_causal_kernels(trace(fn, *args, **kwargs))
        if self.backend == "inductor":
            program = compile_stages(program, self.progress)
        donation = _match_donations(program, donated,
                                    [tree.path_to_str(paths[i], arg_names) for i in kinds.tensor_positions],
                                    ["".join(f"[{key!r}]" for key in paths[i][1:]) for i in kinds.tensor_positions])
        plan = lower(program, donate=donation)
        if len(plan.streams) > 1:
            verify(plan)
        return plan, kinds.tensor_positions, donated, persistent

    def _compile(self, args: tuple, kwargs: dict, key: Any) -> _Entry:
        if self.strategy == "auto" and key is not None:
            entry = self._autotune(args, kwargs, key)
        else:
            entry = _Entry(self, *self._plan(self.fn, args, kwargs))
        self.misses += 1
        if key is not None:
            if len(self._cache) >= RETRACE_WARNING_ENTRIES:
                self._warn_retracing(next(reversed(self._cache)), key, args, kwargs)
            self._cache[key] = entry
        return entry

    def _autotune(self, args: tuple, kwargs: dict, key: Any) -> _Entry:
        """Pick this signature's strategy: from the on-disk decision, or by timing the candidates."""
        import torch.distributed as dist

        leaves = optree.tree_leaves((args, kwargs))
        device = next((leaf.device for leaf in leaves if isinstance(leaf, torch.Tensor)), torch.device("cpu"))
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        signature = repr(key)
        decision = autotune.decision_key(self.fn, signature, device, world)
        nccl = world > 1 and dist.get_backend() == "nccl"
        options = {c.name: c.fn for c in autotune.candidates(self.fn, self.in_axes, autotune.COMM_CTAS if nccl else ())}
        choice = autotune.load_decision(decision)
        if choice in options:
            self.choices[signature] = (choice, {})
            return _Entry(self, *self._plan(options[choice], args, kwargs))
        kept: dict[str, _Entry] = {}
        keep = {autotune.NO_OVERLAP}                 # the reference stays built; the others are dropped

        def build(name: str) -> Callable[[], float]:
            entry = kept.get(name) or _Entry(self, *self._plan(options[name], args, kwargs))
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
        self.choices[signature] = (choice, timings)
        return kept.get(choice) or _Entry(self, *self._plan(options[choice], args, kwargs))

    def _warn_retracing(self, previous: Any, key: Any, args: tuple, kwargs: dict) -> None:
        warnings.warn(
            f"{getattr(self.fn, '__name__', 'fn')} has been traced for {len(self._cache) + 1} different input "
            f"signatures ({_describe_change(previous, key, args, kwargs, self.fn)}). Each new shape, dtype, device "
            f"or static value traces and captures again; pad inputs to a few fixed shapes, or pass changing "
            f"scalars as tensors.", stacklevel=3)


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
            warnings.warn(f"donated input {input_paths[in_index]} is returned unchanged, so nothing updates it "
                          f"in place; check that the function returns its new value, or do not donate it",
                          stacklevel=4)
        wanted = node.meta["val"]
        same_place = output_positions.get(input_positions[in_index])
        candidates = [same_place] if fits(same_place, wanted) else [j for j in range(len(outputs)) if fits(j, wanted)]
        if candidates:
            claimed[candidates[0]] = in_index
        else:
            warnings.warn(f"donated input {input_paths[in_index]} matches no output of the same shape, strides and "
                          f"dtype, so nothing is written into it", stacklevel=4)
    return claimed


def _describe_change(old: Any, new: Any, args: tuple, kwargs: dict, fn: Callable[..., Any]) -> str:
    """Say which argument differs between two cache keys, by its path."""
    old_tree, old_leaves = old
    new_tree, new_leaves = new
    if old_tree != new_tree:
        return f"the argument structure changed from {old_tree} to {new_tree}"
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
    return repr(leaf_key[1])


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
