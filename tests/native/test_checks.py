"""dynaflow_fn's C++ call checks: they build where a compiler is, compare what torch's guards compare,
and df.jit falls back to torch's checks, with a warning, where they cannot be built."""

import os
import shutil
import warnings

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dynaflow_fn as df
from dynaflow_fn import compat, native
from dynaflow_fn.jitting import guard
from dynaflow_fn.runtime import cudagraph
from fixtures import native_checks_ready


@pytest.fixture
def asked_anew():
    """`native.module()` asked again, as a new process would: what it found before is forgotten."""
    native.module.cache_clear()
    yield
    native.module.cache_clear()
    native_checks_ready()


@pytest.fixture
def empty_cache(asked_anew, monkeypatch, tmp_path):
    """An extensions directory with nothing built in it."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    return tmp_path


def _example():
    """A call's leaves and fixed objects as df.jit's guard checks them: ([tensor, int, str], (module, tensor))."""
    module, closed_over = torch.nn.Dropout(), torch.randn(4, 4)
    example = ([torch.randn(2, 3), 2, "mean"], (module, closed_over))
    checks = [compat.LeafCheck((0, 0)), compat.LeafCheck((0, 1)), compat.LeafCheck((0, 2)),
              compat.LeafCheck((1, 0), "training"), compat.LeafCheck((1, 1))]
    return example, checks


def _variants(example):
    """Calls that differ from `example` in one checked field each, and two that differ only in data."""
    (tensor, number, word), (module, closed_over) = example
    fixed = (module, closed_over)
    same = [([torch.randn(2, 3), 2, "mean"], fixed), ([torch.zeros(2, 3), 1 + 1, "me" + "an"], fixed)]
    other = [([torch.randn(3, 3), 2, "mean"], fixed),                  # shape
             ([torch.randn(3, 2).t(), 2, "mean"], fixed),              # strides
             ([tensor.double(), 2, "mean"], fixed),                    # dtype
             ([torch.empty(2, 3, device="meta"), 2, "mean"], fixed),   # device
             ([torch.nn.Parameter(tensor), 2, "mean"], fixed),         # Python type
             ([torch.randn(2, 3, requires_grad=True), 2, "mean"], fixed),   # requires_grad
             ([tensor, 3, "mean"], fixed), ([tensor, True, "mean"], fixed), ([tensor, 2.0, "mean"], fixed),
             ([tensor, 2, "sum"], fixed), ([2, tensor, "mean"], fixed),
             ([tensor, 2], fixed), ([tensor, 2, "mean"], (module,)), ([tensor, 2, "mean"],), None, 7,
             ([tensor, 2, "mean"], (torch.nn.Dropout().eval(), closed_over)),
             ([tensor, 2, "mean"], (object(), closed_over)),           # no `training` attribute
             ([tensor, 2, "mean"], (module, closed_over[:, :2]))]
    return same, other


def test_the_checks_build_where_a_compiler_is():
    if shutil.which(os.environ.get("CXX", "c++")) is None or shutil.which("ninja") is None:
        pytest.skip("no C++ compiler or ninja here")
    assert native.module() is not None


@pytest.fixture
def built():
    """The built checks (their module), or a skip where they cannot be built."""
    checks = native.module()
    if checks is None:
        pytest.skip("dynaflow_fn's C++ checks are not built here")
    return checks


def test_a_leaf_check_compares_tensors_by_layout_and_the_rest_by_type_and_value(built):
    example, checks = _example()
    check = native.leaf_checker(example, checks)
    assert check(example)
    same, other = _variants(example)
    assert all(check(call) for call in same)
    assert not any(check(call) for call in other)


def test_a_leaf_check_agrees_with_torchs_guards_outside_inference_mode(built):
    example, checks = _example()
    ours, torchs = native.leaf_checker(example, checks), compat.leaf_checker(example, checks)
    if torchs is None:
        pytest.skip("this torch has no guard manager to compare with")
    same, other = _variants(example)
    assert [ours(call) for call in same + other] == [torchs(call) for call in same + other]


def test_a_leaf_check_sees_a_tensor_changed_in_place(built):
    tensor, module = torch.randn(4, 4), torch.nn.Dropout()
    example = ([tensor], (module,))
    check = native.leaf_checker(example, [compat.LeafCheck((0, 0)), compat.LeafCheck((1, 0), "training")])
    for change, undo in [(lambda: tensor.t_(), lambda: tensor.t_()),
                         (lambda: tensor.resize_(16), lambda: tensor.resize_(4, 4)),
                         (lambda: setattr(tensor, "data", torch.randn(4, 4, dtype=torch.float64)),
                          lambda: setattr(tensor, "data", torch.randn(4, 4))),
                         (lambda: tensor.requires_grad_(), lambda: tensor.requires_grad_(False)),
                         (lambda: module.eval(), lambda: module.train())]:
        change()
        assert not check(example)
        undo()
        assert check(example)


def test_a_leaf_check_tells_a_conjugate_view_from_its_tensor(built):
    tensor = torch.randn(2, 3, dtype=torch.cfloat)
    check = native.leaf_checker(([tensor],), [compat.LeafCheck((0, 0))])
    assert check(([tensor.clone()],)) and not check(([tensor.conj()],))


def test_a_leaf_check_tells_an_inference_tensor_from_an_ordinary_one_in_any_mode(built):
    with torch.inference_mode():
        made_inside = torch.randn(3)
    ordinary = torch.randn(3)
    check = native.leaf_checker(([ordinary],), [compat.LeafCheck((0, 0))])
    assert not check(([made_inside],))
    with torch.inference_mode():
        assert not check(([made_inside],)) and check(([ordinary],))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_a_leaf_check_of_what_it_cannot_read_is_none(built):
    nested = torch.nested.nested_tensor([torch.randn(2), torch.randn(3)])
    assert native.leaf_checker(([nested],), [compat.LeafCheck((0, 0))]) is None
    assert native.leaf_checker(([],), [compat.LeafCheck((0, 0))]) is None


def test_an_address_check_compares_each_resident_inputs_address(built):
    base = torch.randn(8)
    a, b, view = torch.randn(2), torch.randn(2), base[2:]
    check = native.address_checker([1, 2], [b.data_ptr(), view.data_ptr()])
    assert check([a, b, view]) and check((None, b, view))
    assert not check([a, a, view]) and not check([a, b, base]) and not check([a, b.clone(), view])
    assert not check([a, b]) and not check([a, b, 3]) and not check(None)


def test_the_executable_checks_addresses_with_torch_where_the_checks_are_not_built(monkeypatch):
    a, b = torch.randn(2), torch.randn(2)
    for built_checks in (native.module(), None):
        monkeypatch.setattr(native, "module", lambda: built_checks)
        check = cudagraph._address_check([None, b.data_ptr()], [1])
        assert check([a, b]) and not check([b, a])


def test_a_later_process_loads_the_built_library_without_building(built, asked_anew, monkeypatch):
    first = native.module()
    native.module.cache_clear()
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", lambda *args, **kwargs: pytest.fail("built again"))
    assert native.module().__file__ == first.__file__


def test_where_the_checks_cannot_be_built_df_jit_warns_once_and_checks_through_torch(empty_cache, monkeypatch):
    from torch.utils import cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension: c++: command not found")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    fast = df.jit(lambda x, scale: x * scale)
    with pytest.warns(UserWarning, match="could not build its C.. call checks .RuntimeError: Error building"):
        assert torch.equal(fast(torch.ones(3), 2), torch.full((3,), 2.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(fast(torch.full((3,), 5.0), 2), torch.full((3,), 10.0))
        assert torch.equal(fast(torch.ones(3), 3), torch.full((3,), 3.0))
    assert native.module() is None and fast.hits == 1          # the second call replayed the first's plan


def test_a_library_deleted_since_its_build_is_built_again(built, empty_cache, monkeypatch):
    from torch.utils import cpp_extension

    builds = []
    monkeypatch.setattr(cpp_extension, "load", lambda *args, **kwargs: builds.append(args) or built)
    assert native.module() is built and len(builds) == 1
    (record,) = empty_cache.glob("*/built")
    record.write_text(str(empty_cache / "deleted.so"))
    native.module.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.module() is built and len(builds) == 2


def test_the_builds_own_warnings_stay_inside_it(built, empty_cache, monkeypatch):
    from torch.utils import cpp_extension

    def noisy_build(*args, **kwargs):
        warnings.warn("Your compiler (c++) may be ABI-incompatible with PyTorch!")
        return built

    monkeypatch.setattr(cpp_extension, "load", noisy_build)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.module() is built


def test_dynaflow_native_0_builds_nothing(empty_cache, monkeypatch):
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.module() is None
    assert not list(empty_cache.iterdir())


def test_a_guard_checks_through_the_built_checks(built):
    fast = df.jit(lambda x, scale: x * scale)
    fast(torch.ones(3), 2)
    assert type(fast._last.guard.fit) is native.module().LeafCheck
    assert type(guard.native_check([torch.ones(3), 2.5], [], []).check) is native.module().LeafCheck


def _universe():
    """Leaves a call may pass, tensors of several layouts and kinds and static values of several types."""
    base = torch.randn(2, 3)
    with torch.inference_mode():
        inference = torch.randn(2, 3)
    return [base, torch.randn(2, 3), torch.randn(3, 2).t(), base.double(), base.to(torch.int64), torch.randn(3, 2),
            torch.randn(2, 3, requires_grad=True), torch.nn.Parameter(torch.randn(2, 3)), base[:, :2], inference,
            torch.randn(2, 3, dtype=torch.cfloat), torch.randn(2, 3, dtype=torch.cfloat).conj(),
            0, 1, 2, True, False, 1.5, 2.5, -0.0, 0.0, float("nan"), "mean", "sum", torch.float32, torch.float16,
            torch.device("cpu"), b"x", 3.0]


@given(example=st.lists(st.integers(0, 28), min_size=1, max_size=5), data=st.data())
@settings(max_examples=150, deadline=None)
def test_a_guard_on_the_cpp_checks_admits_no_call_the_python_check_refuses(example, data):
    """The C++ checks compare more than the full key does (Python type, dispatch keys, requires_grad),
    never less: a call they admit runs the plan the full lookup would pick."""
    built = native.module()
    if built is None:
        pytest.skip("dynaflow_fn's C++ checks are not built here")
    universe = _universe()
    leaves = [universe[i] for i in example]
    picks = data.draw(st.lists(st.integers(0, 28), min_size=len(leaves), max_size=len(leaves)))
    call = [universe[i] for i in picks]
    treedef = optree.tree_structure(((*leaves,), {}))
    state = guard.call_state()
    ours = guard.Guard(treedef, leaves, state)
    assert type(ours.fit) is built.LeafCheck or guard.native_check(leaves, [], []).python_positions
    os.environ[guard.PYTHON_GUARD_ENV] = "1"
    try:
        python = guard.Guard(treedef, leaves, state)
    finally:
        del os.environ[guard.PYTHON_GUARD_ENV]
    if ours._fits(call, state):
        assert python._fits(call, state)
    assert ours._fits(list(leaves), state) and python._fits(list(leaves), state)
