"""Every entry of dynaflow_fn.compat works on this torch, and so does its fallback where the internal is gone."""

import contextlib
from typing import Any, Callable, Iterator
import sys

import pytest
import torch
import torch.fx._symbolic_trace as symbolic_trace
from torch.fx.experimental.proxy_tensor import make_fx

from dynaflow_fn import compat
from dynaflow_fn.compat import calls as compat_calls
from dynaflow_fn.compat import tracing as compat_tracing
from dynaflow_fn.compat import modules as compat_modules
from dynaflow_fn.errors import BackwardError, InputError, MetaKernelRejection


def _fx_tracing_seen_inside_make_fx(cleared: bool) -> bool:
    seen = []

    def body(x):
        if cleared:
            with compat.fx_tracing_flag_cleared():
                seen.append(symbolic_trace.is_fx_tracing())
        else:
            seen.append(symbolic_trace.is_fx_tracing())
        return x + 1

    make_fx(body)(torch.randn(2))
    return seen[0]


def test_make_fx_flags_itself_as_fx_tracing_and_the_flag_can_be_cleared():
    assert _fx_tracing_seen_inside_make_fx(cleared=False)
    assert not _fx_tracing_seen_inside_make_fx(cleared=True)
    assert not symbolic_trace.is_fx_tracing()


def test_fx_tracing_flag_cleared_without_either_flag_is_a_no_op(monkeypatch):
    for name in ("_set_is_fx_tracing", "_get_is_fx_tracing", "_is_fx_tracing_flag"):
        monkeypatch.delattr(symbolic_trace, name, raising=False)
    with compat.fx_tracing_flag_cleared():
        pass


def test_op_overload_is_the_type_of_aten_overloads():
    assert isinstance(torch.ops.aten.mm.default, compat.OpOverload)
    assert not isinstance(torch.mm, compat.OpOverload)


class _OverloadWithoutSchema:
    """An op overload as a torch without `OpOverload._schema` would hand it over: its public name only."""

    def __init__(self, op):
        self.op = op

    def name(self):
        return self.op.name()


@pytest.mark.parametrize("op", [torch.ops.aten.add_.Tensor, torch.ops.aten.mm.default, torch.ops.aten.split.Tensor,
                                torch.ops._c10d_functional.all_reduce.default])
def test_op_schema_and_its_fallback_read_the_same_schema(op):
    schema = compat.op_schema(op)
    assert str(schema) == str(op._schema)
    assert str(compat.op_schema(_OverloadWithoutSchema(op))) == str(schema)


def test_has_kernel_for_tells_generated_out_kernels_apart(monkeypatch):
    assert compat.has_kernel_for(torch.ops.aten._adaptive_avg_pool2d.out, "CompositeExplicitAutograd")
    assert not compat.has_kernel_for(torch.ops.aten.mm.out, "CompositeExplicitAutograd")
    monkeypatch.delattr(torch._C, "_dispatch_has_kernel_for_dispatch_key")
    assert compat.has_kernel_for(torch.ops.aten.mm.out, "CompositeExplicitAutograd")   # conservative


def test_has_internal_overlap_and_its_fallback_agree(monkeypatch):
    cases = [torch.randn(3, 4), torch.randn(3, 1).expand(3, 4), torch.randn(4, 3).t(), torch.randn(8)[::2]]
    native = [compat.has_internal_overlap(t) for t in cases]
    assert native[:2] == [False, True]
    monkeypatch.delattr(torch, "_debug_has_internal_overlap")
    fallback = [compat.has_internal_overlap(t) for t in cases]
    assert all(f or not n for f, n in zip(fallback, native))    # never says "no overlap" wrongly
    assert fallback[:2] == [False, True]


def test_sm_carveout_restores_the_previous_settings(monkeypatch):
    before = torch.backends.cuda.preferred_blas_library()
    with compat.sm_carveout(8):
        if compat.sm_carveout_supported():
            assert torch._C._get_sm_carveout_experimental() == 8
            assert torch.backends.cuda.preferred_blas_library() == torch._C._BlasBackend.Cublaslt
    assert torch.backends.cuda.preferred_blas_library() == before
    monkeypatch.delattr(torch._C, "_set_sm_carveout_experimental")
    assert not compat.sm_carveout_supported()
    with compat.sm_carveout(8):
        assert torch.backends.cuda.preferred_blas_library() == before


