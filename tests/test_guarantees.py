"""What df.jit guarantees: a jitted function computes what the function computes, whatever the caller
does between calls (switch modes, update weights in place, close over tensors, call from threads, pass
aliased arguments, require gradients), or refuses with a named error. Each test compares with eager
PyTorch on fresh random inputs."""

import dataclasses
import threading

import optree
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dynaflow_fn as df
from dynaflow_fn import transforms as T
from dynaflow_fn.errors import GradientError
from models import tiny_moe
from dynaflow_fn.ir.program import info
from fixtures import run_together
from models import DropoutNet


# --- Python state that tracing reads -----------------------------------------------------------------


def test_switching_to_eval_after_the_first_call_is_seen():
    model = DropoutNet().train()
    fn, params = df.pure(model)
    fast = df.jit(fn)
    with torch.no_grad():
        fast(params, torch.randn(16, 32))
        model.eval()
        for _ in range(2):
            x = torch.randn(16, 32)
            torch.testing.assert_close(fast(params, x), model(x), rtol=0, atol=0)
        model.train()
        assert (fast(params, torch.randn(16, 32)) == 0).any()                # dropout is on again
    assert fast.cache_info().entries == 2 and fast.cache_info().misses == 2
    model.eval()
    fast(params, torch.randn(16, 32))
    assert fast.cache_info().misses == 2                                      # both modes stay cached


def test_a_submodule_switched_alone_is_seen():
    model = DropoutNet().eval()
    fast = df.jit(lambda x: model(x))
    x = torch.randn(16, 32)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), rtol=0, atol=0)
        assert not (fast(x) == 0).any()
        model.drop.train()
        assert (fast(x) == 0).any()
    assert fast.cache_info().misses == 2


def test_a_mode_read_without_calling_the_module_is_seen():
    model = nn.Linear(8, 8)

    def scaled(x):
        return x * 2 if model.training else x

    fast = df.jit(scaled)
    x = torch.randn(4, 8)
    torch.testing.assert_close(fast(x), scaled(x), rtol=0, atol=0)
    model.eval()
    torch.testing.assert_close(fast(x), scaled(x), rtol=0, atol=0)
    assert fast.cache_info().misses == 2


def test_modes_that_the_trace_did_not_read_do_not_retrace():
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)).train()
    fast = df.jit(lambda x: model(x))
    x = torch.randn(4, 8)
    with torch.no_grad():
        fast(x)
        model.eval()
        torch.testing.assert_close(fast(x), model(x), rtol=0, atol=0)
    assert fast.cache_info().misses == 1


class ModeAsProperty(nn.Module):
    """A module whose class defines `training` itself, as a property over a private flag."""

    def __init__(self):
        super().__init__()
        self._mode = True

    @property
    def training(self):
        return self._mode

    @training.setter
    def training(self, value):
        self._mode = value

    def forward(self, x):
        return F.dropout(x, 0.5, self.training)


def test_a_module_class_defining_training_itself_is_still_checked():
    model = ModeAsProperty()
    fast = df.jit(lambda x: model(x))
    x = torch.randn(64, 8) + 2
    assert (fast(x) == 0).any()
    model.eval()
    torch.testing.assert_close(fast(x), x, rtol=0, atol=0)


def test_modes_read_while_tracing_are_read_as_before_on_other_threads():
    model = DropoutNet().eval()
    seen = []
    reader = threading.Thread(target=lambda: seen.extend(model.drop.training for _ in range(20000)))
    fast = df.jit(lambda x: model(x))
    reader.start()
    fast(torch.randn(4, 32))
    reader.join()
    assert seen == [False] * 20000 and "training" not in nn.Module.__dict__


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class LoRALinear(nn.Module):
    """A linear layer plus a low-rank update, as PEFT adapters replace one."""

    def __init__(self, base, rank=2):
        super().__init__()
        self.base = base
        self.down, self.up = nn.Linear(8, rank, bias=False), nn.Linear(rank, 8, bias=False)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


