"""Analyses of a Program's graph that several stages share."""

from __future__ import annotations

import torch
from torch import fx

from ..compat import StorageWeakRef
from . import ops
from .program import Program


def fake_storage(node: fx.Node) -> StorageWeakRef | None:
    """The memory a node's value lives in, by its fake tensor's storage: views of one value share it."""
    value = node.meta.get("val")
    return StorageWeakRef(value.untyped_storage()) if isinstance(value, torch.Tensor) else None


def setup_nodes(program: Program) -> set[fx.Node]:
    """The nodes lowering computes once, at setup: the program's constants and the deterministic work
    that reads only them (masks, position ids, rotary tables)."""
    independent = {n for n in program.graph.nodes if n.op == "get_attr"}
    for node in program.ops():
        if ops.is_pure(node.target) and all(dep in independent for dep in node.all_input_nodes):
            independent.add(node)
    return independent


def eliminate_dead_code(graph: fx.Graph) -> None:
    """Drop nodes nobody uses, keeping mutations (the `copy_` write-backs into inputs)."""
    for node in reversed(list(graph.nodes)):
        if node.op in ("call_function", "get_attr") and not node.users and not ops.is_mutating(node.target):
            graph.erase_node(node)


def is_write_back(node: fx.Node) -> bool:
    """Whether `node` is the `copy_` that tracing leaves for a mutated input: the input's new value
    written into it (always into the whole input: functionalization writes back whole tensors)."""
    return (node.op == "call_function" and node.target is torch.ops.aten.copy_.default
            and isinstance(node.args[0], fx.Node) and node.args[0].op == "placeholder")


def written_back_updates(program: Program) -> dict[fx.Node, fx.Node]:
    """The functional updates of mutated inputs: each op whose result, through a chain of such ops, is
    what a write-back copies into the input the chain starts from (`keys[slots] = k` is traced as
    `new = index_put(keys, ...)`, then `copy_(keys, new)`), mapped to that input.

    Run as its inplace variant (`index_put_`), such a chain updates the input where it lives, and its
    write-back copies nothing: without that, every call copies the whole input (a KV cache) twice, once
    into the functional result and once back. Only ops with an inplace variant that writes their first
    argument form chains."""
    updates: dict[fx.Node, fx.Node] = {}
    for write_back in program.graph.find_nodes(op="call_function", target=torch.ops.aten.copy_.default):
        if not is_write_back(write_back):
            continue
        target, chain, value = write_back.args[0], [], write_back.args[1]
        while (isinstance(value, fx.Node) and value.op == "call_function" and value.args
               and ops.inplace_variant(value.target) is not None and isinstance(value.args[0], fx.Node)):
            chain.append(value)
            if value.args[0] is target:
                updates.update(dict.fromkeys(chain, target))
                break
            value = value.args[0]
    return updates
