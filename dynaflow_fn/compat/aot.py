"""torch.compile's internals df.compile_backend needs: AOTAutograd and symbolic sizes.

df.compile_backend trains through AOTAutograd, the part of torch.compile that splits a Dynamo graph
into a forward and a backward aten graph, as torch's own backends do, and reads Dynamo's symbolic
sizes; none of it has a public home. Each entry falls back to something correct where the internal
is gone (tests/compat/test_compat.py runs both).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import fx

__all__ = ["aot_autograd_backend", "boxed", "first_unbacked_node", "recomputing_partitioner"]


def aot_autograd_backend(fw_compiler: Callable[..., Any], bw_compiler: Callable[..., Any]) -> Callable[..., Any] | None:
    """A torch.compile backend that hands each Dynamo graph's forward and backward aten graphs to these
    compilers (`torch._dynamo.backends.common.aot_autograd`, what torch's "cudagraphs" backend builds
    on); the forward compiler also serves graphs that need no backward pass. Tensors cheap to
    recompute (views of parameters above all) are recomputed in the backward graph instead of saved,
    by torch's min-cut partitioner, where it and the networkx it needs are installed (without it,
    AOTAutograd's default partition saves them: correct, with more to keep). None where torch lacks
    AOTAutograd."""
    try:
        from torch._dynamo.backends.common import aot_autograd
    except ImportError:
        return None
    options = dict(fw_compiler=fw_compiler, bw_compiler=bw_compiler, inference_compiler=fw_compiler)
    partition = recomputing_partitioner()
    if partition is not None:
        options["partition_fn"] = partition
    return aot_autograd(**options)


def recomputing_partitioner() -> Callable[..., Any] | None:
    """torch's min-cut partitioner of joint graphs (what Inductor uses), or None without it or networkx."""
    import importlib.util

    if importlib.util.find_spec("networkx") is None:
        return None
    try:
        from torch._functorch.partitioners import min_cut_rematerialization_partition
    except ImportError:
        return None
    return min_cut_rematerialization_partition


def boxed(fn: Callable[..., Any]) -> Callable[[list], Any]:
    """`fn` in AOTAutograd's boxed calling convention: called with one list of its arguments
    (`make_boxed_func`); the fallback sets the flag AOTAutograd reads."""
    try:
        from torch._functorch.aot_autograd import make_boxed_func
    except ImportError:
        def call(args: list) -> Any:
            return fn(*args)

        call._boxed_call = True
        return call
    return make_boxed_func(fn)


def first_unbacked_node(graph_module: fx.GraphModule) -> fx.Node | None:
    """The first node of a Dynamo or aten graph whose result has a size or value known only from tensor
    data (an "unbacked" symbol: `nonzero`, `.item()` captured into the graph), read from the fake value
    each node records (`example_value` in Dynamo's graphs, `val` in aten graphs). None if there is
    none, or where this torch lacks the query: df.jit's trace then names the op when it reaches it."""
    try:
        from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
    except ImportError:
        return None
    for node in graph_module.graph.nodes:
        value = node.meta.get("val", node.meta.get("example_value"))
        values = value if isinstance(value, (tuple, list)) else (value,)
        if any(isinstance(v, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)) and free_unbacked_symbols(v)
               for v in values):
            return node
    return None