_HOOKS = {
    "forward hook": lambda m: m.fc1.register_forward_hook(lambda mod, args, out: out * 3),
    "forward hook with kwargs": lambda m: m.fc1.register_forward_hook(lambda mod, a, kw, out: out - 1, with_kwargs=True),
    "forward pre-hook": lambda m: m.fc1.register_forward_pre_hook(lambda mod, args: (args[0] * 2,)),
    "global forward hook": lambda m: torch.nn.modules.module.register_module_forward_hook(
        lambda mod, args, out: out + 1 if isinstance(mod, nn.Linear) else None),
    "global forward pre-hook": lambda m: torch.nn.modules.module.register_module_forward_pre_hook(
        lambda mod, args: (args[0].flip(-1),) if isinstance(mod, nn.Linear) else None),
}


@pytest.mark.parametrize("kind", list(_HOOKS))
def test_a_hook_registered_or_removed_after_the_first_call_is_seen(kind):
    model = TwoLayers()
    fast = df.jit(lambda x: model(x))
    with torch.no_grad():
        fast(torch.randn(4, 8))
        handle = _HOOKS[kind](model)
        try:
            for _ in range(2):
                x = torch.randn(4, 8)
                torch.testing.assert_close(fast(x), model(x), rtol=0, atol=0)
        finally:
            handle.remove()
        x = torch.randn(4, 8)
        torch.testing.assert_close(fast(x), model(x), rtol=0, atol=0)
    assert fast.cache_info().misses == 2                        # without the hook, the first plan again


def test_a_submodule_replaced_after_the_first_call_is_seen():
    model = TwoLayers()
    fn, params = df.pure(model)
    closure, pure = df.jit(lambda x: model(x)), df.jit(lambda x: fn(params, x))
    with torch.no_grad():
        closure(torch.randn(4, 8)), pure(torch.randn(4, 8))
        model.fc1 = LoRALinear(model.fc1)
        nn.init.normal_(model.fc1.up.weight)
        x = torch.randn(4, 8)
        torch.testing.assert_close(closure(x), model(x), rtol=0, atol=0)
        with pytest.raises(RuntimeError, match="Missing key"):
            fn(params, x)                                       # the old params no longer fit the model
        with pytest.raises(df.TraceError, match="Missing key"):
            pure(x)


def test_a_parameter_or_attribute_replaced_after_the_first_call_is_seen():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.scale = nn.Linear(8, 8), 2.0

        def forward(self, x):
            return self.fc(x) * self.scale

    model = Scaled()
    fast = df.jit(lambda x: model(x))
    changes = [lambda: setattr(model, "scale", 0.5),
               lambda: setattr(model.fc, "weight", nn.Parameter(torch.randn(8, 8))),
               lambda: model.fc.register_buffer("bias", torch.randn(8)) if delattr(model.fc, "bias") is None else None,
               lambda: torch.nn.utils.parametrize.register_parametrization(model.fc, "weight", Doubled())]
    with torch.no_grad():
        for change in changes:
            fast(torch.randn(4, 8))
            change()
            x = torch.randn(4, 8)
            torch.testing.assert_close(fast(x), model(x), rtol=0, atol=0)
    assert fast.cache_info().misses == 1 + len(changes)


class Doubled(nn.Module):
    def forward(self, weight):
        return weight * 2


def test_changes_to_modules_a_plan_does_not_read_trace_nothing_again():
    model, other = TwoLayers(), TwoLayers()
    fast = df.jit(lambda x: model(x))
    with torch.no_grad():
        fast(torch.randn(4, 8))
        other.fc1 = nn.Linear(8, 8)
        other.register_forward_hook(lambda mod, args, out: out * 2).remove()
        nn.CrossEntropyLoss()
        model.eval()
        x = torch.randn(4, 8)
        torch.testing.assert_close(fast(x), model(x), rtol=0, atol=0)
    assert fast.cache_info().misses == 1


