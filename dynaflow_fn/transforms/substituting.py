"""`T.substitute`: run your own implementation where a rule matches, without editing the model.

    fast_norm = T.substitute(fn, {T.Module(LlamaRMSNorm): fused_rms_norm})     # impl(module, x)
    fast_attn = T.substitute(fn, {T.Region("attn"): flash_decode})            # impl(*region inputs)

A `T.Module` rule is a lookaside, as in Lightning Thunder: while tracing, each call of a matching
module runs `impl(module, *args, **kwargs)` instead of its `forward`, so `impl` may read the
module's parameters. A `T.Region` rule replaces the nodes traced inside a `with df.region(name)`
block: `impl` is called with the tensors the block reads from outside, in the order the block first
reads them, and returns what the block produced that later code reads, in the order the block
computed them (one tensor, or a tuple). The Program's provenance line names both lists. In both cases the outputs' shapes, dtypes and strides
must be the original's, checked while tracing; `check=True` also runs each region and its `impl`
on random inputs of the traced shapes, and the region once more in float64 as the exact answer:
`impl` may err against it by a few times what the region itself errs plus a fraction (rtol) of the
output's largest magnitude, so any correct order of summation passes however long the reduction.

`impl` may be any traceable PyTorch code: aten ops, `torch.nn.functional`, a
`torch.library.custom_op` with a fake implementation (a Triton kernel wrapped as one). Substituted
nodes print with the rule that placed them, keep the scopes of what they replaced (so partition
rules and schedulers see them like any other node) and compose with `microbatch` and `overlap`.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Iterator, Mapping

import optree
import torch

from ..compat import current_trace_graph
from ..errors import InputError, TransformError
from ..ir import ops
from ..ir.program import NodeInfo, Program, copy_graph_module, info
from ..ir.scopes import Scope, ScopeKind
from ..tracing.regions import active_recorder, last_node, nodes_after
from .base import Pass, apply_transform, record, retraced
from .partition_rules import Module, Region, Rule
from .splicing import DEFAULT_TOLERANCES, RegionMatch, call_mismatch, check_agrees, check_layout, splice, trace_impl


def substitute(fn: Any = None, rules: Mapping[Rule, Callable[..., Any]] | None = None, *, check: bool = False,
               tolerances: Mapping[torch.dtype, tuple[float, float]] | None = None) -> Any:
    """Replace what each rule matches by an implementation of your own, without editing the model.

    A `T.Module` rule is a lookaside: while tracing, each call of a matching module runs
    `impl(module, *args, **kwargs)` instead of its `forward`, so `impl` may read the module's
    parameters. A `T.Region` rule replaces the nodes traced inside a `with df.region(name)` block by
    `impl` called with the tensors the block reads from outside, in the order it first reads them;
    `impl` returns what later code reads of the block, in the order the block computed it (one
    tensor, or a tuple). Outputs must have the original's shapes, dtypes and strides (checked while
    tracing). More in `dynaflow_fn.transforms.substituting`.

    fn: the function or Program to transform. Left out (`T.substitute(rules)`), the result is a
        transform to apply later.
    rules: `{T.Module(cls_or_regex): impl(module, *args, **kwargs), T.Region(name): impl(*inputs)}`.
        Every rule must match at least once.
    check: run each matched region and its impl on random inputs, and the region in float64 as the
        exact answer; each floating output of impl may err against it by 4 times the region's own
        error plus rtol times the output's largest magnitude (elementwise within rtol and atol of the
        region's output where the region cannot run in float64), integer and bool outputs must be
        equal. Otherwise a TransformError shows the largest difference, where, and what was allowed.
        Module rules are checked for output layouts only: their original runs inside the module, on
        the trace's values.
    tolerances: `{dtype: (rtol, atol)}` for `check`; the defaults and the criterion are
        `dynaflow_fn.transforms.splicing.DEFAULT_TOLERANCES`.
    """
    if rules is None and isinstance(fn, Mapping):
        fn, rules = None, fn
    if not isinstance(rules, Mapping) or not rules:
        raise InputError("T.substitute takes a dict of rules to implementations, e.g. "
                         "T.substitute(fn, {T.Region('attn'): my_attention})")
    for rule, impl in rules.items():
        if not isinstance(rule, (Module, Region)):
            raise InputError(f"T.substitute takes T.Module and T.Region rules, got {rule!r}")
        if not callable(impl):
            raise InputError(f"the implementation for {rule} must be callable, got {type(impl).__name__}")
    module_rules = {rule: impl for rule, impl in rules.items() if isinstance(rule, Module)}
    region_rules = {rule: impl for rule, impl in rules.items() if isinstance(rule, Region)}
    limits = {**DEFAULT_TOLERANCES, **(tolerances or {})}
    passes = ([ModuleLookaside(module_rules)] if module_rules else []) + \
             ([RegionSubstitution(region_rules, check, limits)] if region_rules else [])

    def transform(target: Any) -> Any:
        for p in passes:
            target = apply_transform(target, p)
        return target
    return transform if fn is None else transform(fn)


class RegionSubstitution(Pass):
    """Splice each matched region's replacement into the Program (see `splicing`)."""

    changes_values = True

    def __init__(self, rules: Mapping[Region, Callable[..., Any]], check: bool,
                 tolerances: Mapping[torch.dtype, tuple[float, float]]):
        self.rules, self.check, self.tolerances = dict(rules), check, dict(tolerances)

    def apply(self, program: Program) -> Program:
        if program.is_scheduled():
            raise TransformError("substitute after overlap: the schedule was made for the original nodes. "
                                 "Apply substitute before overlap.")
        graph_module, _ = copy_graph_module(program.graph_module)
        for rule, impl in self.rules.items():
            matches: dict[Any, list] = {}
            for node in graph_module.graph.nodes:
                key = rule.match(node, info(node)) if node.op == "call_function" else None
                if key is not None:
                    matches.setdefault(key, []).append(node)
            if not matches:
                raise TransformError(f"{rule} matched nothing: {rule.unmatched_hint(program)}")
            for nodes in matches.values():
                _refuse_differentiated(graph_module.graph, nodes, rule)
                match = RegionMatch(nodes)
                replacement = trace_impl(impl, match, str(rule))
                if self.check:
                    check_agrees(graph_module, match, impl, str(rule), self.tolerances)
                splice(graph_module, match, replacement, Scope(ScopeKind.SUBSTITUTION, str(rule), 0))
        try:
            graph_module.graph.lint()
        except RuntimeError as error:
            raise TransformError(f"substitute: the program is not well formed after splicing in the implementations "
                                 f"({error}); a region whose nodes interleave with code outside it cannot be "
                                 f"replaced") from error
        graph_module.recompile()
        return record(program, program.with_graph(graph_module), self)

    def describe(self) -> str:
        return f"substitute({_rules_text(self.rules)}{', check=True' if self.check else ''})"


