import contextlib
import inspect
import io
import os
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

import dynaflow_fn as df
from dynaflow_fn.plan.plan import StepKind
from example_loader import load_example
from fixtures import plan_of, training_step
from models import MLP, llama_logits, tiny_llama


def _mlp_loss():
    model = MLP()
    fn, params = df.pure(model)

    def loss_fn(params, x, y):
        return F.mse_loss(fn(params, x), y)

    return model, loss_fn, {k: v.detach().clone() for k, v in params.items()}


def _autograd_grads(model, loss):
    model.zero_grad()
    loss.backward()
    return {name: p.grad for name, p in model.named_parameters()}


def test_gradients_equal_autograd_for_an_mlp():
    model, loss_fn, params = _mlp_loss()
    step = df.jit(df.value_and_grad(loss_fn))
    for _ in range(2):
        x, y = torch.randn(8, 32), torch.randn(8, 16)
        loss, grads = step(params, x, y)
        expected = _autograd_grads(model, F.mse_loss(model(x), y))
        torch.testing.assert_close(loss, F.mse_loss(model(x), y))
        for name in expected:
            torch.testing.assert_close(grads[name], expected[name])


def test_gradients_equal_autograd_for_hf_llama():
    model = tiny_llama()
    logits, params = llama_logits(model)
    params = {k: v.detach() for k, v in params.items()}

    def loss_fn(params, ids):
        out = logits(params, ids)
        return F.cross_entropy(out[:, :-1].reshape(-1, 128), ids[:, 1:].reshape(-1))

    ids = torch.randint(0, 128, (2, 12))
    loss, grads = df.jit(df.value_and_grad(loss_fn))(params, ids)
    reference = model(ids, use_cache=False).logits
    expected = _autograd_grads(model, F.cross_entropy(reference[:, :-1].reshape(-1, 128), ids[:, 1:].reshape(-1)))
    assert set(expected) <= set(grads)
    for name in expected:
        torch.testing.assert_close(grads[name], expected[name], rtol=1e-4, atol=1e-5)


def test_grad_and_aux():
    def loss_fn(w, x):
        y = x @ w
        return y.square().mean(), y.detach()

    w, x = torch.randn(4, 3), torch.randn(5, 4)
    grads, aux = df.jit(df.grad(loss_fn, has_aux=True))(w, x)
    torch.testing.assert_close(aux, x @ w)
    torch.testing.assert_close(grads, 2 * x.T @ (x @ w) / 15)


@pytest.mark.parametrize("name, make, reference", [
    ("adamw", lambda: df.optim.adamw(lr=1e-2, weight_decay=0.1), lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)),
    ("sgd", lambda: df.optim.sgd(lr=1e-2, momentum=0.9, weight_decay=1e-3),
     lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, weight_decay=1e-3)),
    ("nesterov", lambda: df.optim.sgd(lr=1e-2, momentum=0.9, nesterov=True),
     lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True)),
])
def test_jitted_train_step_matches_torch_optim_and_updates_in_place(name, make, reference):
    model, loss_fn, params = _mlp_loss()
    optimizer = make()
    state = optimizer.init(params)
    step = df.jit(training_step(loss_fn, optimizer), donate_argnums=(0, 1))
    torch_optimizer = reference(model.parameters())
    originals = dict(params)
    for _ in range(4):
        x, y = torch.randn(8, 32), torch.randn(8, 16)
        new_params, state, loss = step(params, state, x, y)
        expected_loss = F.mse_loss(model(x), y)
        torch_optimizer.zero_grad()
        expected_loss.backward()
        torch_optimizer.step()
        torch.testing.assert_close(loss, expected_loss)
        assert all(new_params[k] is originals[k] for k in originals)
        for k, p in model.named_parameters():
            torch.testing.assert_close(params[k], p.detach())


def test_non_floating_parameters_are_named():
    def loss_fn(params, x):
        return (x * params["scale"]).sum()

    with pytest.raises(df.InputError, match=r"params\['steps'\], a int64 tensor"):
        df.value_and_grad(loss_fn)({"scale": torch.ones(3), "steps": torch.zeros((), dtype=torch.long)}, torch.ones(3))


def test_non_scalar_loss_is_an_error():
    with pytest.raises(df.InputError, match=r"scalar loss.*shape \[3\].*\.mean\(\)"):
        df.jit(df.value_and_grad(lambda w: w * 2))(torch.randn(3))


def test_donating_an_argument_returned_unchanged_warns():
    def step(params, frozen):
        return {"w": params["w"] * 0.5}, frozen

    with pytest.warns(UserWarning, match=r"donated input frozen\['b'\] is returned unchanged"):
        df.jit(step, donate_argnums=(0, 1))({"w": torch.randn(3)}, {"b": torch.randn(3)})


def test_changing_batch_shapes_warn_after_eight():
    _, loss_fn, params = _mlp_loss()
    step = df.jit(df.value_and_grad(loss_fn))
    with pytest.warns(UserWarning, match=r"x changed from f32\[8, 32\]"):
        for batch in range(1, 10):
            step(params, torch.randn(batch, 32), torch.randn(batch, 16))


def test_out_kernels_that_use_their_output_as_scratch_are_not_used():
    plan = plan_of(lambda a, b: F.mse_loss(a, b), torch.randn(8, 16), torch.randn(8, 16))
    step = next(s for s in plan.steps if s.node == "mse_loss")
    assert step.kind is StepKind.ALLOC



@pytest.mark.slow
def test_example_learns_to_copy_and_its_bar_leaves_a_line_in_a_log():
    log = io.StringIO()
    with contextlib.redirect_stderr(log):
        losses = load_example("train_tiny_llama").train(steps=120, device="cpu", plot=None)
    assert losses[-1] < 0.1 * losses[0]
    assert log.getvalue().count("\n") <= 2, log.getvalue()   # the bar's last state, and the first call's split


def test_example_trains_the_parameters_and_leaves_the_buffers_as_they_are(monkeypatch):
    example = load_example("train_tiny_llama")
    made, make_model = [], example.make_model
    monkeypatch.setattr(example, "make_model", lambda device: made.append(make_model(device)) or made[-1])
    example.train(steps=3, device="cpu", plot=None, progress=False)
    torch.manual_seed(0)                                   # train()'s seed: the model it started from
    untrained = make_model("cpu")
    (trained,) = made
    for (name, buffer), (_, before) in zip(trained.named_buffers(), untrained.named_buffers()):
        assert torch.equal(buffer, before), f"{name} was trained"
    assert not torch.equal(trained.lm_head.weight, untrained.lm_head.weight)


def test_example_writes_its_plot_into_a_folder_git_ignores():
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    if shutil.which("git") is None or not os.path.exists(os.path.join(root, ".git")):
        pytest.skip("not a git checkout")
    default = inspect.signature(load_example("train_tiny_llama").train).parameters["plot"].default
    assert os.path.commonpath([root, default]) == root
    ignored = subprocess.run(["git", "check-ignore", "--no-index", "-q", default], cwd=root)
    assert ignored.returncode == 0, f"{default} would be left in the work tree as an untracked file"