def test_default_dtype_and_autocast_are_part_of_the_key():
    fast = df.jit(lambda x: x @ x.T + torch.ones(x.shape[0]))
    x = torch.randn(4, 4)
    fast(x)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        expected = x @ x.T + torch.ones(4)
        assert fast(x).dtype == expected.dtype == torch.float64
    finally:
        torch.set_default_dtype(previous)
    product = df.jit(lambda x: x @ x.T)
    product(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = torch.randn(4, 4)
        expected, got = y @ y.T, product(y)
    assert got.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


# --- tensors the function closes over --------------------------------------------------------------


class GemmaNorm(nn.Module):
    """RMSNorm that scales by (1 + weight): work that reads only the weight."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim) * 0.1)

    def forward(self, x):
        scale = (1 + self.weight.float()).to(x.dtype)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * scale


def test_closed_over_parameters_updated_in_place_are_read_fresh():
    model = nn.Sequential(nn.Linear(16, 16), GemmaNorm(16))
    fn, params = df.pure(model)
    fast = df.jit(lambda x: fn(params, x))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        x = torch.randn(8, 16)
        torch.testing.assert_close(fast(x), model(x).detach(), rtol=0, atol=0)
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert fast.cache_info().misses == 1


def test_work_on_a_closed_over_tensor_alone_follows_its_updates():
    w = torch.randn(8)

    def f(x):
        return x * (w * 2) + x * w + (1 + w).to(torch.float64).sum()

    fast = df.jit(f)
    for _ in range(3):
        x = torch.randn(4, 8)
        torch.testing.assert_close(fast(x), f(x), rtol=0, atol=0)
        w.add_(torch.randn(8))
    program = df.trace(f, torch.randn(4, 8))
    assert program.closed_over and program.closed_over[0].tensor is w and program.closed_over[0].name == "w"
    assert "# closed over (resident, read every call): w\n" in str(program)


def test_a_closed_over_tensor_replaced_through_data_is_seen():
    w = torch.randn(8)
    f = lambda x: x * w.sum(0)                                       # noqa: E731
    fast = df.jit(f)
    fast(torch.randn(8))
    w.data = torch.randn(8)                                          # same layout, new memory
    x = torch.randn(8)
    torch.testing.assert_close(fast(x), f(x), rtol=0, atol=0)
    w.data = torch.randn(3, 8)                                       # new layout: traced again
    torch.testing.assert_close(fast(x), f(x), rtol=0, atol=0)
    assert fast.cache_info().misses == 2


def test_a_closed_over_tensor_mutated_inside_the_function_is_written_back():
    counter = torch.zeros(3)

    def f(x):
        counter.add_(x)
        return counter * 2

    expected_counter = torch.zeros(3)
    fast = df.jit(f)
    for _ in range(3):
        x = torch.randn(3)
        expected_counter += x
        torch.testing.assert_close(fast(x), expected_counter * 2, rtol=0, atol=0)
    torch.testing.assert_close(counter, expected_counter, rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(), (3,)])
def test_a_closed_over_tensor_updated_from_constants_alone_is_updated_once_per_call(shape):
    """`counter.add_(1)` reads no argument; tracing must not run it on the caller's tensor as well."""

    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("steps", torch.zeros(shape, dtype=torch.long))
            self.scale = torch.randn(shape)

        def forward(self, x):
            self.steps.add_(1)
            self.scale.mul_(2)
            return x * self.scale.sum()

    eager, jitted = Counting(), Counting()
    jitted.scale.copy_(eager.scale)
    fast = df.jit(jitted)
    for _ in range(3):
        x = torch.randn(4)
        torch.testing.assert_close(fast(x), eager(x))
    torch.testing.assert_close(jitted.steps, eager.steps, rtol=0, atol=0)
    torch.testing.assert_close(jitted.scale, eager.scale)


def test_literals_inside_the_function_stay_constants():
    f = lambda x: x + torch.tensor([1.0, 2.0, 3.0])                   # noqa: E731
    program = df.trace(f, torch.randn(3))
    assert not program.closed_over
    x = torch.randn(3)
    torch.testing.assert_close(df.jit(f)(x), f(x))


# --- threads -------------------------------------------------------------------------------------------


def test_threads_calling_one_jitted_function_get_their_own_results():
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)).eval()
    fn, params = df.pure(model)
    fast = df.jit(fn)
    wrong = []

    def work(seed):
        generator = torch.Generator().manual_seed(seed)
        for _ in range(40):                                          # the first calls race too
            x = torch.randn(16, 64, generator=generator)
            with torch.no_grad():
                if not torch.equal(fast(params, x), model(x)):
                    wrong.append(seed)

    run_together(work, threads=4)
    assert not wrong, f"wrong results in threads {sorted(set(wrong))}"
    assert fast.cache_info().misses == 1


