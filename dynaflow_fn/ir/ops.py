"""Facts about aten ops, one cached `OpInfo` per overload: names, schema, aliasing, variants.

Every stage asks the same questions of an op (what is it called, which arguments does it take,
does it write one, which overload computes it into `out=` or in place), so the answers are read
from the op's schema once (through `compat.op_schema`) and kept as plain data. Op tables across
the package are keyed by `OpInfo.packet`, the operator without its overload (`aten.mm`,
`_c10d_functional.all_reduce`), the way `print(program)` spells a default overload.

Lowering writes every kernel's result into a planned buffer. For an op such as `aten.addmm.default`
the same packet holds `aten.addmm.out`, whose schema is the functional one plus keyword-only `out`
tensors. Only `out=` kernels known to write their result straight into `out` are used (see
`_writes_out_directly`); other ops allocate their result, which is always correct. Factory and
conversion ops (`arange`, `_to_copy`) drop their dtype/device options in the `out=` form, because
the `out` tensor carries them. Ops with no such overload still run, allocating their result; the
Plan lists them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..compat import OpOverload, has_kernel_for, op_schema

_TENSOR_OPTIONS = frozenset({"dtype", "layout", "device", "pin_memory"})
COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "_dtensor"})
RESHAPES = frozenset({"aten.view", "aten._reshape_alias", "aten.transpose", "aten.t", "aten.permute", "aten.expand",
                      "aten.unsqueeze", "aten.squeeze", "aten.unflatten", "aten.alias"})
"""The views that only give their input another shape and strides (`OpInfo.is_reshape`)."""


@dataclass(frozen=True)
class Argument:
    """One argument or result of an op's schema, as plain data."""

    name: str
    type: str               # as the schema's type prints: "Tensor", "List[Tensor]", "int?"
    kwarg_only: bool = False
    is_out: bool = False    # an `out=` tensor
    aliased: bool = False   # shares memory with another argument or result (`Tensor(a)`)
    written: bool = False   # the op writes into it (`Tensor(a!)`)


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


@dataclass(frozen=True)
class OpInfo:
    """What the package knows about one op overload, read from its schema and tags once."""

    op: OpOverload
    namespace: str                  # "aten"
    packet: str                     # "aten.add": the operator, all its overloads; the key of op tables
    overload: str                   # "Tensor", "default"
    arguments: tuple[Argument, ...]
    returns: tuple[Argument, ...]
    is_mutable: bool                # writes one of its arguments
    tags: frozenset[torch.Tag]

    @property
    def name(self) -> str:
        """The name `print(program)` shows: `aten.mm` for a default overload, `aten.add.Tensor` otherwise."""
        return self.packet if self.overload == "default" else f"{self.packet}.{self.overload}"

    @property
    def path(self) -> str:
        """`torch.ops.aten.add.Tensor`: Python that evaluates to the overload itself."""
        return f"torch.ops.{self.packet}.{self.overload}"

    @property
    def is_collective(self) -> bool:
        """Whether the op communicates with other ranks (a functional collective or its wait)."""
        return self.namespace in COLLECTIVE_NAMESPACES

    @property
    def is_collective_wait(self) -> bool:
        """`wait_tensor`: returns its input once the collective producing it has finished on the device."""
        return self.is_collective and self.packet.endswith("wait_tensor")

    @property
    def is_view(self) -> bool:
        """Whether every result aliases an input without writing it (view, t, expand, ...), or the op is
        `wait_tensor`, which returns its input once the collective that produces it has finished."""
        if not self.returns:
            return False
        return self.is_collective_wait or all(r.aliased and not r.written for r in self.returns)

    @property
    def is_reshape(self) -> bool:
        """A view that gives its input another shape and strides (view, transpose, expand, ...): it starts
        where its input starts, and its arguments are sizes and dimensions, never an offset into it."""
        return self.packet in RESHAPES

    @functools.cached_property
    def out_variant(self) -> OutVariant | None:
        """The `out=` overload of a functional op, or None when it has none."""
        if self.is_mutable or not self.returns or any(r.aliased or r.type != "Tensor" for r in self.returns):
            return None
        functional = [(a.name, a.type) for a in self.arguments]
        packet = self.op.overloadpacket
        for overload in packet.overloads():
            candidate = op_info(getattr(packet, overload))
            outs = [a for a in candidate.arguments if a.is_out]
            if not outs or len(outs) != len(self.returns):
                continue
            inputs = [a for a in candidate.arguments if not a.is_out]
            names = {a.name for a in inputs}
            wanted = [(n, t) for n, t in functional if not (n in _TENSOR_OPTIONS and n not in names)]
            if [(a.name, a.type) for a in inputs] != wanted:
                continue
            return OutVariant(op=candidate.op, positional=tuple(a.name for a in inputs if not a.kwarg_only),
                              keyword=tuple(a.name for a in inputs if a.kwarg_only),
                              out_names=tuple(a.name for a in outs), direct=_writes_out_directly(self, candidate))
        return None

    @functools.cached_property
    def inplace_variant(self) -> OpOverload | None:
        """`aten.add_.Tensor` for `aten.add.Tensor`, `aten._fused_adamw_` for `aten._fused_adamw`: the
        overload that writes its results into the arguments it mutates, which must lead its argument
        list and correspond one to one, in order, to this op's results. None when there is none."""
        if self.is_mutable:
            return None
        operator_name = self.packet.split(".", 1)[1]
        packet = getattr(getattr(torch.ops, self.namespace), operator_name + "_", None)
        candidate = getattr(packet, self.overload, None) if packet is not None else None
        if not isinstance(candidate, OpOverload):
            return None
        written = [i for i, a in enumerate(op_info(candidate).arguments) if a.written]
        if not written or written != list(range(len(written))) or len(written) != len(self.returns):
            return None
        signature = lambda arguments: [(a.name, a.type) for a in arguments]
        return candidate if signature(op_info(candidate).arguments) == signature(self.arguments) else None