def test_process_group_lookup_by_name_with_and_without_the_resolver(monkeypatch):
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        assert compat.resolve_process_group(group.group_name) is group
        assert compat.default_store() is not None
        monkeypatch.delattr(distributed_c10d, "_resolve_process_group")
        assert compat.resolve_process_group(group.group_name) is group
        with pytest.raises(InputError, match="no process group is named 'nowhere'.*new_group"):
            compat.resolve_process_group("nowhere")
    finally:
        dist.destroy_process_group()


def test_process_state_readers_and_their_fallbacks_agree(monkeypatch):
    fast = (compat.any_autocast_enabled(), compat.torch_function_modes())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compat.any_autocast_enabled()
    torch.set_default_device("cpu")
    try:
        assert compat.torch_function_modes() == 1
    finally:
        torch.set_default_device(None)
    matmul_settings = lambda: tuple(read() for read in compat.matmul_setting_readers)     # noqa: E731
    before, before_public = matmul_settings(), compat_calls._public_matmul_settings()
    torch.backends.cudnn.benchmark = not torch.backends.cudnn.benchmark
    try:
        assert matmul_settings() != before and compat_calls._public_matmul_settings() != before_public
    finally:
        torch.backends.cudnn.benchmark = not torch.backends.cudnn.benchmark
    assert matmul_settings() == before
    assert compat.any_autocast_enabled is torch._C._is_any_autocast_enabled   # torch's C function itself
    monkeypatch.delattr(torch._C, "_is_any_autocast_enabled")
    monkeypatch.delattr(torch._C, "_len_torch_function_stack")
    fallbacks = (compat_calls._torch_c("_is_any_autocast_enabled", compat_calls._any_autocast_enabled_in_python),
                 compat_calls._torch_c("_len_torch_function_stack", compat_calls._torch_function_modes_in_python))
    assert fallbacks == (compat_calls._any_autocast_enabled_in_python, compat_calls._torch_function_modes_in_python)
    assert tuple(read() for read in fallbacks) == fast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fallbacks[0]()
    monkeypatch.delattr(torch._C, "_get_cudnn_benchmark")
    assert compat_calls._resolve_matmul_setting_readers() == (compat_calls._public_matmul_settings,)


@pytest.mark.parametrize("count", [1, 2])
def test_a_no_backward_node_and_its_fallback_raise_the_message(monkeypatch, count):
    from dynaflow_fn.jitting.replayer import without_backward

    weight = torch.randn(3, requires_grad=True)
    for fallback in (False, True):
        if fallback:
            monkeypatch.setattr(compat, "no_backward_node", compat_calls._NoBackwardNode)
        xs = [torch.randn(3) for _ in range(count)]
        ys = without_backward(xs, b"no graph here")
        assert len(ys) == count
        for x, y in zip(xs, ys):
            assert y.requires_grad and y.data_ptr() == x.data_ptr() and torch.equal(y.detach(), x)
        with pytest.raises(RuntimeError, match="no graph here") as caught:
            (ys[-1] * weight).sum().backward()
        assert isinstance(caught.value, BackwardError) == fallback       # torch's own error, or ours (a RuntimeError)


def test_data_ptrs_equal_and_its_python_fallback_agree():
    a, b = torch.randn(2), torch.randn(2)
    for equal in (compat.data_ptrs_equal, compat_calls._data_ptrs_equal_in_python):
        assert equal([a, b], [None, b.data_ptr()], [1])
        assert not equal([a, b], [None, a.data_ptr()], [1])


def test_foreach_copy_and_its_python_fallback_copy_every_pair():
    assert compat.foreach_copy is getattr(torch, "_foreach_copy_", compat_calls._foreach_copy_in_python)
    for copy in (compat.foreach_copy, compat_calls._foreach_copy_in_python):
        sources = [torch.randn(3), torch.arange(4).reshape(2, 2), torch.randn(())]
        destinations = [torch.empty_like(source) for source in sources]
        copy(destinations, sources)
        assert all(torch.equal(d, s) for d, s in zip(destinations, sources))