def test_jitted_functions_of_one_module_traced_on_several_threads_at_once_get_their_own_results():
    """A trace swaps the module's parameters for fake tensors while it runs (df.pure): another thread
    fingerprinting that module for its own new plan saw the fakes, and the trace then found them held
    by that thread's fingerprint (a TraceError), or the fingerprint kept them."""
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)).eval()
    fn, params = df.pure(model)
    inputs = [torch.randn(3 + k, 32) for k in range(6)]
    with torch.no_grad():
        expected = [model(x) for x in inputs]
    wrong = []

    def work(seed):
        for x, want in zip(inputs, expected):            # a new jitted function and a new trace each time
            with torch.no_grad():
                if not torch.equal(df.jit(fn, progress=False)(params, x), want):
                    wrong.append((seed, tuple(x.shape)))

    run_together(work, threads=4)                        # raises what any thread raised
    assert not wrong, f"wrong results (thread, input shape): {wrong}"


def test_tracing_ignores_module_calls_of_other_threads():
    traced_model = DropoutNet().eval()
    other = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    stop = threading.Event()

    def eager_loop():
        while not stop.is_set():
            other(torch.randn(2, 4))

    thread = threading.Thread(target=eager_loop)
    thread.start()
    try:
        fn, params = df.pure(traced_model)
        programs = [df.trace(fn, params, torch.randn(4, 32)) for _ in range(5)]
    finally:
        stop.set()
        thread.join()
    for program in programs:
        seen = {s.module_type for n in program.ops() for s in info(n).scopes if s.kind == "module"}
        assert seen == {DropoutNet, nn.Linear, nn.BatchNorm1d}         # eval-mode dropout adds no op
        assert [info(n).scopes for n in program.ops()] == [info(n).scopes for n in programs[0].ops()]


# --- aliased arguments ------------------------------------------------------------------------------------


def _add_into(a, b):
    a.add_(1)
    return a + b


def test_a_written_argument_passed_twice_is_refused():
    x = torch.randn(4)
    with pytest.raises(df.InputError, match=r"a and b share memory"):
        df.jit(_add_into)(x, x)
    base = torch.randn(8)
    with pytest.raises(df.InputError, match=r"share memory"):
        df.jit(_add_into)(base[:5], base[3:])                        # overlapping views


def test_a_written_argument_whose_elements_share_memory_is_refused_as_eager_refuses_it():
    base = torch.zeros(1, 4)
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        _add_into(base.expand(3, 4), torch.randn(3, 4))                 # eager PyTorch
    fast = df.jit(_add_into)
    for _ in range(2):
        with pytest.raises(df.InputError, match=r"writes a in place, but elements of a share memory .*\[0, 1\]"):
            fast(base.expand(3, 4), torch.randn(3, 4))
    assert torch.equal(base, torch.zeros(1, 4))
    torch.testing.assert_close(fast(base.clone().expand(3, 4).clone(), torch.ones(3, 4)), torch.full((3, 4), 2.0))


def test_disjoint_views_and_read_only_aliases_are_fine():
    base, expected = torch.randn(8), None
    expected_base = base.clone()
    expected = _add_into(expected_base[:4], expected_base[4:])
    torch.testing.assert_close(df.jit(_add_into)(base[:4], base[4:]), expected, rtol=0, atol=0)
    torch.testing.assert_close(base, expected_base, rtol=0, atol=0)
    x = torch.randn(4)
    torch.testing.assert_close(df.jit(torch.add)(x, x), x + x)


def test_a_donated_argument_aliasing_another_is_refused():
    step = df.jit(lambda w, g: (w - 0.1 * g, (g * w).sum()), donate_argnums=(0,))
    w = torch.randn(4)
    step(torch.randn(4), torch.randn(4))
    with pytest.raises(df.InputError, match=r"w and g share memory"):
        step(w, w)


# --- autograd -------------------------------------------------------------------------------------------


def test_outputs_from_inputs_that_require_grad_refuse_backward_with_a_named_error():
    model = nn.Linear(8, 8)
    fn, params = df.pure(model)
    fast = df.jit(fn)
    x = torch.randn(2, 8)
    y = fast(params, x)
    assert y.requires_grad and model(x).requires_grad
    torch.testing.assert_close(y.detach(), model(x).detach())
    with pytest.raises(RuntimeError, match=r"df\.jit.*value_and_grad"):
        y.sum().backward()
    with torch.no_grad():
        assert not fast(params, x).requires_grad
    plain = df.jit(lambda a: a * 2)(torch.randn(3))
    assert not plain.requires_grad


