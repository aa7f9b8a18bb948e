"""Attention masks that are provably causal become `is_causal=True`.

Libraries that build their own masks (transformers' `create_causal_mask`) cannot drop the mask while
traced: deciding that it is purely causal needs the values of the position ids, which a trace on fake
tensors does not have. So the traced attention reads a [batch, 1, L, L] mask and runs a kernel that
adds it as a bias, where eager PyTorch runs the causal kernel, which reads no mask and skips the
blocked half of the scores.

A mask computed from constants alone (arange, comparisons, where; no input) is itself a constant of
the Program. This pass computes each such mask once, and where it is exactly the causal pattern
(allowed on and below the diagonal, blocked above), the attention ops that read it, forward and
backward alike, drop it and pass `is_causal=True`. Boolean masks block with False; additive ones
with -inf or any bias at or below -65504, the lowest float16, which is what transformers writes
(in bfloat16 too). Such a bias adds exactly nothing to a softmax in float32 (exp underflows to 0)
unless a blocked score exceeds its row's largest allowed score by more than 65000, so the causal
kernel computes what the masked one meant, and what eager transformers runs without a trace. A mask
that depends on an input (padding), that is not square, or whose values cannot be read (a program on
the meta device, or one that fails to compute ahead of time) is left as it is.
"""

from __future__ import annotations

import itertools
import operator
from typing import Any

import torch
from torch import fx

from ..errors import KERNEL_ERRORS
from ..ir import ops
from ..ir.analyses import eliminate_dead_code, setup_nodes
from ..ir.program import Program, copy_graph_module
from ..transforms.base import Pass, record

MASK_ARGUMENTS = ("attn_mask", "attn_bias")
BLOCKED = torch.finfo(torch.float16).min       # an additive bias this low blocks a position


class CausalKernelPass(Pass):
    """Program -> Program: every attention whose mask is provably causal runs as `is_causal=True`."""

    def __init__(self) -> None:
        self.switched = 0

    def describe(self) -> str:
        return f"causal masks({self.switched} attention{'' if self.switched == 1 else 's'} made causal)"

    def apply(self, program: Program) -> Program:
        constant = setup_nodes(program)
        readers = [n for n in program.ops() if _mask_argument(n.target) and not _arguments(n).get("is_causal")]
        masks = {_arguments(n).get(_mask_argument(n.target)) for n in readers} & constant
        causal = {mask for mask in masks if _is_causal(_value_or_none(mask, program.graph_module))}
        switched = [node for node in readers if _arguments(node).get(_mask_argument(node.target)) in causal]
        self.switched = len(switched)
        if not switched:
            return record(program, program, self)
        graph_module, node_map = copy_graph_module(program.graph_module)
        for node in switched:
            new = node_map[node]
            new.args, new.kwargs = ops.replace_arguments(new.target, new.args, new.kwargs,
                                                         {_mask_argument(node.target): None, "is_causal": True})
        eliminate_dead_code(graph_module.graph)
        graph_module.recompile()
        return record(program, program.with_graph(graph_module), self)


def _mask_argument(op: Any) -> str | None:
    """The name of an attention op's mask argument, if it also takes `is_causal`."""
    info = ops.op_info(op)
    if info is None or "scaled_dot_product" not in info.packet:
        return None
    names = {argument.name for argument in info.arguments}
    return next((name for name in MASK_ARGUMENTS if name in names), None) if "is_causal" in names else None


def _arguments(node: fx.Node) -> dict[str, Any]:
    """The arguments the node passes, by schema name (one left to its default is absent)."""
    return ops.bind_arguments(node.target, node.args, node.kwargs)


def _value_or_none(node: fx.Node, graph_module: fx.GraphModule) -> Any:
    """The mask's value, or None where computing it ahead of time fails: the pass only ever speeds a
    program up, so a mask it cannot compute stays as traced and is computed at setup as before."""
    try:
        return _evaluate(node, graph_module, {})
    except KERNEL_ERRORS:                  # the mask's ops cannot run ahead of time: not provably causal
        return None


def _evaluate(node: fx.Node, graph_module: fx.GraphModule, values: dict[fx.Node, Any]) -> Any:
    """The value of a node that reads only constants, computed now on its device."""
    if node not in values:
        if node.op == "get_attr":
            values[node] = operator.attrgetter(node.target)(graph_module)
        else:
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: _evaluate(n, graph_module, values))
            values[node] = node.target(*args, **kwargs)
    return values[node]


def _is_causal(mask: Any) -> bool:
    """Whether a [..., L, L] mask allows exactly the positions on and below the diagonal, and blocks
    the others, in every batch and head (checked one [L, L] slice at a time, to keep temporaries small)."""
    if not isinstance(mask, torch.Tensor) or mask.dim() < 2 or mask.device.type == "meta":
        return False
    rows, columns = mask.shape[-2:]
    if rows != columns or not (mask.dtype == torch.bool or mask.is_floating_point()):
        return False
    below = torch.ones(rows, columns, dtype=torch.bool, device=mask.device).tril()
    leading = [range(size if stride else 1) for size, stride in zip(mask.shape[:-2], mask.stride()[:-2])]
    for index in itertools.product(*leading):                  # a broadcast dimension is checked once
        square = mask[index]
        if mask.dtype == torch.bool:
            if not torch.equal(square, below):
                return False
        elif not (torch.equal(square == 0, below) and torch.equal(square <= BLOCKED, ~below)):
            return False
    return True
