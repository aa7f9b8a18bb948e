"""What a call must satisfy to run the plan of an earlier call, checked cheaply on every call.

A plan is built from one call's arguments and from Python state that tracing and capture read:

* the arguments' pytree structure (with the key order of its dicts), each tensor's shape, strides,
  dtype and device, and each static leaf's value (`call.CallSignature`; the cache key, as in
  `jax.jit`);
* process-wide settings that change what is traced or which kernels a CUDA graph captures (autocast,
  the default dtype and device, deterministic algorithms, TF32 and reduced-precision matmuls:
  `call_state`);
* the `training` flag of every module whose flag the trace read (dropout, batch norm: `mode_reads`);
* the tensors the function closes over (their layout; they are resident);
* the Python state of the modules the trace called or closes over, and of a jitted method's
  instance: hooks, submodules, parameters, attributes (`object_watch`, one counter per call).

Building the full key costs about half a microsecond per leaf, as long as a replay for a decode step
with hundreds of weights, so a call first asks the `Guard` of the plan used last, which compares the
same fields against the call that built it. The comparison is most of what df.jit adds to a call, so
it runs in one C++ call (`native_check`): dynaflow_fn's own checks (`native.leaf_checker`, about 20 ns
a tensor) where they are built, else torch.compile's guards (`compat.leaf_checker`, about 130 ns), and
in Python where neither is at hand. What the C++ check compares, with the meaning `Guard` gives each
part:

* every tensor leaf, and every tensor the function closes over, by layout: the shape, strides, dtype
  and device, and also the Python type, dispatch keys and requires_grad, so a call that differs only
  there is checked in full and then runs the same plan (dynaflow_fn's checks compare a tensor's own
  dispatch keys; torch's TENSOR_MATCH compares them under the thread's settings, so that inside
  `torch.inference_mode()` it takes an inference tensor for an ordinary one);
* static leaves of the types whose `==` is their `static_key` equality (`_EQUAL_BY_KEY`: ints, bools,
  strings, bytes, dtypes, devices, and floats other than zeros and NaN), by exact type and `==`. The
  others are left to Python (`NativeCheck.python_positions`): `==` calls -0.0 equal to 0.0 and no
  NaN equal to another, and a dataclass compares its float fields the same lossy way;
* the `training` flag of every module whose flag the trace read.

The pytree structure and `call_state` are compared in Python (a fraction of a microsecond, and about
a microsecond to read the state). DYNAFLOW_PYTHON_GUARD=1 builds every guard with the Python check
instead, to compare the two or to rule this one out.
"""

from __future__ import annotations

import operator
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import optree
import torch

from .. import compat, native
from ..errors import GradientError, InputError
from ..ir.tree import leaf_key, picker
from . import object_watch
from .call import DictNodes, flattener

_TRAINING = operator.attrgetter("training")


_AUTOCAST_DEVICES = ("cuda", "cpu")
_default_dtype, _deterministic = torch.get_default_dtype, torch.are_deterministic_algorithms_enabled
_any_autocast, _function_modes, _matmul_readers = compat.any_autocast_enabled, compat.torch_function_modes, \
    compat.matmul_setting_readers


def call_state() -> tuple:
    """The process-wide settings a plan depends on besides its arguments, as one comparable tuple.

    Tracing reads autocast (it inserts casts), the default dtype and device (factory calls in the
    function) and any active torch-function mode; a CUDA graph freezes the kernels chosen under the
    matmul precision and determinism settings. Grad mode is not here: tracing always runs without
    gradients, and how a call's outputs relate to autograd is decided per call."""
    autocast = () if not _any_autocast() else tuple(
        (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)) for device in _AUTOCAST_DEVICES)
    modes = () if not _function_modes() else (str(torch.get_default_device()),)
    return _default_dtype(), _deterministic(), tuple([read() for read in _matmul_readers]), autocast, modes


PYTHON_GUARD_ENV = "DYNAFLOW_PYTHON_GUARD"

_EQUAL_BY_KEY = frozenset({int, bool, str, bytes, torch.dtype, torch.device, torch.layout, torch.memory_format})


@dataclass(frozen=True)
class NativeCheck:
    """A C++ check of `(leaves, fixed)`: a call's leaves, and the modules and closed-over tensors it was
    built with (`fixed`, in that order), except for the static leaves at `python_positions`, which the
    caller compares by key. The caller passes the pair, so that the call runs no Python here."""

    check: Callable[[Sequence[Any]], bool]
    python_positions: tuple[int, ...]