def test_a_storage_alias_shares_memory_counts_its_holders_and_without_the_count_is_none(monkeypatch):
    tensor = torch.arange(8.0)
    alias = compat.storage_alias(tensor[2:])
    assert alias.tensor.data_ptr() == tensor.data_ptr() and alias.tensor.shape == (8,)
    assert alias.tensor.untyped_storage()._cdata != tensor.untyped_storage()._cdata
    alone = alias.tensors_holding(), sys.getrefcount(alias.storage)
    view = alias.tensor[3:5]
    assert alias.tensors_holding() > alone[0]
    storage = view.untyped_storage()
    del view
    assert storage is alias.storage and sys.getrefcount(alias.storage) > alone[1]
    del storage
    assert (alias.tensors_holding(), sys.getrefcount(alias.storage)) == alone
    monkeypatch.delattr(torch._C, "_storage_Use_Count")
    assert compat.storage_alias(tensor) is None


@contextlib.contextmanager
def _meta_kernel_replaced(op: torch._ops.OpOverload, kernel: Callable[..., Any]) -> Iterator[None]:
    """`kernel` as the meta kernel of `op` inside the block, the original one again after it.

    Leaving a scoped library removes its kernel from the dispatcher, but torch also keeps the last
    Python kernel registered for (op, Meta) in a table of its own, which calls on fake tensors still
    reach (torch 2.13). Registering the original again, for a moment, points that table back at it."""
    original = op.py_kernels.get(torch._C.DispatchKey.Meta)
    try:
        with torch.library._scoped_library("aten", "IMPL") as library:
            library.impl(op, kernel, "Meta", allow_override=True)   # torch 2.11 refuses to by default
            yield
    finally:
        if original is not None:
            with torch.library._scoped_library("aten", "IMPL") as library:
                library.impl(op, original, "Meta", allow_override=True)


def _fake_mm_shape(m: int, k: int, n: int) -> tuple[int, ...]:
    """The shape aten.mm's meta kernel gives on fake tensors, shapes no other test uses (no cache hit)."""
    with compat.FakeTensorMode():
        return tuple(torch.ops.aten.mm.default(torch.empty(m, k), torch.empty(k, n)).shape)


def test_a_meta_kernel_stricter_than_the_real_one_defers_to_it(monkeypatch):
    def too_strict(*args, **kwargs):
        raise RuntimeError("the meta kernel refuses")

    def trace(a, b, mode_class):
        mode = mode_class(allow_non_fake_inputs=True)
        with mode:
            fa, fb = torch.empty_strided(a.shape, a.stride()), torch.empty_strided(b.shape, b.stride())
        return make_fx(lambda x, y: torch.ops.aten.mm.default(x, y), tracing_mode="fake")(fa, fb)

    with _meta_kernel_replaced(torch.ops.aten.mm.default, too_strict), compat.quiet_meta_failures():
        graph = trace(torch.randn(4, 8), torch.randn(8, 3), compat.FakeTensorModeWithFallback)
        out = next(n for n in graph.graph.nodes if n.op == "call_function").meta["val"]
        assert tuple(out.shape) == (4, 3)
        with pytest.raises(MetaKernelRejection) as caught:
            trace(torch.randn(4, 8), torch.randn(7, 3), compat.FakeTensorModeWithFallback)
        assert caught.value.confirmed and "cannot be multiplied" in str(caught.value)
        monkeypatch.delattr(compat.FakeTensorMode, "can_run_unsafe_fallback")
        with pytest.raises(MetaKernelRejection, match="the meta kernel refuses") as caught:
            trace(torch.randn(5, 8), torch.randn(8, 3), compat.FakeTensorModeWithFallback)  # new shapes: no cache hit
        assert not caught.value.confirmed
    assert _fake_mm_shape(7, 13, 11) == (7, 11)      # the original meta kernel again, for every later test


