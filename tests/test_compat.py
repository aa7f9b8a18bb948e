"""Every entry of dynaflow_fn.compat works on this torch, and so does its fallback where the internal is gone."""

import torch
import torch.fx._symbolic_trace as symbolic_trace
from torch.fx.experimental.proxy_tensor import make_fx

from dynaflow_fn import compat


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
    finally:
        dist.destroy_process_group()