def _same_requires_grad(jitted, eager):
    jitted, eager = optree.tree_leaves(jitted), optree.tree_leaves(eager)
    assert [t.requires_grad for t in jitted] == [t.requires_grad for t in eager]
    for j, e in zip(jitted, eager):
        torch.testing.assert_close(j.detach(), e.detach())


def _loss(params, batch):
    return ((batch @ params["w"]).tanh() + params["b"]).square().mean()


def test_a_jitted_gradient_returns_what_eager_returns_not_tensors_requiring_grad():
    params = {"w": torch.randn(4, 4, requires_grad=True), "b": nn.Parameter(torch.randn(4))}
    batch = torch.randn(3, 4)
    for transform in (df.grad, df.value_and_grad):
        jitted = df.jit(transform(_loss))(params, batch)
        _same_requires_grad(jitted, transform(_loss)(params, batch))
        assert all(t.grad_fn is None for t in optree.tree_leaves(jitted))
        [t.numpy() for t in optree.tree_leaves(jitted)]


def test_gradients_with_respect_to_some_inputs_ignore_the_others_requiring_grad():
    model = nn.Linear(4, 4)                                     # closed over: its weights require grad
    f = df.grad(lambda x: model(x).square().sum())
    x = torch.randn(2, 4)
    _same_requires_grad(df.jit(f)(x), f(x))


def _mixed(a, b, w):
    with torch.no_grad():
        statistics = (a * w).mean()
    return a * w, b * 2, w.detach() * 3, torch.zeros_like(w), (w > 0), torch.histc(w, bins=4), statistics, a.sum()


def test_only_outputs_eager_autograd_connects_to_an_input_requiring_grad_require_grad():
    w = torch.randn(4, requires_grad=True)
    fast = df.jit(_mixed)
    for a, b in [(torch.randn(4), torch.randn(4)), (torch.randn(4, requires_grad=True), torch.randn(4))]:
        _same_requires_grad(fast(a, b, w), _mixed(a, b, w))


def _increments(x, nested):
    x.add_(1)
    nested["p"].mul_(2)
    return x.sum()


@pytest.mark.parametrize("which, eager_error", [
    ("leaf", "a leaf Variable that requires grad"),
    ("parameter in a dict", "a leaf Variable that requires grad"),
    ("view of a leaf", "a view of a leaf Variable that requires grad"),
    ("non-leaf", None),
])
def test_an_in_place_update_of_a_tensor_requiring_grad_is_refused_by_name(which, eager_error):
    leaf, p = torch.randn(6, requires_grad=True), nn.Parameter(torch.randn(3))
    x, nested = {"leaf": (leaf, {"p": torch.zeros(3)}), "parameter in a dict": (torch.zeros(6), {"p": p}),
                 "view of a leaf": (leaf[2:], {"p": torch.zeros(3)}), "non-leaf": (leaf * 2, {"p": torch.zeros(3)})}[which]
    if eager_error:
        with pytest.raises(RuntimeError, match=eager_error):
            _increments(x, nested)
    before = (x.detach().clone(), nested["p"].detach().clone())
    with pytest.raises(GradientError, match=r"updates (x|nested\['p'\]) in place while gradients are recorded.*"
                                            r"torch\.no_grad\(\)"):
        df.jit(_increments)(x, nested)
    assert torch.equal(x.detach(), before[0]) and torch.equal(nested["p"].detach(), before[1])   # nothing ran
    with torch.no_grad():
        df.jit(_increments)(x, nested)
    torch.testing.assert_close(x.detach(), before[0] + 1)


def test_a_closed_over_parameter_updated_in_place_is_refused_by_name():
    weight = nn.Parameter(torch.randn(4))

    def update(x):
        weight.add_(x)
        return weight * 2

    with pytest.raises(GradientError, match=r"updates weight in place.*a leaf tensor that requires grad"):
        df.jit(update)(torch.randn(4))


def _sgd(params, grads):
    with torch.no_grad():
        for name in params:
            params[name].sub_(0.1 * grads[name])
    return params["w"].sum()


def test_updates_the_function_makes_under_its_own_no_grad_run_as_in_eager():
    params, grads = {"w": nn.Parameter(torch.randn(4))}, {"w": torch.randn(4)}
    expected = {"w": nn.Parameter(params["w"].detach().clone())}
    fast = df.jit(_sgd)
    for _ in range(2):
        _same_requires_grad(fast(params, grads), _sgd(expected, grads))
        torch.testing.assert_close(params["w"].detach(), expected["w"].detach(), rtol=0, atol=0)