def test_recording_results_follows_every_op_result_weakly_and_its_fallback_records_nothing(monkeypatch):
    mode = compat.FakeTensorModeWithFallback(allow_non_fake_inputs=True)
    x = mode.from_tensor(torch.randn(4))
    with mode.recording_results() as produced:
        with mode:
            kept = [x + 1, x + 1]                  # the second is served from FakeTensorMode's cache
            torch.chunk(x, 2)                      # results dropped at once
    assert [op for _, op in produced][:2] == [torch.ops.aten.add.Tensor] * 2
    assert all(ref() is tensor for (ref, _), tensor in zip(produced, kept))
    assert all(ref() is None for ref, op in produced if op is not torch.ops.aten.add.Tensor)
    monkeypatch.delattr(compat.FakeTensorModeWithFallback, "dispatch")   # a torch without the hook
    with mode.recording_results() as produced, mode:
        assert (x * 2).shape == (4,)
    assert produced == []


def test_current_stream_id_and_workspace_clearing_without_cuda(monkeypatch):
    compat.clear_cublas_workspaces()                                 # a no-op without CUDA, never an error
    monkeypatch.delattr(torch._C, "_cuda_clearCublasWorkspaces", raising=False)
    compat.clear_cublas_workspaces()


def test_current_trace_graph_and_its_fallback_are_the_graph_make_fx_records(monkeypatch):
    graphs = []

    def body(x):
        graphs.append(compat.current_trace_graph())
        y = x * 2
        graphs.append(compat.current_trace_graph())
        return y

    def traced_graph():
        graphs.clear()
        graph_module = make_fx(body, tracing_mode="fake")(torch.randn(2))
        assert graphs[0] is graphs[1]
        return graph_module, graphs[0]

    graph_module, graph = traced_graph()
    assert [n.target for n in graph.nodes if n.op == "call_function"] == [torch.ops.aten.mul.Tensor]
    monkeypatch.setattr(compat_tracing, "_get_proxy_mode", None)
    graph_module, graph = traced_graph()
    assert [n.target for n in graph.nodes if n.op == "call_function"] == [torch.ops.aten.mul.Tensor]
    with pytest.raises(AssertionError, match="no make_fx trace in progress"):
        compat.current_trace_graph()


def test_outside_current_trace_steps_out_of_make_fx():
    seen = []

    def body(x):
        with compat.outside_current_trace():
            seen.append(type(torch.ones(2)).__name__)                # a real tensor, not a traced one
        return x * 2

    graph = make_fx(body, tracing_mode="fake")(torch.randn(2))
    assert seen == ["Tensor"]
    assert [n.target for n in graph.graph.nodes if n.op == "call_function"] == [torch.ops.aten.mul.Tensor]


class GeneratorRefused(Exception):
    pass


def test_refusing_generator_arguments_stops_the_op_before_make_fx_records_it_and_its_fallback_does_nothing(
        monkeypatch):
    generator = torch.Generator().manual_seed(0)
    refused = []

    def body(x):
        with compat.refusing_generator_arguments(lambda op: GeneratorRefused(refused.append(op))):
            return x + torch.rand(x.shape) * torch.rand(x.shape, generator=generator)

    with pytest.raises(GeneratorRefused):
        make_fx(body, tracing_mode="fake")(torch.randn(3))
    assert refused == [torch.ops.aten.rand.generator]          # the global generator's draw passed
    monkeypatch.setitem(sys.modules, "torch.utils._python_dispatch", None)
    assert isinstance(compat.refusing_generator_arguments(GeneratorRefused), contextlib.nullcontext)


class ValueReadRefused(Exception):
    pass


def test_refusing_value_reads_of_outside_tensors_stops_reads_of_real_tensors_and_its_fallback_does_nothing(
        monkeypatch):
    outside, refused = torch.tensor(3.0), []

    def body(x, read):
        with compat.refusing_value_reads_of_outside_tensors(lambda op: ValueReadRefused(refused.append(op))):
            return x * read(x)

    make_fx(lambda x: body(x, lambda x: torch.tensor(2.0).item()), tracing_mode="fake")(torch.randn(2))  # its own
    for read in (lambda x: float(outside * 2), lambda x: x[:outside.long()].sum(), lambda x: outside.tolist()):
        with pytest.raises(ValueReadRefused):
            make_fx(lambda x: body(x, read), tracing_mode="fake")(torch.randn(4))
    assert refused == [torch.ops.aten._local_scalar_dense.default] * 2 + [torch.Tensor.tolist]
    monkeypatch.setitem(sys.modules, "torch.utils._python_dispatch", None)
    assert isinstance(compat.refusing_value_reads_of_outside_tensors(ValueReadRefused), contextlib.nullcontext)