def native_check(leaves: Sequence[Any], modules: Sequence[torch.nn.Module],
                 closed_over: Sequence[torch.Tensor]) -> NativeCheck | None:
    """The C++ check of calls like this one: dynaflow_fn's own, else torch's guards; None where neither
    is at hand (or DYNAFLOW_PYTHON_GUARD=1): the caller then checks everything in Python."""
    if os.environ.get(PYTHON_GUARD_ENV) == "1":
        return None
    in_cpp = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) or _equal_by_key(leaf)]
    chosen = set(in_cpp)
    python_positions = tuple(i for i in range(len(leaves)) if i not in chosen)
    fixed = (*modules, *closed_over)
    checks = [compat.LeafCheck((0, i)) for i in in_cpp]
    checks += [compat.LeafCheck((1, k), "training") for k in range(len(modules))]
    checks += [compat.LeafCheck((1, k)) for k in range(len(modules), len(fixed))]
    example = (list(leaves), fixed)
    check = native.leaf_checker(example, checks)
    if check is None:
        check = compat.leaf_checker(example, checks)
    return None if check is None else NativeCheck(check, python_positions)


def _equal_by_key(leaf: Any) -> bool:
    """Whether `a == leaf` with `type(a) is type(leaf)` means `static_key(a) == static_key(leaf)`."""
    if type(leaf) is float:
        return leaf != 0.0 and leaf == leaf                    # not a zero (signed), not a NaN
    return type(leaf) in _EQUAL_BY_KEY


class Guard:
    """Whether a call fits the call that made this guard, cheaply, and with the meaning of a full lookup.

    A call fits when its pytree structure (with the type and key order of its dicts) and call state
    are the same, every static leaf has the same `static_key`, every module whose flag the trace read
    is in the same mode, and every tensor, the arguments' and those the function closes over, has the
    same layout: shape, strides, dtype and device. A tensor read in place may be another tensor
    object with the same layout; the executable checks its address and captures again if it moved.
    A changed layout is seen however it was made (`resize_`, `t_()`, `t.data = v` with `v` anywhere).
    One C++ call checks all of it (`native_check`) where dynaflow_fn's checks are built or torch has
    its guard manager; Python compares the same fields otherwise. The `watch` (an
    `object_watch.ObjectWatch`) says whether the modules' Python state is still as traced: while the
    process-wide counter of module changes has not moved, comparing it here says it all.
    """

    def __init__(self, treedef: Any, leaves: Sequence[Any], state: tuple, modules: Sequence[torch.nn.Module] = (),
                 closed_over: Sequence[torch.Tensor] = (), watch: Any = None):
        self.treedef = treedef
        tree = optree.tree_unflatten(treedef, leaves)                     # the structure keeps this call's order
        self.dicts = DictNodes.of(tree)
        known = flattener(tree)
        self.flatten_known = known[0] if known is not None else None
        self.state = state
        self.watch = watch if watch is not None and watch.watches_anything else None
        self.modules_only = self.watch is not None and not self.watch.instances   # then the counter says it all
        self.fixed = (*modules, *closed_over)
        native = native_check(leaves, modules, closed_over)
        # The C++ checks compare dispatch keys, and outside inference mode an inference tensor's lack the
        # ADInplaceOrView key every other tensor has: a guard built there admits no inference tensor
        # where the building call had none (TENSOR_MATCH's built inside inference mode may).
        self.refuses_inference_tensors = native is not None and not torch.is_inference_mode_enabled()
        if native is None:
            self.fit = _python_check(leaves, modules, closed_over)
        elif native.python_positions:
            self.fit = _with_python_leaves(native, leaves)
        else:
            self.fit = native.check

    def flatten(self, call: tuple) -> list[Any] | None:
        """The leaves of a call `(args, kwargs)` by this guard's structure, or None where it has another.
        A container where a leaf was comes out as that leaf (which `admits` then refuses); a dict of
        another type is left to `admits` (see `DictNodes`)."""
        try:
            return self.treedef.flatten_up_to(call)
        except (ValueError, TypeError):
            return None

    def admitted_leaves(self, call: tuple, state: tuple) -> list[Any] | None:
        """The leaves of a call `(args, kwargs)` made in `state`, if it fits; None if not, or if its
        structure differs in a way only a new flatten tells apart. With a flattener of the structure
        (`call.flattener`), the structure and its dicts are checked while flattening."""
        if self.flatten_known is None:
            leaves = self.flatten(call)
            return leaves if leaves is not None and self.admits(self.treedef, leaves, state, call) else None
        leaves = self.flatten_known(call)
        return leaves if leaves is not None and self._fits(leaves, state) else None

    def admits(self, treedef: Any, leaves: Sequence[Any], state: tuple, call: tuple | None = None) -> bool:
        """Whether a call flattened to (treedef, leaves) fits; `call` is its (args, kwargs), if at hand."""
        dicts = self.dicts
        return (treedef == self.treedef and self._fits(leaves, state)
                and (not dicts.nodes or dicts.match(optree.tree_unflatten(treedef, leaves) if call is None else call)))

    def _fits(self, leaves: Sequence[Any], state: tuple) -> bool:
        """Whether leaves of this guard's structure, in `state`, fit: the leaves, the modules' flags and
        Python state, the closed-over tensors."""
        watch = self.watch
        return (state == self.state and self.fit((leaves, self.fixed))
                and (watch is None or (watch.tick == object_watch.changes.tick and self.modules_only)
                     or watch.unchanged()))


