"""backend="inductor" and df.compile_backend, against eager PyTorch on the CPU (Inductor's C++ kernels)."""

import pytest
import torch

import dynaflow_fn as df
from dynaflow_fn.passes import inductor
from dynaflow_fn import transforms as T
from fixtures import training_step
from models import MLP, Block, llama_logits, tiny_llama


def _compiled_steps(plan):
    return [step for step in plan.steps if isinstance(step.op, inductor.CompiledRun)]


def _aten_ops(plan):
    return {step.op.overloadpacket.__name__ for step in plan.steps if isinstance(step.op, torch._ops.OpOverload)}


@pytest.mark.parametrize("overlap", [False, True], ids=["whole", "microbatch2-roundrobin"])
def test_inductor_matches_eager_for_an_mlp(overlap):
    fn, params = df.pure(MLP())
    step = T.overlap(T.microbatch(fn, num=2, in_axes=(None, 0)), "roundrobin") if overlap else fn
    fast = df.jit(step, backend="inductor", progress=False)
    for _ in range(2):
        x = torch.randn(8, 32)
        torch.testing.assert_close(fast(params, x), fn(params, x), rtol=1e-4, atol=1e-5)
    plan = fast.lower(params, x)
    df.verify(plan)
    assert len(_compiled_steps(plan)) == (3 if overlap else 1)   # each micro-batch, and the merge
    assert "mm" not in _aten_ops(plan) and "addmm" not in _aten_ops(plan)
    jit_steps = [line.split("(")[0].split(":")[0] for line in plan.provenance
                 if line.startswith(("causal", "inductor", "lower", "verify"))]
    assert jit_steps == ["inductor", "lower"] + (["verify"] if overlap else [])   # the steps that changed something
    assert f"inductor({len(_compiled_steps(plan))} runs)" in plan.provenance


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True], ids=["whole", "microbatch2-tbo"])
def test_inductor_matches_eager_for_a_tiny_hf_llama(overlap):
    model = tiny_llama()
    logits, params = llama_logits(model)
    step = T.overlap(T.microbatch(logits, num=2, in_axes=(None, 0)), "tbo") if overlap else logits
    fast = df.jit(step, backend="inductor", progress=False)
    ids = torch.randint(0, 128, (2, 12))
    torch.testing.assert_close(fast(params, ids), model(ids, use_cache=False).logits, rtol=1e-4, atol=1e-4)
    plan = fast.lower(params, ids)
    df.verify(plan)
    assert _compiled_steps(plan)


def test_identical_runs_compile_once(monkeypatch):
    compiled_graphs = []
    real = inductor.compile_with_inductor
    monkeypatch.setattr(inductor, "compile_with_inductor",
                        lambda gm, inputs: compiled_graphs.append(gm.code) or real(gm, inputs))
    fn, params = df.pure(MLP())
    step = T.overlap(T.microbatch(fn, num=4, in_axes=(None, 0)), "roundrobin")
    plan = df.jit(step, backend="inductor", progress=False).lower(params, torch.randn(8, 32))
    assert len(_compiled_steps(plan)) == 5                          # four micro-batches and the merge
    assert len(compiled_graphs) == 2 == len(set(compiled_graphs))   # one micro-batch body, one merge


def test_stages_tagged_no_inductor_stay_aten():
    fn, params = df.pure(Block())
    step = T.overlap(T.partition(fn, rules=[T.Region("attn", tags={inductor.NO_INDUCTOR})]), "sequential")
    fast = df.jit(step, backend="inductor", progress=False)
    x = torch.randn(2, 8, 32)
    torch.testing.assert_close(fast(params, x), fn(params, x), rtol=1e-4, atol=1e-5)
    plan = fast.lower(params, x)
    attention_ops = {name for name in _aten_ops(plan) if "scaled_dot_product" in name}
    assert attention_ops, "the attention stage should keep its aten kernels"
    assert "gelu" not in _aten_ops(plan)                            # the MLP stage was compiled
    assert _compiled_steps(plan)


