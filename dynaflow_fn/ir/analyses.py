"""Analyses of a Program's graph that several stages share."""

from __future__ import annotations

from torch import fx

from . import ops
from .program import Program


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
