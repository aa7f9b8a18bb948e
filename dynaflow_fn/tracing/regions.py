"""Scopes: which module call, `df.region` block or micro-batch each traced node came from.

While `make_fx` traces, nodes are appended to one FX graph in execution order. A scope that opens
and closes around some Python code therefore owns exactly the nodes appended in between. The
recorder remembers the graph's last node when a scope opens and, when it closes, tags every node
appended since. This needs no change to the model and works the same for `nn.Module` calls (through
global forward hooks), `df.region(...)` blocks and the micro-batch bodies that `T.microbatch` emits.

Outside a trace `df.region` does nothing, so tagged model code runs unchanged in eager PyTorch.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Iterator

import torch
from torch import fx
from torch.nn.modules import module as nn_module

from ..errors import InputError, TraceError
from ..ir.scopes import Scope, ScopeKind

def last_node(graph: fx.Graph) -> fx.Node | None:
    """The node appended last, or None for an empty graph."""
    return next(iter(reversed(graph.nodes)), None)


def nodes_after(graph: fx.Graph, start: fx.Node | None) -> list[fx.Node]:
    """The nodes appended after `start` (after nothing: all of them), in order. A graph's node list
    is circular through a sentinel node of op "root"."""
    if start is None:
        return list(graph.nodes)
    found, node = [], start.next
    while node.op != "root":
        found.append(node)
        node = node.next
    return found


class ScopeRecorder:
    """Tags the nodes of a graph under construction with the scopes that were open when they appeared."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.module_names: dict[int, str] = {}      # qualified names, from each module called at top level
        self.scopes_of: dict[fx.Node, list[Scope]] = {}
        self._open: list[tuple[Scope, fx.Node | None]] = []
        self._instances = itertools.count()
        self._modules: dict[int, torch.nn.Module] = {}

    def open(self, kind: ScopeKind, name: str, module_type: type | None = None, index: int | None = None) -> Scope:
        scope = Scope(kind, name, next(self._instances), module_type, index)
        self._open.append((scope, last_node(self.graph)))
        return scope

    def close(self, scope: Scope) -> None:
        opened, start = self._open.pop()
        if opened is not scope:
            raise TraceError(f"scope {scope} closed while {opened} is still open: df.region blocks and module calls "
                             f"must nest. Enter each df.region with a `with` statement, so it closes where it opens")
        for node in nodes_after(self.graph, start):
            self.scopes_of.setdefault(node, []).append(scope)

    @contextlib.contextmanager
    def scope(self, kind: ScopeKind, name: str, module_type: type | None = None,
              index: int | None = None) -> Iterator[Scope]:
        opened = self.open(kind, name, module_type, index)
        try:
            yield opened
        finally:
            self.close(opened)

    def finish(self) -> dict[fx.Node, tuple[Scope, ...]]:
        """Scopes per node, outermost first (scopes close inner to outer, so the lists are reversed)."""
        return {node: tuple(reversed(scopes)) for node, scopes in self.scopes_of.items()}

    def called_modules(self) -> tuple[torch.nn.Module, ...]:
        """Every module called while tracing, in order of first call."""
        return tuple(self._modules.values())

    @contextlib.contextmanager
    def module_hooks(self) -> Iterator[None]:
        """Open a module scope around every `nn.Module` call made while tracing.

        The hooks are global, so they also see module calls of other threads; those are not part
        of this trace and are ignored."""
        stack: list[Scope] = []

        def pre_hook(module: torch.nn.Module, args: object) -> None:
            if active_recorder() is not self:
                return
            self._modules.setdefault(id(module), module)
            if not stack and id(module) not in self.module_names:
                self.module_names.update(qualified_names(module))
            name = self.module_names.get(id(module), "")
            stack.append(self.open(ScopeKind.MODULE, name, type(module)))

        def post_hook(module: torch.nn.Module, args: object, output: object) -> None:
            if stack and active_recorder() is self:
                self.close(stack.pop())

        pre = nn_module.register_module_forward_pre_hook(pre_hook)
        post = nn_module.register_module_forward_hook(post_hook, always_call=True)
        try:
            yield
        finally:
            pre.remove()
            post.remove()


def qualified_names(root: torch.nn.Module) -> dict[int, str]:
    """The qualified name (`model.layers.0.self_attn`) of every module under `root`, by id; a module
    reachable by several names keeps the first."""
    return {id(m): n for n, m in reversed(list(root.named_modules(remove_duplicate=False)))}


class _TraceState(threading.local):
    """Per thread, the recorder of the trace running there. The class-level default means the
    attribute always exists: torch.compile guards on what `df.region` reads, and an attribute that
    appears with the first trace would recompile every graph compiled before it."""

    recorder: ScopeRecorder | None = None


_state = _TraceState()


def active_recorder() -> ScopeRecorder | None:
    """The recorder of the trace running on this thread, if any."""
    return _state.recorder


@contextlib.contextmanager
def recording(recorder: ScopeRecorder) -> Iterator[ScopeRecorder]:
    previous = active_recorder()
    _state.recorder = recorder
    try:
        with recorder.module_hooks():
            yield recorder
    finally:
        _state.recorder = previous


@contextlib.contextmanager
def region(name: str) -> Iterator[None]:
    """Tag the ops traced inside this block with a region name, for `T.Region(name)` partition rules.

    >>> with df.region("attn"):
    ...     h = attention(x)

    Outside a trace it does nothing, so the model still runs in eager PyTorch unchanged.
    """
    if not isinstance(name, str) or not name:
        raise InputError(f"df.region needs a non-empty string name, got {name!r}")
    recorder = active_recorder()
    if recorder is None:
        yield
        return
    with recorder.scope(ScopeKind.REGION, name):
        yield