def _python_check(leaves: Sequence[Any], modules: Sequence[torch.nn.Module],
                  closed_over: Sequence[torch.Tensor]) -> Callable[[tuple], bool]:
    """The check of `Guard` in Python, of a call's `(leaves, fixed)`: every field compared as the cache
    key compares it."""
    count = len(modules)
    expected = _keys(leaves), list(map(_TRAINING, modules)), _keys(closed_over)

    def check(call: tuple) -> bool:
        leaves, fixed = call
        return (_keys(leaves) == expected[0] and list(map(_TRAINING, fixed[:count])) == expected[1]
                and _keys(fixed[count:]) == expected[2])
    return check


def _with_python_leaves(native: NativeCheck, leaves: Sequence[Any]) -> Callable[[tuple], bool]:
    """The C++ check, and the static leaves it leaves out compared by key in Python."""
    pick, check = picker(native.python_positions), native.check
    expected = _keys(pick(leaves))
    return lambda call: check(call) and _keys(pick(call[0])) == expected


def _keys(leaves: Sequence[Any]) -> tuple:
    return tuple(map(leaf_key, leaves))


def modes_unchanged(module_modes: Sequence[tuple[torch.nn.Module, bool]]) -> bool:
    """Whether every module whose flag a trace read is still in the train/eval mode it was traced in."""
    return all(module.training == training for module, training in module_modes)


def check_no_aliasing(tensors: Sequence[torch.Tensor], written: Sequence[int], names: Sequence[str]) -> None:
    """Refuse a call in which a tensor the plan writes shares memory with another input.

    A trace sees each argument as a tensor of its own. If `fn` writes `x` (an in-place update, or a
    donated argument) and `y` is `x`, or a view overlapping it, eager PyTorch would read the new
    values through `y` and the plan reads the old ones (or a half-written buffer): a different result.
    Read-only aliasing is harmless and allowed. Memory is compared by byte range within a storage,
    so two interleaved views (x[::2], x[1::2]) count as overlapping: pass a copy then. A written
    tensor whose own elements share memory (an expanded view) is refused too, as eager PyTorch
    refuses writing it."""
    by_storage = _spans_by_storage(tensors, range(len(tensors)))
    for index in written:
        if not tensors[index].numel():
            continue
        if compat.has_internal_overlap(tensors[index]):
            tensor = tensors[index]
            raise InputError(f"the function writes {names[index]} in place, but elements of {names[index]} share "
                             f"memory (shape {list(tensor.shape)}, strides {list(tensor.stride())}: an expanded "
                             f"view), which eager PyTorch refuses to write too. Pass a tensor of its own "
                             f"({names[index]}.clone())")
        storage, start, end = _byte_span(tensors[index])
        for other_start, other_end, other in by_storage[storage]:
            if other != index and other_start < end and start < other_end:
                raise _aliasing_error(names, index, other)


