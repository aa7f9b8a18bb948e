"""The signature of a traced function: what a Program and the Plans lowered from it both expose.

A caller sees the same function through either: its name, the pytree of arguments it takes (which
leaves are tensors, which are static values baked in), the pytree it returns, the tensors it closes
over, and the device it runs on. Tracing makes one `Signature`; transforms keep it, lowering hands it
to the Plan unchanged, and both read it through `HasSignature`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import optree
import torch


@dataclass(frozen=True)
class InputSpec:
    """One leaf of the (args, kwargs) pytree: a tensor input (a placeholder) or a static value."""

    path: str
    node_name: str | None
    static_value: Any = None

    @property
    def is_tensor(self) -> bool:
        return self.node_name is not None


@dataclass(frozen=True)
class OutputSpec:
    """One leaf of the returned pytree: the index of a tensor in the output node, or a static value."""

    path: str
    tensor_index: int | None
    static_value: Any = None


@dataclass(frozen=True, eq=False)
class ClosedOver:
    """A tensor the traced function closes over, lifted to an input that every call reads as it is then
    (`tracing.closure`): `name` is where it was found (`params['fc.weight']`)."""

    name: str
    tensor: torch.Tensor


@dataclass(frozen=True)
class Signature:
    """What a traced function takes and returns (see the module docstring).

    The flat tensor inputs are the tensor leaves of `inputs`, in order, then the `closed_over`
    tensors; the flat outputs are what `unflatten_outputs` puts back into the returned pytree."""

    name: str
    inputs: tuple[InputSpec, ...]
    in_tree: optree.PyTreeSpec
    outputs: tuple[OutputSpec, ...]
    out_tree: optree.PyTreeSpec
    device: torch.device
    closed_over: tuple[ClosedOver, ...] = field(default=(), compare=False)

    def unflatten_outputs(self, tensors: Sequence[Any]) -> Any:
        """The returned pytree from the flat output tensors, with the static outputs in their places."""
        leaves = [tensors[o.tensor_index] if o.tensor_index is not None else o.static_value for o in self.outputs]
        return optree.tree_unflatten(self.out_tree, leaves)

    def output_builder(self) -> Callable[[Sequence[Any]], Any]:
        """`unflatten_outputs` as one C call (the output pytree's own `unflatten`) when every returned
        leaf is the next flat tensor, as it is unless the function returns static values or one tensor
        twice: the per-call path of a jitted function ends here."""
        if all(o.tensor_index == k for k, o in enumerate(self.outputs)):
            return self.out_tree.unflatten
        return self.unflatten_outputs


def device_of(tensors: Iterable[Any]) -> torch.device:
    """Where a function of these tensors (or TensorSpecs) runs: the device of the first one that is not
    a 0-dim CPU tensor (PyTorch lets those mix with tensors on any device), else the CPU."""
    tensors = list(tensors)
    return next((t.device for t in tensors if t.device.type != "cpu" or len(t.shape)), torch.device("cpu"))


class HasSignature:
    """The interface Program and Plan share, read from the `signature` each holds."""

    signature: Signature

    @property
    def name(self) -> str:
        return self.signature.name

    @property
    def inputs(self) -> tuple[InputSpec, ...]:
        return self.signature.inputs

    @property
    def in_tree(self) -> optree.PyTreeSpec:
        return self.signature.in_tree

    @property
    def outputs(self) -> tuple[OutputSpec, ...]:
        return self.signature.outputs

    @property
    def out_tree(self) -> optree.PyTreeSpec:
        return self.signature.out_tree

    @property
    def device(self) -> torch.device:
        """Where the function runs (`device_of` its tensor inputs)."""
        return self.signature.device

    @property
    def closed_over(self) -> tuple[ClosedOver, ...]:
        """The tensors the function closes over: its last flat tensor inputs."""
        return self.signature.closed_over

    def unflatten_outputs(self, tensors: Sequence[Any]) -> Any:
        return self.signature.unflatten_outputs(tensors)
