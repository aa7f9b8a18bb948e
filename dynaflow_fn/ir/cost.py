"""A roofline cost model: FLOPs and bytes per node from shapes alone, and the resource each node uses.

A node is "compute" when its arithmetic intensity (FLOPs per byte moved) is above the device's ridge
point (peak FLOP/s over memory bandwidth), "memory" below it, "comm" for collectives and "view" for
ops that move no data. Schedulers pair stages of different kinds, since a GEMM and a decode attention
use different units of the GPU. The numbers are estimates for ordering decisions, not predictions.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
from torch import fx

from ..compat import StorageWeakRef
from . import ops
from .kinds import StrKind
from .tree import tensors_in


class CostKind(StrKind):
    """What the cost model says a node is: the resource it spends its time on."""

    COMPUTE = "compute"    # arithmetic-bound: intensity above the device's ridge point (GEMMs)
    MEMORY = "memory"      # bandwidth-bound: below it (norms, activations, elementwise ops)
    COMM = "comm"          # a collective
    VIEW = "view"          # moves no data


@dataclass(frozen=True)
class Roofline:
    """Peak rates of a device. The defaults were measured on an H200 (dense bf16 GEMM, device copy)."""

    matmul_flops: dict[torch.dtype, float]
    vector_flops: float = 60e12
    bandwidth: float = 4.3e12
    launch_seconds: float = 2e-6

    def matmul_rate(self, dtype: torch.dtype) -> float:
        return self.matmul_flops.get(dtype, self.vector_flops)


H200 = Roofline(matmul_flops={torch.bfloat16: 790e12, torch.float16: 790e12, torch.float32: 60e12,
                              torch.float8_e4m3fn: 1580e12})


@dataclass(frozen=True)
class Cost:
    flops: float
    bytes: float
    seconds: float
    kind: CostKind

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", CostKind(self.kind))

    def __add__(self, other: "Cost") -> "Cost":
        """The cost of both: the kind of the longer one, or `comm` if either is a collective."""
        kind = self.kind if self.seconds >= other.seconds else other.kind
        if CostKind.COMM in (self.kind, other.kind):
            kind = CostKind.COMM
        return Cost(self.flops + other.flops, self.bytes + other.bytes, self.seconds + other.seconds, kind)


ZERO = Cost(0.0, 0.0, 0.0, CostKind.VIEW)

_MATMULS = frozenset({"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm"})
_MATMULS_WITH_BIAS = frozenset({"aten.addmm", "aten.baddbmm"})     # the bias comes first, then the factors
_ATTENTION_PREFIX = "aten._scaled_dot_product"
_CONVOLUTION = "aten.convolution"


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _matmul_flops(node: fx.Node, packet: str) -> float:
    out = node.meta["val"]
    inputs = [a.meta["val"] for a in node.args if isinstance(a, fx.Node)]
    left = inputs[-2] if packet in _MATMULS_WITH_BIAS else inputs[0]
    return 2.0 * out.numel() * left.shape[-1]


def _attention_flops(node: fx.Node) -> float:
    query, key = (a.meta["val"] for a in node.args[:2])
    *batch, length_q, head_dim = query.shape
    return 4.0 * math.prod(batch) * length_q * key.shape[-2] * head_dim


def _conv_flops(node: fx.Node) -> float:
    out = node.meta["val"]
    weight = node.args[1].meta["val"]
    return 2.0 * out.numel() * math.prod(weight.shape[1:])


def node_cost(node: fx.Node, roofline: Roofline = H200) -> Cost:
    """FLOPs, bytes, estimated seconds and kind of one call_function node."""
    if node.op != "call_function" or node.target is operator.getitem or ops.is_view(node.target):
        return ZERO
    outputs = tensors_in(node.meta.get("val"))
    inputs = [t for a in node.all_input_nodes for t in tensors_in(a.meta.get("val"))]
    input_storages = {StorageWeakRef(t.untyped_storage()) for t in inputs}
    if outputs and all(StorageWeakRef(t.untyped_storage()) in input_storages for t in outputs):
        return ZERO
    moved = float(sum(_nbytes(t) for t in inputs) + sum(_nbytes(t) for t in outputs))
    if ops.is_collective(node.target):
        return Cost(0.0, moved, moved / roofline.bandwidth + roofline.launch_seconds, CostKind.COMM)
    info = ops.op_info(node.target)
    packet = info.packet if info is not None else ""
    dtype = outputs[0].dtype if outputs else torch.float32
    if packet in _MATMULS:
        flops, rate = _matmul_flops(node, packet), roofline.matmul_rate(dtype)
    elif packet.startswith(_ATTENTION_PREFIX):
        flops, rate = _attention_flops(node), roofline.matmul_rate(dtype)
    elif packet == _CONVOLUTION:
        flops, rate = _conv_flops(node), roofline.matmul_rate(dtype)
    else:
        flops, rate = float(sum(t.numel() for t in outputs)), roofline.vector_flops
    seconds = max(flops / rate, moved / roofline.bandwidth) + roofline.launch_seconds
    kind = CostKind.COMPUTE if flops / max(moved, 1.0) >= rate / roofline.bandwidth else CostKind.MEMORY
    return Cost(flops, moved, seconds, kind)