def test_a_run_inductor_rejects_falls_back_to_aten_with_a_warning(monkeypatch):
    real = inductor.compile_with_inductor

    def reject_tanh(gm, inputs):
        if any(node.target is torch.ops.aten.tanh.default for node in gm.graph.nodes):
            raise RuntimeError("no lowering for tanh")
        return real(gm, inputs)

    monkeypatch.setattr(inductor, "compile_with_inductor", reject_tanh)

    def fn(x, y):
        with df.region("left"):
            left = torch.relu(x @ x.T)
        with df.region("right"):
            right = torch.tanh(y * 2).sum(-1, keepdim=True)
        return left + right

    step = T.overlap(T.partition(fn, rules=[T.Region("left"), T.Region("right")]), "branches")
    fast = df.jit(step, backend="inductor", progress=False)
    x, y = torch.randn(6, 4), torch.randn(6, 5)
    with pytest.warns(UserWarning, match=r"Inductor could not compile stage \d+ .*tanh.*no lowering for tanh"):
        out = fast(x, y)
    torch.testing.assert_close(out, fn(x, y))
    plan = fast.lower(x, y)
    df.verify(plan)
    assert "tanh" in _aten_ops(plan) and _compiled_steps(plan)


def test_a_run_compiles_the_reshapes_of_inputs_only_it_reads():
    """Attention over a cache passed in, written as matmul, softmax and matmul: the transpose of the keys
    and the reshapes torch.matmul adds are views of the inputs. The run that reads them compiles them
    too, so Inductor sees the whole pattern (torch.compile's view of it: it fuses it into one attention
    kernel), and the plan keeps no view steps of its own for them."""

    def attention(q, k_cache, v_cache):
        scores = torch.matmul(q, k_cache.transpose(-1, -2)) * 0.125
        return torch.matmul(torch.softmax(scores, -1), v_cache)

    fast = df.jit(attention, backend="inductor", progress=False)
    q, k, v = torch.randn(4, 2, 3, 16), torch.randn(4, 2, 40, 16), torch.randn(4, 2, 40, 16)
    torch.testing.assert_close(fast(q, k, v), attention(q, k, v), rtol=1e-4, atol=1e-5)
    plan = fast.lower(q, k, v)
    [run] = _compiled_steps(plan)
    assert torch.ops.aten.transpose.int in {node.target for node in run.op.graph_module.graph.nodes}
    assert plan.steps == (run,)


def test_setup_work_between_two_ops_leaves_them_in_one_run():
    """A mask or position table made from no input is computed once, at setup; issued between two ops
    of a stage, it is one more outside value of their run, not a break in it (a break costs the fusion
    of the ops on either side, the attention mask with the scores it masks, say)."""

    def masked_scores(q, k):
        scores = q @ k.transpose(-1, -2)
        causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        return torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)

    fast = df.jit(masked_scores, backend="inductor", progress=False)
    q, k = torch.randn(2, 6, 8), torch.randn(2, 6, 8)
    torch.testing.assert_close(fast(q, k), masked_scores(q, k), rtol=1e-4, atol=1e-5)
    plan = fast.lower(q, k)
    df.verify(plan)
    assert plan.setup and len(_compiled_steps(plan)) == 1
    assert not _aten_ops(plan)


@pytest.mark.parametrize("strategy", ["sequential", "roundrobin"])
def test_a_compiled_run_never_returns_memory_it_reads(strategy):
    """A stage that starts by viewing a value an earlier stage made (a rotary table, read by every
    layer) must leave that view outside its compiled run: a run returning it would be a step that
    writes memory other steps, on other streams, read."""

    def fn(x, w):
        table = torch.sin(x)                       # its own stage, like a rotary table
        view = table.unsqueeze(0)                  # the next stage starts by viewing it
        hidden = torch.cos(view) @ w
        gate = torch.tanh(hidden)                  # another stage
        return (gate + view @ w).sum(0)            # a later stage reads the view again

    step = T.partition(fn, rules=[T.Op("sin"), T.Op("tanh")])
    if strategy != "sequential":
        step = T.microbatch(step, num=2, in_axes=(0, None))
    fast = df.jit(T.overlap(step, strategy), backend="inductor", progress=False)
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    torch.testing.assert_close(fast(x, w), fn(x, w), rtol=1e-4, atol=1e-5)
    plan = df.verify(fast.lower(x, w))
    for step in _compiled_steps(plan):
        read = {plan.slots[slot].storage for slot in step.reads()}
        assert not read & {plan.slots[slot].storage for slot in step.outputs}, step