def op_info(target: object) -> OpInfo | None:
    """The facts about an op overload; None for a target that is none (getitem, a compiled run)."""
    return _op_info(target) if isinstance(target, OpOverload) else None


@functools.cache
def _op_info(op: OpOverload) -> OpInfo:
    schema = op_schema(op)
    namespace, _, operator_name = schema.name.partition("::")

    def plain(argument: Any) -> Argument:
        alias = argument.alias_info
        return Argument(argument.name, str(argument.type), argument.kwarg_only, argument.is_out,
                        aliased=alias is not None, written=alias is not None and alias.is_write)

    return OpInfo(op=op, namespace=namespace, packet=f"{namespace}.{operator_name}",
                  overload=schema.overload_name or "default", arguments=tuple(plain(a) for a in schema.arguments),
                  returns=tuple(plain(r) for r in schema.returns), is_mutable=schema.is_mutable,
                  tags=frozenset(op.tags))


_VETTED_OUT_KERNELS = frozenset({
    "aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._softmax", "aten._log_softmax",
    "aten._softmax_backward_data", "aten._log_softmax_backward_data", "aten.cat", "aten.cumsum",
})


def _writes_out_directly(functional: OpInfo, out: OpInfo) -> bool:
    """Whether `out`'s kernel writes the final result into `out` and nothing else.

    Generated overloads (a CompositeExplicitAutograd kernel: run the functional op, copy into out) would
    add a copy kernel. Some hand-written ones use `out` as scratch first (`mse_loss.out` resizes it to
    the unreduced shape, which inside an arena writes past the buffer). Structured pointwise and
    reduction kernels, GEMMs, softmax and cat set the output shape once and write it: only those are used.
    """
    if has_kernel_for(out.op, "CompositeExplicitAutograd"):
        return False
    return (torch.Tag.pointwise in functional.tags or getattr(torch.Tag, "reduction", None) in functional.tags
            or functional.packet in _VETTED_OUT_KERNELS)


def out_variant(target: object) -> OutVariant | None:
    """The `out=` overload of a functional aten op, or None when it has none (or is no op)."""
    info = op_info(target)
    return info.out_variant if info is not None else None


def inplace_variant(target: object) -> OpOverload | None:
    """The overload that computes `target` into the arguments it mutates (`OpInfo.inplace_variant`)."""
    info = op_info(target)
    return info.inplace_variant if info is not None else None


def bind_arguments(op: OpOverload, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Map a call's positional and keyword arguments to the schema's argument names."""
    bound = dict(kwargs)
    for argument, value in zip(op_info(op).arguments, args):
        bound[argument.name] = value
    return bound


def replace_arguments(op: OpOverload, args: Sequence[Any], kwargs: dict[str, Any],
                      values: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """A call's (args, kwargs) with the named arguments set to `values`, each where the call passes it:
    positionally if its position is among `args`, else by keyword."""
    names = [argument.name for argument in op_info(op).arguments]
    args, kwargs = list(args), dict(kwargs)
    for name, value in values.items():
        position = names.index(name)
        if position < len(args):
            args[position] = value
        else:
            kwargs[name] = value
    return tuple(args), kwargs


def is_view(target: object) -> bool:
    """Whether a node's target is a view op (`OpInfo.is_view`)."""
    info = op_info(target)
    return info is not None and info.is_view


def is_reshape(target: object) -> bool:
    """Whether a node's target is a view that only reshapes (`OpInfo.is_reshape`)."""
    info = op_info(target)
    return info is not None and info.is_reshape


def written_arguments(op: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
    """The values a call passes for the arguments the op writes (`self` of `add_`, `out` of an out=
    overload, the running statistics of batch norm): from the schema's alias annotations."""
    info = op_info(op)
    if info is None or not is_mutating(op):
        return []
    bound = bind_arguments(op, args, kwargs)
    return [bound[a.name] for a in info.arguments if a.written and a.name in bound]


def is_random(target: object) -> bool:
    """Whether an op draws random numbers (its result must not be computed once and reused)."""
    info = op_info(target)
    return info is not None and torch.Tag.nondeterministic_seeded in info.tags


def is_mutating(target: object) -> bool:
    """Whether an op writes one of its arguments."""
    info = op_info(target)
    return info is not None and info.is_mutable


def is_pure(target: object) -> bool:
    """Whether an op's result is fixed by its inputs alone: not random, not writing anything, not talking
    to other ranks. Such an op reading only constants is setup work (`analyses.setup_nodes`)."""
    return not (is_random(target) or is_mutating(target) or is_collective(target))


def is_collective_wait(target: object) -> bool:
    """Whether a node's target is a collective's `wait_tensor` (`OpInfo.is_collective_wait`)."""
    info = op_info(target)
    return info is not None and info.is_collective_wait


def is_collective(target: object) -> bool:
    """Whether an op communicates with other ranks (a functional collective or its wait)."""
    info = op_info(target)
    return info is not None and info.is_collective


def launches_collective(target: object) -> bool:
    """Whether an op starts a collective (a collective other than its wait)."""
    return is_collective(target) and not is_collective_wait(target)
