"""lowering/reinplace.py: an op runs inplace on an argument only when nothing later reads that
argument's old value (nor a view of it), it is not returned, and an input is donated or the op is an
update its write-back copies into it (a KV cache); plans that do so compute what eager PyTorch computes."""

import operator

import optree
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dynaflow_fn as df
from dynaflow_fn.ir import ops
from dynaflow_fn.ir.analyses import is_write_back, written_back_updates
from dynaflow_fn.ir.ops import inplace_variant
from dynaflow_fn.passes import inductor
from dynaflow_fn.plan.plan import StepKind
from dynaflow_fn import transforms as T
from fixtures import EachNode, RandomScheduler, build, example_inputs, recipes, scheduled


def _readers(node):
    """The nodes that read `node`'s memory: its users, seen through views of it."""
    found = []
    for user in node.users:
        if ops.is_view(user.target) or (user.target is operator.getitem and ops.is_view(node.target)):
            found += _readers(user)
        found.append(user)
    return found


def _inplace_steps(plan):
    return [step for step in plan.steps if step.kind is StepKind.KERNEL and step.note == "reinplaced"]


def _assert_old_values_are_dead(program, plan, donated=()):
    """Every argument an inplace step overwrites is read by no step after it, is not returned and,
    if it is an input, is a donated one or one the step's result is written back into."""
    position = {step.node: step.index for step in plan.steps if step.node}
    for step in plan.steps:                     # an Inductor run's ops keep their names in its graph
        if isinstance(step.op, inductor.CompiledRun):
            position.update(dict.fromkeys((n.name for n in step.op.graph_module.graph.nodes), step.index))
    nodes = {node.name: node for node in program.graph.nodes}
    donated_names = {program.placeholders()[i].name for i in donated}
    updates = written_back_updates(program)
    for step in _inplace_steps(plan):
        node = nodes[step.node]
        written = optree.tree_leaves(node.args[:1])
        for argument in written:
            assert argument.op != "get_attr"
            if argument.op == "placeholder":
                assert argument.name in donated_names or updates.get(node) is argument, (step.node, argument.name)
            for reader in _readers(argument):
                assert reader.op != "output", (step.node, argument.name)
                if reader is node or ops.is_view(reader.target) or reader.target is operator.getitem:
                    continue
                if is_write_back(reader) and reader.args[0] is argument:
                    continue                        # writes the argument whole, reads none of it
                assert position[reader.name] < step.index, (step.node, argument.name, reader.name)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recipe=recipes(), seed=st.integers(0, 2**16), streams=st.integers(1, 3))
def test_inplace_steps_overwrite_only_dead_values_and_plans_equal_eager(recipe, seed, streams):
    inputs, fn = build(recipe)
    step = scheduled(fn, RandomScheduler(seed, streams), inputs)
    args = example_inputs(inputs)
    program = df.trace(step, *args)
    plan = df.verify(df.lower(program))
    _assert_old_values_are_dead(program, plan)
    fresh = example_inputs(inputs)
    for got, expected in zip(df.jit(step, backend="eager")(*fresh), fn(*fresh)):
        torch.testing.assert_close(got, expected, equal_nan=True)


def test_a_donated_update_chain_runs_inplace_and_copies_nothing():
    def update(p, g):
        return p * 0.9 - g * 0.1

    p, g = torch.randn(16), torch.randn(16)
    fast = df.jit(update, donate_argnums=(0,))
    plan = fast.lower(p, g)
    assert len(_inplace_steps(plan)) == 2 and not plan.copy_steps()
    assert plan.written_inputs() == [0]
    _assert_old_values_are_dead(fast.trace(p, g), plan, donated=(0,))
    expected = update(p.clone(), g)
    out = fast(p, g)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(p, expected)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(order=st.permutations(range(3)), scales=st.lists(st.sampled_from([0.5, 2.0, 3.0]), min_size=3, max_size=3),
       donated=st.sets(st.integers(0, 2), min_size=1), extra=st.booleans())
def test_donated_outputs_of_the_same_layout_in_any_order_equal_eager(order, scales, donated, extra):
    """Outputs of the donated inputs' layout, returned in another order than the inputs (swapped, one
    more of them): each donated input receives one of them, and every result is still eager's."""
    def step(a, b, c):
        inputs = (a, b, c)
        outs = [inputs[i] * scale for i, scale in zip(order, scales)]
        return (*outs, a + b) if extra else tuple(outs)

    args = [torch.randn(5) for _ in range(3)]
    fast = df.jit(step, donate_argnums=tuple(sorted(donated)), backend="eager")
    df.verify(fast.lower(*args))
    expected = step(*[a.clone() for a in args])
    torch.testing.assert_close(fast(*args), expected)