def test_train_step_keeps_the_optimizer_update_in_place_on_donated_state():
    fn, params = df.pure(MLP())
    params = {k: v.detach().clone() for k, v in params.items()}
    optimizer = df.optim.adamw(lr=1e-2)
    train_step = training_step(lambda p, x, y: ((fn(p, x) - y) ** 2).mean(), optimizer)
    reference_params = {k: v.clone() for k, v in params.items()}
    reference_state = optimizer.init(reference_params)
    state = optimizer.init(params)
    compiled = df.jit(train_step, backend="inductor", donate_argnums=(0, 1), progress=False)
    reference = df.jit(train_step, donate_argnums=(0, 1))
    for _ in range(3):
        x, y = torch.randn(8, 32), torch.randn(8, 16)
        new_params, state, loss = compiled(params, state, x, y)
        reference_params, reference_state, reference_loss = reference(reference_params, reference_state, x, y)
        assert new_params["layers.0.weight"] is params["layers.0.weight"]         # updated in place
        torch.testing.assert_close(loss, reference_loss, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(params, reference_params, rtol=1e-4, atol=1e-5)
    plan = compiled.lower(params, state, x, y)
    assert not [step for step in plan.steps if step.kind.name == "COPY"]
    assert "_fused_adamw_.default" in {getattr(step.op, "__name__", "") for step in plan.steps}
    assert _compiled_steps(plan)


class FlagModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 16)

    def forward(self, x, gated: bool):
        h = self.up(x)
        h = h * torch.sigmoid(h) if gated else torch.relu(h)   # Python branch on a non-tensor flag
        return self.down(h) + x


@pytest.mark.parametrize("backend", ["auto", "inductor"])
def test_compile_backend_follows_python_branches_on_a_flag(backend):
    model = FlagModel().eval()
    compile_backend = df.compile_backend(backend=backend, progress=False)
    compiled = torch.compile(model, backend=compile_backend, dynamic=False)
    with torch.no_grad():
        for gated in (True, False, True):
            x = torch.randn(4, 16)
            torch.testing.assert_close(compiled(x, gated), model(x, gated), rtol=1e-4, atol=1e-5)
    assert len(compile_backend.graphs) == 2                              # one captured graph per branch
    assert [g.cache_info().misses for g in compile_backend.graphs] == [1, 1]


def test_compile_backend_reads_the_models_state_in_place_and_copies_the_arguments():
    model = FlagModel().eval()
    model.register_buffer("offset", torch.randn(16))
    model.forward = lambda x, gated: FlagModel.forward(model, x, gated) + model.offset
    compile_backend = df.compile_backend(progress=False)
    compiled = torch.compile(model, backend=compile_backend, dynamic=False)
    with torch.no_grad():
        x = torch.randn(4, 16)
        torch.testing.assert_close(compiled(x, True), model(x, True), rtol=1e-4, atol=1e-5)
    (jitted,) = compile_backend.graphs
    inputs = [n.name for n in jitted.fn.__self__.graph.nodes if n.op == "placeholder"]
    persistent = [inputs[i] for i in jitted.options.persistent_argnums]
    assert len(inputs) == 6 and len(persistent) == 5                    # 4 parameters and the buffer, not x
    assert all("parameters" in name or "buffers" in name for name in persistent)


def test_compile_backend_auto_micro_batches_the_arguments_and_shares_the_parameters(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNAFLOW_CACHE_DIR", str(tmp_path))        # measure, do not recall an earlier choice
    model = FlagModel().eval()
    compile_backend = df.compile_backend(strategy="auto", in_axes="arguments", progress=False)
    compiled = torch.compile(model, backend=compile_backend, dynamic=False)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(8, 16)
            torch.testing.assert_close(compiled(x, True), model(x, True), rtol=1e-4, atol=1e-5)
    (choice,) = compile_backend.graphs[0].choices.values()
    assert {"none", "microbatch2-roundrobin", "microbatch4-tbo"} <= set(choice.median_ms)
    assert choice.strategy in choice.median_ms


def test_compile_backend_applies_transforms_to_each_captured_graph():
    model = tiny_llama()
    compile_backend = df.compile_backend(transforms=T.overlap(strategy="branches"), progress=False)
    compiled = torch.compile(model, backend=compile_backend, dynamic=False)
    ids = torch.randint(0, 128, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids, use_cache=False).logits, model(ids, use_cache=False).logits)
    provenance = [plan.provenance for jitted in compile_backend.graphs for plan in jitted.plans()]
    assert provenance and all(any(p.startswith("overlap(branches") for p in passes) for passes in provenance)