# --- static leaves and options ---------------------------------------------------------------------------


def test_static_floats_are_keyed_by_their_bits():
    fast = df.jit(lambda x, s: x / s)
    x = torch.randn(4)
    assert torch.equal(fast(x, 0.0), x / 0.0) and torch.equal(fast(x, -0.0), x / -0.0)
    assert fast.cache_info().misses == 2
    fast(x, float("nan"))
    fast(x, float("nan"))
    assert fast.cache_info().misses == 3


@dataclasses.dataclass(frozen=True)
class Config:
    scale: float


@dataclasses.dataclass(frozen=True)
class HoldsTensor:
    weight: torch.Tensor


def test_dataclass_static_leaves_are_keyed_field_by_field_and_refuse_tensors():
    fast = df.jit(lambda x, c: x / c.scale)
    x = torch.randn(4)
    assert torch.equal(fast(x, Config(0.0)), x / 0.0) and torch.equal(fast(x, Config(-0.0)), x / -0.0)
    with pytest.raises(df.InputError, match=r"c\.weight"):
        df.jit(lambda x, c: x * c.weight)(x, HoldsTensor(torch.randn(4)))


def test_donating_a_non_tensor_is_an_error():
    with pytest.raises(df.InputError, match=r"donate_argnums names argument 1 \(lr\), which holds no tensor"):
        df.jit(lambda w, lr: w * lr, donate_argnums=(1,))(torch.randn(3), 0.1)


def test_auto_with_in_axes_that_cannot_apply_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNAFLOW_CACHE_DIR", str(tmp_path))
    fast = df.jit(lambda w, x: x @ w, strategy="auto", in_axes=(None, 5), progress=False)
    with pytest.raises(df.TransformError, match=r"axis 5"):
        fast(torch.randn(4, 4), torch.randn(8, 4))


def test_an_auto_decision_is_keyed_by_the_candidates_it_chose_among():
    from dynaflow_fn.jitting import autotune

    fn = lambda x: x * 2                                              # noqa: E731
    device = torch.device("cpu")
    assert autotune.decision_key(fn, "sig", device, 1, ["none", "branches"]) != \
        autotune.decision_key(fn, "sig", device, 1, ["none", "branches", "microbatch2-tbo"])


# --- errors while tracing ----------------------------------------------------------------------------------


def _mismatched(x, w):
    h = x * 2
    return h @ w


def test_a_shape_error_inside_the_function_names_the_users_line():
    with pytest.raises(df.TraceError) as caught:
        df.jit(_mismatched)(torch.randn(4, 8), torch.randn(7, 3))
    message = str(caught.value)
    assert "test_guarantees.py" in message and "return h @ w" in message and "aten.mm" in message
    assert "cannot be multiplied" in message and len(message.splitlines()) == 1
    assert caught.value.__cause__ is None and caught.value.original is not None


def test_numpy_inside_the_function_is_a_trace_error_with_the_way_out():
    with pytest.raises(df.TraceError, match=r"x\.numpy\(\).*fake tensors"):
        df.jit(lambda x: torch.from_numpy(x.numpy()))(torch.randn(3))


def test_the_functions_own_exceptions_pass_unchanged():
    def refuses(x):
        raise ValueError("not for this input")

    with pytest.raises(ValueError, match="not for this input"):
        df.jit(refuses)(torch.randn(3))


def test_sparse_inputs_are_refused_by_name():
    with pytest.raises(df.InputError, match=r"x is a sparse_coo tensor"):
        df.jit(lambda x: x * 2)(torch.randn(3, 3).to_sparse())


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_nested_inputs_are_refused_by_name(layout):
    """A strided nested tensor has no single shape: keying the call on it raised torch's internal error."""
    nested = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], layout=layout)
    with pytest.raises(df.InputError, match=r"x is a nested tensor; plans work on dense tensors of one shape"):
        df.jit(lambda x: x * 2)(nested)