def test_a_train_step_returning_its_state_before_its_parameters_equals_eager():
    optimizer = df.optim.sgd(lr=0.1, momentum=0.9)

    def loss_fn(params, x):
        return (x @ params["w"]).square().mean()

    def train_step(params, state, x):
        loss, grads = df.value_and_grad(loss_fn)(params, x)
        params, state = optimizer.update(grads, state, params)
        return state, params, loss                                # the state first

    w, x = torch.randn(8, 8), torch.randn(4, 8)
    fast = df.jit(train_step, donate_argnums=(0, 1))
    eager_params, params = {"w": w.clone()}, {"w": w.clone()}
    eager_state, state = optimizer.init(eager_params), optimizer.init(params)
    for _ in range(2):                                            # the second step takes the first's results
        eager_state, eager_params, eager_loss = train_step(eager_params, eager_state, x)
        state, params, loss = fast(params, state, x)
        torch.testing.assert_close((state, params, loss), (eager_state, eager_params, eager_loss))


def test_an_argument_read_later_is_not_overwritten():
    def update(ps, g):
        return [x.mul(0.9).sub(g) for x in ps], ps[0].sum()

    ps, g = [torch.randn(8), torch.randn(8)], torch.randn(8)
    fast = df.jit(update, donate_argnums=(0,))
    program, plan = fast.trace(ps, g), fast.lower(ps, g)
    _assert_old_values_are_dead(program, plan, donated=(0, 1))
    overwritten = {program.placeholders()[0].name: False, program.placeholders()[1].name: False}
    nodes = {node.name: node for node in program.graph.nodes}
    for step in _inplace_steps(plan):
        for argument in optree.tree_leaves(nodes[step.node].args[:1]):
            if argument.name in overwritten:
                overwritten[argument.name] = True
    assert list(overwritten.values()) == [False, True]
    expected = update([x.clone() for x in ps], g)
    got = fast(ps, g)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("update", [
    lambda p, g: (p * 0.9 - g * 0.1).exp().relu(),
    lambda p, g: ((p.clamp(-1, 1).relu_() @ g).exp(), g.T),    # an inplace op on an intermediate; an input's view
], ids=["chain", "inplace-op-and-a-view"])
def test_dead_intermediates_are_reinplaced_and_inputs_not_donated_never_overwritten(update):
    p, g = torch.randn(4, 4), torch.randn(4, 4)
    before = p.clone(), g.clone()
    fast = df.jit(update)
    plan = fast.lower(p, g)
    reinplaced = [step for step in plan.steps if step.note == "reinplaced"]
    assert reinplaced and all(step.kind is StepKind.KERNEL for step in reinplaced)
    assert plan.written_inputs() == []
    _assert_old_values_are_dead(fast.trace(p, g), plan)
    torch.testing.assert_close(fast(p, g), update(*(t.clone() for t in before)))
    assert torch.equal(p, before[0]) and torch.equal(g, before[1])


@pytest.mark.parametrize("backend", ["eager", "inductor"])
@pytest.mark.parametrize("accumulate", [
    lambda x, index: torch.zeros(3, 4).index_add(0, index, x),
    lambda x, index: torch.zeros(3, 4).scatter_add(0, index[:, None].expand(-1, 4), x),
    lambda x, index: torch.zeros(3, 4).index_put((index,), x, accumulate=True),
    lambda x, index: torch.arange(12.0).view(3, 4).index_copy(0, index[:3], x[:3]),
], ids=["index_add", "scatter_add", "index_put-accumulate", "index_copy"])
def test_a_tensor_made_from_constants_is_set_up_once_and_never_written_by_a_call(accumulate, backend):
    """Work that reads no input is computed once, when the plan is bound, and read by every call: an
    update of it run in place would start each call from the last call's result."""
    fast = df.jit(accumulate, backend=backend, progress=False)
    for _ in range(3):
        x, index = torch.randn(6, 4), torch.randperm(6) % 3
        torch.testing.assert_close(fast(x, index), accumulate(x, index))


def _cache_step(cache, slots, new, w):
    """A decode step's KV-cache use: this step's rows written first, then the cache read."""
    cache[slots] = torch.tanh(new @ w)
    return cache[slots].sum(-1) * 2, cache.sum(0)


def _cache_inputs():
    return torch.randn(9, 16), torch.tensor([5, 1, 7]), torch.randn(3, 16), torch.randn(16, 16)


def _check_cache_step(fn, backend, **options):
    """df.jit(fn) on fresh inputs against eager, the caller's cache updated alike; returns the plan."""
    cache, slots, new, w = _cache_inputs()
    fast = df.jit(fn, backend=backend, progress=False, **options)
    expected_cache = cache.clone()
    expected = fn(expected_cache, slots, new, w)
    got = fast(cache, slots, new, w)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache, expected_cache, rtol=1e-5, atol=1e-5)
    plan = df.verify(fast.lower(cache, slots, new, w))
    _assert_old_values_are_dead(fast.trace(cache, slots, new, w), plan)
    return plan