def test_importing_inductor_raises_no_warning_about_torchs_own_torchscript_classes(monkeypatch):
    import sys
    import warnings

    monkeypatch.delitem(sys.modules, "torch.utils.mkldnn", raising=False)   # the compiler imports it afresh
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiler = compat.inductor_compiler()
    assert "torch.utils.mkldnn" in sys.modules
    assert callable(compiler)
    assert not [w for w in caught if "script_method" in str(w.message)]
    with warnings.catch_warnings(record=True) as caught:        # only that import is quiet, nothing after it
        warnings.simplefilter("always")
        warnings.warn("`torch.jit.script_method` is deprecated", DeprecationWarning)
    assert len(caught) == 1


def test_marked_static_address_reads_torch_compiles_mark():
    marked, unmarked = torch.zeros(2), torch.zeros(2)
    torch._dynamo.mark_static_address(marked)
    assert compat.marked_static_address(marked) and not compat.marked_static_address(unmarked)


_GLOBAL_SCALE = torch.ones(3)


def test_dynamo_input_origin_follows_source_chains_to_the_frame_arguments():
    origins = {}

    def record(graph_module, example_inputs):
        for node in graph_module.graph.nodes:
            if node.op == "placeholder":
                origins[node.name] = compat.dynamo_input_origin(node)
        return graph_module.forward

    def wrapper(*args, **kwargs):                  # like transformers' decorated forwards
        return kwargs["x"] * _GLOBAL_SCALE + args[0]

    torch._dynamo.reset()
    torch.compile(wrapper, backend=record, dynamic=False)(torch.zeros(3), x=torch.ones(3))
    assert sorted(origins.values()) == [False, True, True]
    assert [origin for name, origin in origins.items() if "global" in name] == [False], origins
    placeholder = torch.fx.Graph().placeholder("x")
    assert compat.dynamo_input_origin(placeholder) is None


def test_dynamo_input_name_is_the_source_the_user_wrote_or_the_placeholders_name():
    names = []

    def record(graph_module, example_inputs):
        names.extend(compat.dynamo_input_name(node) for node in graph_module.graph.nodes if node.op == "placeholder")
        return graph_module.forward

    def model(ids, masks):
        return ids * masks["attention"]

    torch._dynamo.reset()
    torch.compile(model, backend=record, dynamic=False)(torch.ones(3), {"attention": torch.ones(3)})
    assert names == ["L['ids']", "L['masks']['attention']"]
    assert compat.dynamo_input_name(torch.fx.Graph().placeholder("x")) == "x"


# --- the per-call check of df.jit -----------------------------------------------------------------


def _leaf_checker_example():
    """A call's leaves and fixed objects as df.jit's guard checks them: ([tensor, int], (module, tensor))."""
    module, closed_over = torch.nn.Dropout(), torch.randn(4, 4)
    example = ([torch.randn(2, 3), 2], (module, closed_over))
    checks = [compat.LeafCheck((0, 0)), compat.LeafCheck((0, 1)), compat.LeafCheck((1, 0), "training"),
              compat.LeafCheck((1, 1))]
    return example, checks