def _refuse_differentiated(graph: torch.fx.Graph, nodes: list, rule: Region) -> None:
    """Refuse to replace forward nodes of a function that differentiates through them: the gradient
    (`df.value_and_grad`'s, traced in a BACKWARD scope) was traced through the original ops, so beside
    `impl`'s values it would give the original's derivative, not `impl`'s."""
    def backward(node: torch.fx.Node) -> bool:
        return any(scope.kind is ScopeKind.BACKWARD for scope in info(node).scopes)

    inside = set(nodes)
    if all(backward(node) for node in nodes) or not any(backward(n) for n in graph.nodes if n not in inside):
        return
    raise TransformError(f"{rule} is differentiated: the function computes gradients through it (df.value_and_grad "
                         f"or df.grad), traced through the region's own ops, so with the region replaced they would "
                         f"not be the gradients of the implementation. Substitute first, then differentiate: "
                         f"df.value_and_grad(T.substitute(f, rules)), or replace a region that holds the gradient "
                         f"computation too")


class ModuleLookaside(Pass):
    """While tracing, calls of matching modules run `impl(module, *args, **kwargs)` instead."""

    def __init__(self, rules: Mapping[Module, Callable[..., Any]]):
        self.rules = dict(rules)

    def wrap_body(self, body: Callable[..., Any]) -> Callable[..., Any]:
        def looked_aside(*args: Any, **kwargs: Any) -> Any:
            calls = {rule: 0 for rule in self.rules}
            with _redirected(_modules_reached(body), self.rules, calls):
                result = body(*args, **kwargs)
            unmatched = [str(rule) for rule, count in calls.items() if not count]
            if unmatched:
                raise TransformError(f"{', '.join(unmatched)} matched no module call while tracing; a T.Module "
                                     f"rule matches a module class (or a regex on qualified or class names) "
                                     f"of the modules the function reaches")
            return result
        return functools.update_wrapper(looked_aside, body, updated=())

    def apply(self, program: Program) -> Program:
        """On a Program: trace its source again with the lookasides, then redo the passes it had."""
        return record(program, retraced(program, self, "substitute"), self)

    def describe(self) -> str:
        return f"substitute({_rules_text(self.rules)})"


def _modules_reached(body: Callable[..., Any]) -> list[tuple[str, torch.nn.Module]]:
    """(qualified name, module) for the modules `body` can reach, with their submodules: the module of
    a `df.pure` function, and modules that it or the functions it calls close over or name as globals
    (followed a few calls deep)."""
    roots: dict[int, tuple[str, torch.nn.Module]] = {}
    _collect_roots("", body, roots, depth=_SEARCH_DEPTH)
    seen, reached = set(), []
    for prefix, root in roots.values():
        for name, module in root.named_modules():
            if id(module) not in seen:
                seen.add(id(module))
                reached.append((".".join(p for p in (prefix, name) if p), module))
    return reached


_SEARCH_DEPTH = 4