# --- fake kernels stricter than real ones ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_moe_models_with_float32_experts_trace_and_match_eager(name):
    model = tiny_moe(name)
    fn, params = df.pure(model)
    fast = df.jit(lambda p, ids: fn(p, ids, use_cache=False).logits)
    for _ in range(2):
        ids = torch.randint(0, 128, (2, 8))
        with torch.no_grad():
            torch.testing.assert_close(fast(params, ids), model(ids, use_cache=False).logits, rtol=0, atol=0)


def test_an_op_rejected_by_both_kernels_names_the_op_and_the_line():
    def grouped(x, w, offsets):
        return F.grouped_mm(x, w, offs=offsets)

    x, w = torch.randn(16, 8), torch.randn(2, 8, 5)                  # strides of 20 bytes: rejected for real
    offsets = torch.tensor([8, 16], dtype=torch.int32)
    with pytest.raises(df.TraceError, match=r"aten\._grouped_mm.*return F\.grouped_mm.*eager PyTorch rejects"):
        df.jit(grouped)(x, w, offsets)


def test_microbatched_closures_split_only_the_arguments():
    w = torch.randn(8, 8)
    step = df.jit(T.microbatch(lambda x: x @ (w * 2), num=2, in_axes=0))
    x = torch.randn(6, 8)
    torch.testing.assert_close(step(x), x @ (w * 2))
    w.mul_(2)
    torch.testing.assert_close(step(x), x @ (w * 2))


# --- the caller's program, at random ----------------------------------------------------------------------

from hypothesis import HealthCheck, given, settings                  # noqa: E402
from hypothesis import strategies as st                              # noqa: E402

from models import Block                                              # noqa: E402


class StatefulBlock(nn.Module):
    """A transformer block with a batch norm (train mode reads batch statistics and updates running
    buffers) and a registered buffer it scales by: mode switches, buffers and parameters all matter."""

    def __init__(self):
        super().__init__()
        self.block = Block(dim=16, heads=2, hidden=32)
        self.bn = nn.BatchNorm1d(16)
        self.register_buffer("scale", torch.rand(16) + 0.5)

    def forward(self, x):
        h = self.block(x)
        return self.bn(h.transpose(1, 2)).transpose(1, 2) * self.scale


ACTIONS = st.lists(st.sampled_from(["call", "call", "call", "update_parameter", "update_buffer",
                                    "update_closed_over", "train", "eval"]), min_size=3, max_size=12)


@pytest.mark.slow
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions=ACTIONS, seed=st.integers(0, 2**16))
def test_random_sequences_of_calls_and_updates_match_eager(actions, seed):
    torch.manual_seed(seed)
    jitted_model, eager_model = StatefulBlock().eval(), StatefulBlock().eval()
    eager_model.load_state_dict(jitted_model.state_dict())
    offset = torch.randn(16)
    offsets = {"jitted": offset, "eager": offset.clone()}            # a tensor the functions close over
    fn, params = df.pure(jitted_model)
    by_argument = df.jit(lambda p, x: fn(p, x) + offsets["jitted"])
    closed_over = df.jit(lambda x: fn(params, x) - offsets["jitted"])

    def eager(x, sign):
        return eager_model(x) + sign * offsets["eager"]

    with torch.no_grad():
        for action in actions:
            if action == "call":
                x = torch.randn(3, 5, 16)
                for call, sign in ((lambda: by_argument(params, x), 1), (lambda: closed_over(x), -1)):
                    torch.testing.assert_close(call(), eager(x, sign), rtol=0, atol=0)
                torch.testing.assert_close(jitted_model.bn.running_mean, eager_model.bn.running_mean)
            elif action == "update_parameter":
                delta = torch.randn(16)
                jitted_model.block.norm1.weight.add_(delta)
                eager_model.block.norm1.weight.add_(delta)
            elif action == "update_buffer":
                factor = torch.rand(16) + 0.5
                jitted_model.scale.mul_(factor)
                eager_model.scale.mul_(factor)
            elif action == "update_closed_over":
                delta = torch.randn(16)
                offsets["jitted"].add_(delta)
                offsets["eager"].add_(delta)
            else:
                getattr(jitted_model, action)()
                getattr(eager_model, action)()


def test_a_dropped_jitted_function_is_freed_with_its_plans():
    import gc
    import weakref

    fast = df.jit(lambda x: x * 2)
    fast(torch.randn(3))
    plan = weakref.ref(fast.plans()[0])
    jitted = weakref.ref(fast)
    del fast
    gc.collect()
    assert jitted() is None and plan() is None