def test_leaf_checker_compares_tensors_by_layout_and_the_rest_by_type_and_value():
    example, checks = _leaf_checker_example()
    (tensor, number), (module, closed_over) = example
    check = compat.leaf_checker(example, checks)
    assert check is not None and check(example)
    assert check(([torch.randn(2, 3), 2], (module, closed_over)))             # data is not compared
    refused = [([torch.randn(3, 3), 2], (module, closed_over)),               # shape
               ([torch.randn(3, 2).t(), 2], (module, closed_over)),           # strides
               ([tensor.double(), 2], (module, closed_over)),                 # dtype
               ([torch.empty(2, 3, device="meta"), 2], (module, closed_over)),  # device
               ([torch.nn.Parameter(tensor), 2], (module, closed_over)),      # Python type
               ([tensor, 3], (module, closed_over)), ([tensor, True], (module, closed_over)),
               ([tensor, 2.0], (module, closed_over)), ([2, tensor], (module, closed_over)),
               ([tensor], (module, closed_over)), ((tensor, 2), (module, closed_over)), None]
    for call in refused:
        assert not check(call)
    module.eval()
    assert not check(example)
    module.train()
    closed_over.data = closed_over.data.t()                                  # same memory, new strides
    assert not check(example)


def test_leaf_checker_is_none_where_the_guards_are_missing_or_differ(monkeypatch):
    from torch._C._dynamo import guards

    example, checks = _leaf_checker_example()

    class Rejects:
        """A guard manager whose bindings take arguments of another form."""

        def __getattr__(self, name):
            def rejects(*args):
                raise TypeError(f"{name}(): incompatible function arguments")
            return rejects

    monkeypatch.setattr(guards, "RootGuardManager", Rejects)
    assert compat.leaf_checker(example, checks) is None
    monkeypatch.delattr(guards, "RootGuardManager")
    assert compat.leaf_checker(example, checks) is None


def test_leaf_checker_calls_guard_bindings_without_a_user_stack_where_they_take_none(monkeypatch):
    from torch._C._dynamo import guards

    added = []

    class WithoutUserStack:
        """A guard manager of a torch whose `add_*_guard` bindings take no `user_stack`."""

        def tuple_getitem_manager(self, index, source, example_value, kind):
            return self

        list_getitem_manager = tuple_getitem_manager

        def getattr_manager(self, name, source, example_value, kind):
            return self

        def add_tensor_match_guard(self, value, sizes, strides, name, description, pytype, keys, *rest):
            if rest:
                raise TypeError("add_tensor_match_guard(): incompatible function arguments")
            added.append(("tensor", sizes, strides, pytype))

        def add_equals_match_guard(self, value, description, *rest):
            if rest:
                raise TypeError("add_equals_match_guard(): incompatible function arguments")
            added.append(("equals", value))

        def check(self, value):
            return True

    monkeypatch.setattr(guards, "RootGuardManager", WithoutUserStack)
    example, checks = _leaf_checker_example()
    assert compat.leaf_checker(example, checks) is not None
    assert added == [("tensor", [2, 3], [3, 1], torch.Tensor), ("equals", 2), ("equals", True),
                     ("tensor", [4, 4], [4, 1], torch.Tensor)]
class _Doubled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(3))

    def forward(self, x):
        return (x * self.weight).sin()


def test_aot_autograd_backend_hands_over_a_forward_and_a_backward_graph():
    compiled_graphs = []

    def compiler(name):
        def compile_graph(graph_module, example_inputs):
            compiled_graphs.append(name)
            return compat.boxed(graph_module)
        return compile_graph

    backend = compat.aot_autograd_backend(compiler("forward"), compiler("backward"))
    model = _Doubled()
    torch._dynamo.reset()
    torch.compile(model, backend=backend)(torch.randn(3)).sum().backward()
    assert compiled_graphs == ["forward", "backward"] and model.weight.grad is not None


def test_aot_autograd_backend_without_aot_autograd_is_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch._dynamo.backends.common", None)
    assert compat.aot_autograd_backend(lambda *a: None, lambda *a: None) is None


