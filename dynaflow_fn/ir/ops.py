"""Facts about aten ops that lowering needs: `out=` overloads, randomness, collectives.

Lowering writes every kernel's result into a planned buffer. For an op such as `aten.addmm.default`
the same packet holds `aten.addmm.out`, whose schema is the functional one plus keyword-only `out`
tensors. Only `out=` kernels known to write their result straight into `out` are used (see
`_writes_out_directly`); other ops allocate their result, which is always correct. Factory and conversion ops (`arange`, `_to_copy`) drop their dtype/device options in the
`out=` form, because the `out` tensor carries them. Ops with no such overload still run, allocating
their result; the Plan lists them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..compat import OpOverload, has_kernel_for

_TENSOR_OPTIONS = frozenset({"dtype", "layout", "device", "pin_memory"})


@dataclass(frozen=True)
class OutVariant:
    """How to call the `out=` overload of a functional op with the functional call's arguments."""

    op: OpOverload
    positional: tuple[str, ...]
    keyword: tuple[str, ...]
    out_names: tuple[str, ...]
    direct: bool    # True when the kernel is known to write its result straight into `out` (see below)

    def call_arguments(self, bound: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        """Positional and keyword arguments for `op`, from the functional call's bound arguments."""
        positional = []
        for name in self.positional:
            if name not in bound:
                break
            positional.append(bound[name])
        keyword = {name: bound[name] for name in self.keyword if name in bound}
        return positional, keyword


def _signature(arguments: Sequence[Any]) -> list[tuple[str, str]]:
    return [(a.name, str(a.type)) for a in arguments]


@functools.lru_cache(maxsize=None)
def out_variant(op: OpOverload) -> OutVariant | None:
    """The `out=` overload of a functional aten op, or None when it has none."""
    schema = op._schema
    if schema.is_mutable or any(r.alias_info is not None for r in schema.returns) or not schema.returns:
        return None
    if any(str(r.type) != "Tensor" for r in schema.returns):
        return None
    functional = _signature(schema.arguments)
    packet = op.overloadpacket
    for name in packet.overloads():
        candidate = getattr(packet, name)
        arguments = candidate._schema.arguments
        outs = [a for a in arguments if a.is_out]
        if not outs or len(outs) != len(schema.returns):
            continue
        inputs = [a for a in arguments if not a.is_out]
        wanted = [(n, t) for n, t in functional if not (n in _TENSOR_OPTIONS and n not in {a.name for a in inputs})]
        if _signature(inputs) != wanted:
            continue
        return OutVariant(
            op=candidate,
            positional=tuple(a.name for a in inputs if not a.kwarg_only),
            keyword=tuple(a.name for a in inputs if a.kwarg_only),
            out_names=tuple(a.name for a in outs),
            direct=_writes_out_directly(op, candidate),
        )
    return None


_VETTED_OUT_KERNELS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "_softmax", "_log_softmax", "_softmax_backward_data",
    "_log_softmax_backward_data", "cat", "cumsum",
})


def _writes_out_directly(op: OpOverload, out: OpOverload) -> bool:
    """Whether `out`'s kernel writes the final result into `out` and nothing else.

    Generated overloads (a CompositeExplicitAutograd kernel: run the functional op, copy into out) would
    add a copy kernel. Some hand-written ones use `out` as scratch first (`mse_loss.out` resizes it to
    the unreduced shape, which inside an arena writes past the buffer). Structured pointwise and
    reduction kernels, GEMMs, softmax and cat set the output shape once and write it: only those are used.
    """
    if has_kernel_for(out, "CompositeExplicitAutograd"):
        return False
    tags = set(op.tags)
    return (torch.Tag.pointwise in tags or getattr(torch.Tag, "reduction", None) in tags
            or op._schema.name.split("::")[-1] in _VETTED_OUT_KERNELS)


def bind_arguments(op: OpOverload, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Map a call's positional and keyword arguments to the schema's argument names."""
    bound = dict(kwargs)
    for argument, value in zip(op._schema.arguments, args):
        bound[argument.name] = value
    return bound


def replace_arguments(op: OpOverload, args: Sequence[Any], kwargs: dict[str, Any],
                      values: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """A call's (args, kwargs) with the named arguments set to `values`, each where the call passes it:
    positionally if its position is among `args`, else by keyword."""
    names = [argument.name for argument in op._schema.arguments]
    args, kwargs = list(args), dict(kwargs)
    for name, value in values.items():
        position = names.index(name)
        if position < len(args):
            args[position] = value
        else:
            kwargs[name] = value
    return tuple(args), kwargs


def is_view(op: Any) -> bool:
    """Whether every result aliases an input without writing it (view, t, expand, ...): from the schema,
    plus `wait_tensor`, which returns its input once the collective that produces it has finished."""
    if not isinstance(op, OpOverload) or not op._schema.returns:
        return False
    if is_collective_wait(op):
        return True
    return all(r.alias_info is not None and not r.alias_info.is_write for r in op._schema.returns)


def written_arguments(op: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
    """The values a call passes for the arguments the op writes (`self` of `add_`, `out` of an out=
    overload, the running statistics of batch norm): from the schema's alias annotations."""
    if not is_mutating(op):
        return []
    bound = bind_arguments(op, args, kwargs)
    return [bound[a.name] for a in op._schema.arguments
            if a.alias_info is not None and a.alias_info.is_write and a.name in bound]


def is_random(op: Any) -> bool:
    """Whether an op draws random numbers (its result must not be computed once and reused)."""
    return isinstance(op, OpOverload) and torch.Tag.nondeterministic_seeded in op.tags


def is_mutating(op: Any) -> bool:
    return isinstance(op, OpOverload) and op._schema.is_mutable


def is_pure(op: Any) -> bool:
    """Whether an op's result is fixed by its inputs alone: not random, not writing anything, not talking
    to other ranks. Such an op reading only constants is setup work (`analyses.setup_nodes`)."""
    return not (is_random(op) or is_mutating(op) or is_collective(op))


COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "_dtensor"})


def is_collective_wait(op: Any) -> bool:
    """`wait_tensor`: returns its input once the collective producing it has finished on the device."""
    return (isinstance(op, OpOverload) and op.namespace in COLLECTIVE_NAMESPACES
            and op._schema.name.endswith("wait_tensor"))


def is_collective(op: Any) -> bool:
    """Whether an op communicates with other ranks (a functional collective or its wait)."""
    return isinstance(op, OpOverload) and op.namespace in COLLECTIVE_NAMESPACES


def launches_collective(op: Any) -> bool:
    """Whether an op starts a collective (a collective other than its wait)."""
    return is_collective(op) and not is_collective_wait(op)