def _collect_roots(name: str, value: Any, roots: dict[int, tuple[str, torch.nn.Module]], depth: int) -> None:
    if isinstance(value, torch.nn.Module):
        roots.setdefault(id(value), (name, value))
        return
    module = getattr(value, "__dynaflow_module__", None)
    if isinstance(module, torch.nn.Module):
        roots.setdefault(id(module), ("", module))
    function = getattr(value, "__wrapped__", value)
    code = getattr(function, "__code__", None)
    if code is None or depth == 0:
        return
    for free, cell in zip(code.co_freevars, getattr(function, "__closure__", None) or ()):
        with contextlib.suppress(ValueError):
            _collect_roots(free, cell.cell_contents, roots, depth - 1)
    namespace = getattr(function, "__globals__", {})
    for global_name in code.co_names:
        if global_name in namespace:
            _collect_roots(global_name, namespace[global_name], roots, depth - 1)


@contextlib.contextmanager
def _redirected(modules: list[tuple[str, torch.nn.Module]], rules: Mapping[Module, Callable[..., Any]],
                calls: dict[Module, int]) -> Iterator[None]:
    """Give each matching module an instance `forward` that runs the rule's impl on this thread. A
    module inside one its rule already matched is left as it is: `T.Module("mlp")` substitutes each
    `layers.N.mlp`, not also its `mlp.gate_proj` (the regex is searched in qualified names), whose
    calls the impl makes as the original does. `modules` come parents first."""
    patched, matched = [], {rule: [] for rule in rules}
    for name, module in modules:
        rule = next((r for r in rules if r.match(None, NodeInfo(scopes=(Scope(ScopeKind.MODULE, name, 0, type(module)),)))
                     is not None and not any(_inside(name, outer) for outer in matched[r])), None)
        if rule is not None:
            matched[rule].append(name)
            previous = module.__dict__.get("forward")
            module.forward = _lookaside(module, rule, rules[rule], previous or module.forward, calls)
            patched.append((module, previous))
    try:
        yield
    finally:
        for module, previous in reversed(patched):
            if previous is None:
                del module.forward
            else:
                module.forward = previous


def _inside(name: str, outer: str) -> bool:
    """Whether the module of qualified name `name` is a submodule of the one named `outer`."""
    return not outer or name.startswith(outer + ".")


def _lookaside(module: torch.nn.Module, rule: Module, impl: Callable[..., Any], original: Callable[..., Any],
               calls: dict[Module, int]) -> Callable[..., Any]:
    owner = threading.get_ident()
    running = []                                   # impl may call the module itself: that runs forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != owner or running:
            return original(*args, **kwargs)
        running.append(True)
        try:
            return substituted(*args, **kwargs)
        finally:
            running.pop()

    def substituted(*args: Any, **kwargs: Any) -> Any:
        calls[rule] += 1
        mismatch = call_mismatch(impl, (module, *args), kwargs)
        if mismatch is not None:
            raise TransformError(f"the implementation for {rule} is called as impl(module, *args, **kwargs) with "
                                 f"the {type(module).__name__} and the {len(args)} positional and {len(kwargs)} "
                                 f"keyword arguments of its call, and cannot take them ({mismatch})")
        recorder = active_recorder()
        if recorder is None:                       # the transformed function called eagerly
            return impl(module, *args, **kwargs)
        expected = _traced_and_dropped(original, args, kwargs)
        graph = current_trace_graph()
        start = last_node(graph)
        with recorder.scope(ScopeKind.SUBSTITUTION, str(rule)):
            result = impl(module, *args, **kwargs)
        written = [node for node in nodes_after(graph, start) if ops.is_mutating(node.target)]
        if written:
            raise TransformError(f"the implementation for {rule} writes {written[0].args[0]} in place; it must "
                                 f"return new tensors and leave its inputs unchanged")
        _check_layouts(rule, expected, result)
        return result
    return forward


def _traced_and_dropped(original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """What the original forward returns, traced for its layout only: its nodes leave the graph."""
    graph = current_trace_graph()
    start = last_node(graph)
    expected = original(*args, **kwargs)
    for node in reversed(nodes_after(graph, start)):
        graph.erase_node(node)
    return expected


def _check_layouts(rule: Module, expected: Any, result: Any) -> None:
    want, want_tree = optree.tree_flatten(expected)
    got, got_tree = optree.tree_flatten(result)
    if want_tree != got_tree:
        raise TransformError(f"the implementation for {rule} returns {got_tree}, where the module returns {want_tree}")
    for index, (a, b) in enumerate(zip(want, got)):
        if isinstance(a, torch.Tensor):
            check_layout(str(rule), index, a, b, "the module returns")


def _rules_text(rules: Mapping[Rule, Callable[..., Any]]) -> str:
    """`T.Region('attn') -> flash_decode, ...`: each rule and the implementation it puts in place."""
    return ", ".join(f"{rule} -> {getattr(impl, '__qualname__', type(impl).__name__)}" for rule, impl in rules.items())