def test_recomputing_partitioner_needs_networkx(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    assert (compat.recomputing_partitioner() is None) == (real("networkx") is None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "networkx" else real(name, *a))
    assert compat.recomputing_partitioner() is None


@pytest.mark.parametrize("with_torchs", [True, False])
def test_boxed_calls_with_one_list_of_arguments(monkeypatch, with_torchs):
    if not with_torchs:
        monkeypatch.setitem(sys.modules, "torch._functorch.aot_autograd", None)
    call = compat.boxed(lambda a, b: a - b)
    assert call._boxed_call is True and call([5, 3]) == 2


def test_first_unbacked_node_finds_the_op_whose_size_depends_on_data(monkeypatch):
    found = []

    def record(graph_module, example_inputs):
        found.append(compat.first_unbacked_node(graph_module))
        return graph_module.forward

    def fn(x):
        return (x + 1).nonzero().sum()

    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        torch.compile(fn, backend=record)(torch.randn(4))
    torch.compile(lambda x: x * 2, backend=record)(torch.randn(4))
    assert found[0].target == "nonzero" and found[1] is None
    monkeypatch.setitem(sys.modules, "torch.fx.experimental.symbolic_shapes", None)
    assert compat.first_unbacked_node(torch.fx.symbolic_trace(lambda x: x.nonzero())) is None


def test_module_changes_are_reported_by_torchs_own_mutators(monkeypatch):
    from torch.utils.hooks import RemovableHandle

    reports = []
    record = lambda owner, attribute: reports.append((owner, attribute))      # noqa: E731
    monkeypatch.setattr(compat_modules, "_module_observer", [record])
    model = torch.nn.Linear(2, 2)
    changes = [
        (lambda: setattr(model, "scale", 2.0), (model, "scale")),
        (lambda: delattr(model, "scale"), (model, "scale")),
        (lambda: model.add_module("child", torch.nn.ReLU()), (model, None)),
        (lambda: model.register_buffer("stat", torch.zeros(2)), (model, None)),
        (lambda: model.register_parameter("extra", None), (model, None)),
        (lambda: model.to(torch.float64), (model, None)),
        (lambda: model.register_forward_pre_hook(lambda *a: None), (model, None)),
        (lambda: torch.nn.modules.module.register_module_forward_hook(lambda *a: None).remove(), (None, None)),
    ]
    for change, expected in changes:
        reports.clear()
        change()
        assert expected in reports
    reports.clear()
    model.register_forward_hook(lambda *a: None).remove()
    assert any(owner is model._forward_hooks for owner, _ in reports)
    monkeypatch.delattr(RemovableHandle, "remove")
    assert not compat.observe_module_changes(lambda owner, attribute: None)    # observes nothing new
    assert compat_modules._module_observer == [record]


def test_ops_are_transformed_inside_traces_modes_and_torch_func_transforms(monkeypatch):
    from torch.utils.flop_counter import FlopCounterMode

    from dynaflow_fn.jitting import jitted

    seen = []
    probe = lambda x: seen.append(jitted.ops_are_transformed()) or x * 2       # noqa: E731
    probe(torch.randn(2))
    make_fx(probe)(torch.randn(2))
    torch.func.vmap(probe)(torch.randn(3, 2))
    torch.func.grad(lambda x: probe(x).sum())(torch.randn(2))
    with FlopCounterMode(display=False):
        probe(torch.randn(2))
    assert seen == [False, True, True, True, True]
    monkeypatch.delattr(torch._C, "_len_torch_dispatch_stack")
    monkeypatch.setattr(jitted, "_mode_depth", compat_calls._resolve_dispatch_mode_readers()[0])
    monkeypatch.setattr(jitted, "_recording_mode", compat_calls._resolve_dispatch_mode_readers()[1])
    monkeypatch.setattr(jitted, "_interpreter", compat_calls._no_interpreter)
    seen.clear()
    make_fx(probe)(torch.randn(2))
    torch.func.vmap(probe)(torch.randn(3, 2))
    assert seen == [True, False]                  # a trace is still seen; a transform no longer is


def test_in_backward_is_true_only_while_the_engine_runs_backward(monkeypatch):
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen.append(compat.in_backward())
            return x * 1

        @staticmethod
        def backward(ctx, grad):
            seen.append(compat.in_backward())
            return grad

    Probe.apply(torch.randn(2, requires_grad=True)).sum().backward()
    assert seen == [False, True] and not compat.in_backward()
    monkeypatch.delattr(torch._C, "_current_graph_task_id")
    seen.clear()
    Probe.apply(torch.randn(2, requires_grad=True)).sum().backward()
    assert seen == [False, False]