class WrittenBytes:
    """The bytes the written inputs of a call checked in full (`check_no_aliasing`) occupy, to check a
    later call of the same plan against when all of them are resident.

    A call that the guard admitted and whose resident inputs are at the addresses the executable
    captured (it checks them) has its written inputs in the very bytes of this call, with the layouts
    the guard checked, and they overlapped nothing then: only the `others`, the inputs that are not
    resident, need comparing with them. `check` measures those few tensors instead of every written
    one (a KV cache has two per layer). They hold for the `executable` whose resident addresses they
    are: a call whose resident inputs moved fails its address check before it runs anything and is
    checked in full, and the new capture is measured anew."""

    def __init__(self, tensors: Sequence[torch.Tensor], written: Sequence[int], others: Sequence[int],
                 executable: Any):
        self.by_storage = _spans_by_storage(tensors, written)
        self.others = others
        self.executable = executable

    def check(self, tensors: Sequence[torch.Tensor], names: Sequence[str]) -> None:
        """Refuse a call in which one of the other inputs overlaps a written one."""
        by_storage = self.by_storage
        for other in self.others:
            tensor = tensors[other]
            spans = by_storage.get(tensor.untyped_storage().data_ptr())
            if spans is None or tensor.numel() == 0:
                continue
            _, start, end = _byte_span(tensor)
            for written_start, written_end, index in spans:
                if written_start < end and start < written_end:
                    raise _aliasing_error(names, index, other)


def _byte_span(tensor: torch.Tensor) -> tuple[int, int, int]:
    """(the address of its storage, the first byte, the end) of the bytes a non-empty tensor's elements
    can occupy."""
    start = tensor.storage_offset() * tensor.element_size()
    extent = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride())) + 1
    return tensor.untyped_storage().data_ptr(), start, start + extent * tensor.element_size()


def _spans_by_storage(tensors: Sequence[torch.Tensor], indices: Any) -> dict[int, list[tuple[int, int, int]]]:
    """The (first byte, end, index) of the tensors at `indices`, grouped by the address of their storage."""
    by_storage: dict[int, list[tuple[int, int, int]]] = {}
    for index in indices:
        tensor = tensors[index]
        if tensor.numel():
            storage, start, end = _byte_span(tensor)
            by_storage.setdefault(storage, []).append((start, end, index))
    return by_storage


def _aliasing_error(names: Sequence[str], written: int, other: int) -> InputError:
    return InputError(
        f"{names[written]} and {names[other]} share memory, and the function writes {names[written]} "
        f"(an in-place update or a donated argument). A traced program sees them as separate "
        f"tensors, so it would not compute what eager PyTorch computes. Pass a copy "
        f"({names[other]}.clone()) or pass the tensor once.")


def check_updates_allowed(tensors: Sequence[torch.Tensor], updated: Sequence[int], names: Sequence[str],
                          fn_name: str) -> None:
    """Refuse a call, with grad mode on, that would update in place a tensor requiring grad: the function
    does so outside its own `torch.no_grad()` (`gradients.GradientFlow.updated`). Eager PyTorch refuses a
    leaf (a parameter) or a view of one; for any other such tensor it records the update in the autograd
    graph, which a compiled plan cannot."""
    for index in updated:
        tensor = tensors[index]
        if not tensor.requires_grad:
            continue
        name = names[index]
        what = (f"{name} is a leaf tensor that requires grad, and for the same call eager PyTorch raises \"a leaf "
                f"Variable that requires grad is being used in an in-place operation\"" if tensor.is_leaf else
                f"{name} requires grad and is no leaf: a view of one, which eager PyTorch refuses too (\"a view of a "
                f"leaf Variable that requires grad is being used in an in-place operation\"), or the result of an "
                f"op, whose in-place update eager PyTorch records in the autograd graph and a compiled plan cannot")
        raise GradientError(
            f"df.jit({fn_name}) updates {name} in place while gradients are recorded: {what}. Update it under "
            f"torch.no_grad() (inside the function, or around the call), or pass {name}.detach() if the update "
            f"need not reach the autograd graph.")


def check_no_inference_writes(tensors: Sequence[torch.Tensor], written: Sequence[int], names: Sequence[str],
                              fn_name: str) -> None:
    """Refuse a call, outside `torch.inference_mode()`, whose plan writes an inference tensor (one made
    under inference mode). Eager PyTorch raises on the update; the plan would run its steps, some of
    them writing into the input's memory, and fail at its write-back with torch's own error."""
    for index in written:
        if tensors[index].is_inference():
            name = names[index]
            raise InputError(
                f"df.jit({fn_name}) writes {name} (an in-place update or a donated argument), an inference tensor "
                f"made under torch.inference_mode(); eager PyTorch refuses to update one outside inference mode "
                f"too. Call the function under torch.inference_mode(), or pass {name}.clone().")