def _cache_updates_in_place(plan):
    """The steps that update input 0 (the cache) where it lives: an aten `index_put_`, or an Inductor run
    whose write-back joined it (it writes the input's slot)."""
    cache = plan.input_slots[0]
    return [step for step in plan.steps if (step in _inplace_steps(plan) and step.op is torch.ops.aten.index_put_.default)
            or (isinstance(step.op, inductor.CompiledRun) and cache in step.writes())]


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_cache_update_runs_inplace_and_its_write_back_copies_nothing(backend):
    """`cache[slots] = x` is traced as `index_put(cache, ...)` and a write-back `copy_(cache, ...)`: as
    traced, a call would copy the whole cache twice. The update runs inplace instead, on the cache
    itself: an aten step, or under Inductor a compiled run that holds the write-back, fused with the
    ops that make the rows and read the cache, and no step copies the cache back."""
    plan = _check_cache_step(_cache_step, backend)
    [update] = _cache_updates_in_place(plan)
    assert isinstance(update.op, inductor.CompiledRun) == (backend == "inductor")
    if backend == "inductor":
        assert plan.steps == (update,)              # the matmul, tanh, update and both reads: one run
    assert plan.written_inputs() == [0]
    assert not [step for step in plan.copy_steps() if step.outputs == (plan.input_slots[0],)]


def _cache_and_its_view(cache, slots, new, w):
    before = cache[0] * 2                       # the old row, through a view made outside the run
    cache[slots] = new @ w
    return before.sum(), cache[slots]


def test_a_run_that_reads_a_view_of_the_cache_it_updates_leaves_the_update_aten():
    """A compiled run that updated the cache would read the view as an input of its own, which Inductor
    cannot know aliases the cache, and might read it after the update: the update stays an aten step,
    and the plan computes eager's values (`_check_cache_step`)."""
    plan = _check_cache_step(_cache_and_its_view, "inductor")
    [update] = _cache_updates_in_place(plan) or [None]
    assert update is None or not isinstance(update.op, inductor.CompiledRun)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
@pytest.mark.parametrize("strategy", ["roundrobin", "tbo"])
def test_micro_batches_updating_one_cache_equal_eager(strategy, backend):
    """Each micro-batch writes its rows of the shared cache and reads them back, on two streams. Under
    Inductor the chain of updates spans both micro-batches' runs, so no run takes the write-back."""
    fn = T.overlap(T.microbatch(_cache_step, num=2, in_axes=(None, 0, 0, None), out_axes=(0, None)),
                   strategy=strategy)
    with pytest.warns(UserWarning, match="updates cache in place"), \
            pytest.warns(UserWarning, match=r"out\[1\] reads the batch rows, but out_axes None keeps the first"):
        plan = _check_cache_step(fn, backend)      # out[0] exact: each micro-batch its own rows; out[1] is not
    assert len(plan.streams) == 2 and plan.written_inputs() == [0]
    assert not [step for step in plan.steps if isinstance(step.op, inductor.CompiledRun) and step.op.updated_arguments]


def _read_old_and_new(cache, slots, new, w):
    old_total = cache.sum(0)                    # the old value, read wherever the schedule puts it
    cache[slots] = new @ w
    return old_total, cache[slots] * 2


@pytest.mark.parametrize("backend", ["eager", "inductor"])
@pytest.mark.parametrize("seed", range(12))
def test_a_cache_whose_old_value_is_read_later_is_not_updated_inplace_before_that(seed, backend):
    """Random issue orders on two streams: the old value's sum comes before the update in some and after
    it in others (seeds 7, 9, 11). Either way the plan computes eager's values, and it updates the cache
    inplace exactly when the sum is issued first (under Inductor, each op is a run of its own: the
    update's run takes its write-back only then)."""
    fn = T.overlap(T.partition(_read_old_and_new, rules=[EachNode()]), strategy=RandomScheduler(seed, 2))
    plan = _check_cache_step(fn, backend)
    program = df.jit(fn, backend=backend, progress=False).trace(*_cache_inputs())
    order = [node.target for node in program.issue_order()]
    summed_first = order.index(torch.ops.aten.sum.dim_IntList) < order.index(torch.ops.aten.index_put.default)
    assert bool(_cache_updates_in_place(plan)) == summed_first
    assert bool(plan.copy_steps()) == (not summed_first)


def test_inplace_variants_mirror_the_functional_schema():
    aten = torch.ops.aten
    assert inplace_variant(aten.add.Tensor) is aten.add_.Tensor
    assert inplace_variant(aten.mul.Scalar) is aten.mul_.Scalar
    assert inplace_variant(aten._foreach_mul.List) is aten._foreach_mul_.List
    assert inplace_variant(aten.add_.Tensor) is None
    assert inplace_variant(aten.mm.default) is None
    assert inplace_variant(len) is None
