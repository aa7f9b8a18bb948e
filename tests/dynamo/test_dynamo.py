"""`df.compile_backend` behind the clients users already run: transformers' generate() with a static
KV cache, torch.compile's default dynamic shapes, and training loops (backward, optimizer steps)."""

import copy
import gc
import inspect
import importlib
import warnings
import weakref

import pytest
import torch

import dynaflow_fn as df
from dynaflow_fn.errors import InputError
from dynaflow_fn.passes.inductor import CompiledRun
from dynaflow_fn.jitting.replayer import Replayer
from models import MLP, Block, ConvNet, tiny_causal_lm, tiny_llama


def _static_cache_llama():
    model = tiny_llama(layers=2)
    model.generation_config.cache_implementation = "static"
    model.generation_config.pad_token_id = 0
    return model


def _generate(model, ids, steps, **kwargs):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)         # transformers 5 renames past_key_values to cache
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                              disable_compile=True, **kwargs)


class ResidentAddresses:
    """Per graph (its replayer), per call: the addresses of the inputs its CUDA graph reads in place
    (`Binding.resident`), tagged with the generate() call they come from. On the CPU nothing is captured,
    but a resident input at a new address is a capture on CUDA."""

    def __init__(self, monkeypatch):
        self.generation = 0
        self.calls: dict[int, list[tuple[int, dict[str, int]]]] = {}
        self.state: dict[int, set[str]] = {}          # resident inputs that are no parameters (KV caches)
        real_run = Replayer.run

        def recording_run(replayer, tensors, *args, **kwargs):
            binding = replayer.binding
            resident = binding.resident(tensors, replayer.copied_anyway)
            self.calls.setdefault(id(replayer), []).append(
                (self.generation, {binding.names[i]: t.data_ptr() for i, t in enumerate(tensors) if resident[i]}))
            self.state[id(replayer)] = {binding.names[i] for i, t in enumerate(tensors)
                                        if resident[i] and not isinstance(t, torch.nn.Parameter)}
            return real_run(replayer, tensors, *args, **kwargs)
        monkeypatch.setattr(Replayer, "run", recording_run)

    def moved(self, generation=None):
        """Per graph, the calls (of that generate() call, or all) whose resident inputs are not the first's."""
        moved = {}
        for graph, calls in self.calls.items():
            addresses = [a for g, a in calls if generation is None or g == generation]
            moved[graph] = [k for k, a in enumerate(addresses) if a != addresses[0]]
        return moved


def test_generate_with_a_static_cache_gives_eagers_tokens_and_traces_each_graph_once(monkeypatch):
    model = _static_cache_llama()
    ids = torch.randint(0, 128, (2, 7))
    expected = _generate(model, ids, 8)
    backend = df.compile_backend(progress=False)
    model.forward = torch.compile(model.forward, backend=backend, dynamic=False)
    recorded = ResidentAddresses(monkeypatch)
    for generation in (1, 2):
        recorded.generation = generation
        assert torch.equal(_generate(model, ids, 8), expected)
    assert backend.graphs and [g.cache_info().misses for g in backend.graphs] == [1] * len(backend.graphs)
    # What is read in place is the same tensor at every decoding step: a move per step would be a capture
    # per step. (generate() makes a new StaticCache on each call in transformers 5, so across calls the KV
    # cache does move: see the next test for the cache that does not.)
    for generation in (1, 2):
        assert all(not calls for calls in recorded.moved(generation).values())
    decode = max(recorded.calls, key=lambda graph: len(recorded.calls[graph]))
    assert len(recorded.calls[decode]) >= 14
    assert len(recorded.state[decode]) >= 4            # the KV cache of both layers is among them


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_generate_updates_the_static_cache_inplace_with_no_write_back_copies(backend):
    """transformers' StaticCache writes each step's keys and values with `index_copy_`. The decode graph's
    plan runs those updates on the cache itself: a write-back copy would copy the whole cache per step.
    Under Inductor each update is fused into a compiled run, which writes the cache tensor."""
    model = _static_cache_llama()
    ids = torch.randint(0, 128, (2, 7))
    expected = _generate(model, ids, 4)
    compiler = df.compile_backend(backend=backend, progress=False)
    model.forward = torch.compile(model.forward, backend=compiler, dynamic=False)
    assert torch.equal(_generate(model, ids, 4), expected)
    decode = [graph.plans()[0] for graph in compiler.graphs if graph.cache_info().hits][-1]
    if backend == "eager":
        updates = [step for step in decode.steps if step.op is torch.ops.aten.index_copy_.default]
        assert len(updates) == 4 and all(step.note == "reinplaced" for step in updates)  # keys, values x 2 layers
    else:
        written = {slot for step in decode.steps if isinstance(step.op, CompiledRun) for slot in step.writes()}
        assert {decode.input_slots[i] for i in decode.written_inputs()} <= written
    assert len(decode.written_inputs()) >= 4 and not decode.copy_steps()


def test_generate_with_a_reused_static_cache_keeps_every_resident_input_in_place(monkeypatch):
    """A StaticCache passed to generate() and reset between calls keeps its tensors (reset zeroes them in
    place), so no graph sees a resident input move over several generate() calls: each captures once."""
    from transformers import StaticCache

    if not hasattr(StaticCache, "early_initialization"):
        pytest.skip("transformers 4 reuses generate()'s own static cache; this is transformers 5's StaticCache")
    model = tiny_llama(layers=2)
    model.generation_config.pad_token_id = 0
    config = model.config
    cache = StaticCache(config=config, max_cache_len=16)
    cache.early_initialization(batch_size=2, num_heads=config.num_key_value_heads, dtype=torch.float32,
                               head_dim=config.hidden_size // config.num_attention_heads, device="cpu")
    ids = torch.randint(0, 128, (2, 7))
    cache.reset()
    expected = _generate(model, ids, 8, past_key_values=cache)
    backend = df.compile_backend(progress=False)
    model.forward = torch.compile(model.forward, backend=backend, dynamic=False)
    recorded = ResidentAddresses(monkeypatch)
    for generation in range(3):
        recorded.generation = generation
        cache.reset()
        assert torch.equal(_generate(model, ids, 8, past_key_values=cache), expected)
    assert backend.graphs and [g.cache_info().misses for g in backend.graphs] == [1] * len(backend.graphs)
    assert all(not calls for calls in recorded.moved().values())
    assert all(len(recorded.state[graph]) >= 4 for graph in recorded.calls)   # both graphs read the KV cache


@pytest.mark.cuda
def test_generate_on_cuda_captures_each_graph_once_over_32_steps():
    model = _static_cache_llama().cuda()
    ids = torch.randint(0, 128, (2, 7), device="cuda")
    expected = _generate(model, ids, 32)
    backend = df.compile_backend(progress=False)
    model.forward = torch.compile(model.forward, backend=backend, dynamic=False)
    got = _generate(model, ids, 32)
    assert (got == expected).float().mean() > 0.95                # Inductor's rounding may flip a late argmax
    assert torch.equal(got[:, :ids.shape[1] + 4], expected[:, :ids.shape[1] + 4])
    assert [g.cache_info().captures for g in backend.graphs] == [1] * len(backend.graphs)


@pytest.mark.cuda
def test_generate_through_transformers_own_compile_with_this_backend_captures_each_graph_once():
    """transformers compiles the forward itself for a static cache on CUDA, with the backend its
    CompileConfig names: deep-copied, and with its default mode="reduce-overhead"."""
    from transformers.generation import CompileConfig

    model = _static_cache_llama().cuda()
    ids = torch.randint(0, 128, (2, 7), device="cuda")
    expected = _generate(model, ids, 16)
    backend = df.compile_backend(progress=False)
    model.generation_config.compile_config = CompileConfig(backend=backend)
    with torch.no_grad():
        got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    assert torch.equal(got[:, :ids.shape[1] + 4], expected[:, :ids.shape[1] + 4])
    assert (got == expected).float().mean() > 0.95
    assert backend.graphs and [g.cache_info().captures for g in backend.graphs] == [1] * len(backend.graphs)


def test_a_copy_of_the_backend_is_the_backend_so_its_graphs_stay_visible():
    backend = df.compile_backend(progress=False)
    assert copy.deepcopy({"backend": backend})["backend"] is backend


@pytest.mark.parametrize("options, message", [
    (dict(bucket=(2, 4)), r"unexpected option 'bucket' \(did you mean 'buckets'\?\)"),
    (dict(out_axes=0), r"unexpected option 'out_axes'.*it takes strategy, transforms, backend"),
    (dict(backend="cudagraphs"), r"unknown backend 'cudagraphs'"),
    (dict(progress=False, strategy="tbo"), r"strategy=None or 'auto'"),
], ids=["misspelled", "set-per-graph", "unknown-backend", "fixed-strategy"])
def test_bad_options_are_refused_when_the_backend_is_made_not_at_the_first_compiled_call(options, message):
    with pytest.raises(InputError, match=message):
        df.compile_backend(**options)


def test_mode_reduce_overhead_is_what_df_plans_are_and_inductors_other_settings_are_refused():
    model = MLP().eval()
    x = torch.randn(4, 32)
    compiled = torch.compile(model, backend=df.compile_backend(progress=False), mode="reduce-overhead")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    torch._dynamo.reset()
    for setting in ({"mode": "max-autotune"}, {"options": {"max_autotune": True}}):
        compiled = torch.compile(model, backend=df.compile_backend(progress=False), **setting)
        with torch.no_grad(), pytest.raises(Exception, match="Inductor's"):
            compiled(x)
        torch._dynamo.reset()


pytestmark = pytest.mark.usefixtures("fresh_dynamo")       # every test starts and leaves Dynamo's caches empty


def _counting(backend):
    """The backend, counting the graphs Dynamo hands it."""
    captured = []

    def count(graph_module, example_inputs):
        captured.append(graph_module)
        return backend(graph_module, example_inputs)
    return count, captured


# --- dynamic shapes ---------------------------------------------------------------------------------------


def test_default_dynamic_shapes_plan_each_length_once_and_replay_it_after():
    model = Block().eval()
    backend = df.compile_backend(progress=False)
    compiled, captured = _counting(backend)
    compiled = torch.compile(model, backend=compiled)
    reference, reference_captured = _counting(lambda graph_module, example_inputs: graph_module.forward)
    reference = torch.compile(Block().eval(), backend=reference)
    lengths = (5, 7, 9, 7, 5, 9)
    with torch.no_grad():
        for length in lengths[:3] * 2:                                   # warm: every length seen, twice
            x = torch.randn(2, length, 32)
            torch.testing.assert_close(compiled(x), model(x))
            reference(x)
        warm = [g.cache_info() for g in backend.graphs]
        for length in lengths:
            x = torch.randn(2, length, 32)
            torch.testing.assert_close(compiled(x), model(x))
            reference(x)
    assert len(captured) == len(reference_captured) == 2                 # torch's own: static 5, then dynamic
    assert [g.cache_info().misses for g in backend.graphs] == [info.misses for info in warm] == [1] * 4
    assert sum(g.cache_info().hits for g in backend.graphs) == sum(info.hits for info in warm) + len(lengths)


def test_each_concrete_signature_gets_its_own_plan_and_the_sizes_are_bound_into_it():
    model = Block().eval()
    backend = df.compile_backend(progress=False)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for length in (3, 4):
            compiled(torch.randn(2, length, 32))
    assert len(backend.graphs) == 2
    for jitted, length in zip(backend.graphs, (3, 4)):
        (plan,) = jitted.plans()
        shapes = [plan.slots[index].layout.shape for index in plan.input_slots]
        assert [shape for shape in shapes if len(shape) == 3] == [(2, length, 32)]
        assert "l_x_" in inspect.signature(jitted.fn).parameters           # sizes bound: tensors only
        assert not any(name.startswith("s") for name in inspect.signature(jitted.fn).parameters)


def test_many_distinct_lengths_warn_with_df_jits_retrace_warning():
    compiled = torch.compile(Block().eval(), backend=df.compile_backend(progress=False), dynamic=True)
    with torch.no_grad(), pytest.warns(UserWarning, match=r"traced for 9 different input signatures \(s\w+ changed"):
        for length in range(2, 12):
            compiled(torch.randn(2, length, 32))


def test_a_float_argument_that_changes_is_bound_per_value():
    def scaled_norm(x, scale):
        return torch.nn.functional.layer_norm(x, (4,), eps=scale) * scale   # eps must be a Python float

    backend = df.compile_backend(progress=False)
    compiled = torch.compile(scaled_norm, backend=backend)
    scales = (0.5, 0.7, 0.9, 0.7, -0.0, 0.0)                            # a dynamic float from 0.7 on
    with torch.no_grad():
        for scale in scales:
            x = torch.randn(3, 4)
            torch.testing.assert_close(compiled(x, scale), scaled_norm(x, scale))
            assert torch.equal(torch.signbit(compiled(x, scale)), torch.signbit(scaled_norm(x, scale)))
    assert [g.cache_info().misses for g in backend.graphs] == [1] * 5    # one plan per distinct value


def test_a_size_from_tensor_data_is_a_trace_error_naming_the_op_and_the_line():
    def positives_sum(x):
        return x.nonzero().float().sum()

    compiled = torch.compile(positives_sum, backend=df.compile_backend(progress=False))
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True), torch.no_grad(), \
            pytest.raises(Exception, match=r"Tensor.nonzero at .*test_dynamo.py:\d+ \(`return x.nonzero") as raised:
        compiled(torch.randn(8))
    error = getattr(raised.value, "inner_exception", raised.value)           # Dynamo wraps what a backend raises
    assert isinstance(error, df.TraceError) and "capture_dynamic_output_shape_ops" in str(error)


# --- training ---------------------------------------------------------------------------------------------


def _without_dropout(model):
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model.train()


def _assert_same_gradients(model, reference, rtol=1e-4, atol=1e-5):
    for (name, parameter), expected in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(parameter.grad, expected.grad, rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_training_through_torch_compile_gives_eagers_gradients_and_steps(family):
    model = _without_dropout(tiny_causal_lm(family, layers=1))
    reference = copy.deepcopy(model)
    backend = df.compile_backend(progress=False)
    compiled = torch.compile(model, backend=backend)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference)]
    for length in (6, 9, 9):                                          # a static graph, then a dynamic one
        ids = torch.randint(0, 64, (2, length))
        loss = compiled(ids, labels=ids, use_cache=False).loss
        expected = reference(ids, labels=ids, use_cache=False).loss
        torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-5)
        loss.backward()
        expected.backward()
        _assert_same_gradients(model, reference)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    torch.testing.assert_close(dict(model.named_parameters()), dict(reference.named_parameters()))
    assert {jitted.name for jitted in backend.graphs} == {"forward", "backward"}
    assert all(jitted.cache_info().misses == 1 for jitted in backend.graphs)


def test_training_with_batch_norm_updates_its_statistics_as_eager_does():
    model = ConvNet().train()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend=df.compile_backend(progress=False))
    for _ in range(2):
        x = torch.randn(4, 3, 8, 8)
        compiled(x).square().mean().backward()
        reference(x).square().mean().backward()
    _assert_same_gradients(model, reference)
    torch.testing.assert_close(dict(model.named_buffers()), dict(reference.named_buffers()))
    assert int(model.bn.num_batches_tracked) == 2


def test_hooks_registered_after_the_first_call_are_planned_when_dynamo_guards_them():
    """torch.compile skips guards on hooks by default (for every backend); with them on, a LoRA adapter or an
    activation capture registered after the first call re-traces, and each new graph gives eager's values:
    logits, the captured activation, and the adapter's gradient."""
    if not hasattr(torch._dynamo.config, "skip_nnmodule_hook_guards"):
        pytest.skip("this torch has no skip_nnmodule_hook_guards")
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):
        _hooks_after_the_first_call_equal_eager()


def _hooks_after_the_first_call_equal_eager():
    model = tiny_llama(layers=2)
    compiled = torch.compile(model, backend=df.compile_backend(progress=False))
    ids = torch.randint(0, 128, (2, 9))
    down, up = torch.randn(64, 4) * 0.1, torch.randn(4, 64) * 0.1
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids).logits, model(ids).logits)
        adapter = model.model.layers[0].mlp.register_forward_hook(lambda m, args, out: out + args[0] @ down @ up)
        torch.testing.assert_close(compiled(ids).logits, model(ids).logits)
        down.mul_(2)                                         # the adapter's weights, updated in place
        torch.testing.assert_close(compiled(ids).logits, model(ids).logits)
        adapter.remove()
        captured = []
        model.model.layers[1].register_forward_hook(lambda m, args, out: captured.append(out))
        logits = compiled(ids).logits
        torch.testing.assert_close(logits, model(ids).logits)
        assert len(captured) == 2
        torch.testing.assert_close(captured[0], captured[1])
    lora = torch.nn.Parameter(torch.randn(64, 64) * 0.01)
    model.model.layers[0].mlp.register_forward_hook(lambda m, args, out: out + args[0] @ lora)
    compiled(ids, labels=ids).loss.backward()
    gradient, lora.grad = lora.grad, None
    model(ids, labels=ids).loss.backward()
    torch.testing.assert_close(gradient, lora.grad, rtol=1e-4, atol=1e-6)


class Views(torch.nn.Module):
    """Returns views: of an intermediate, and of the argument at an offset that depends on its size."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        return h, h[x.shape[0] // 2:, 2:], x.view(x.shape[0] * 2, 4)[x.shape[0] // 2:]


def test_training_outputs_that_are_views_are_views_of_the_right_elements():
    model = Views()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend=df.compile_backend(progress=False))
    for rows in (4, 6, 7):                                            # symbolic offsets from 6 on
        x = torch.randn(rows, 8)
        outputs, expected = compiled(x), reference(x)
        torch.testing.assert_close(outputs, expected)
        assert outputs[2].data_ptr() == x.data_ptr() + expected[2].storage_offset() * x.element_size()
        assert outputs[1].untyped_storage().data_ptr() == outputs[0].untyped_storage().data_ptr()
        (outputs[0].sum() + outputs[1].square().sum()).backward()
        (expected[0].sum() + expected[1].square().sum()).backward()
        _assert_same_gradients(model, reference)


def test_backward_takes_gradients_of_any_layout():
    model = MLP()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend=df.compile_backend(progress=False), dynamic=False)
    x = torch.randn(8, 32)
    for weight in (torch.randn(16, 8).t(), torch.randn(1, 16).expand(8, 16), torch.randn(8, 16)):
        (compiled(x) * weight).sum().backward()
        (reference(x) * weight).sum().backward()
        _assert_same_gradients(model, reference)


class CondNet(torch.nn.Module):
    """A branch on tensor data kept in the graph by torch.cond, which df.jit does not plan."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        return torch.cond(h.sum() > 0, torch.sin, torch.cos, (h,)) * 2


def test_a_training_graph_df_cannot_plan_runs_with_aten_kernels_after_a_warning():
    model = CondNet()
    reference = copy.deepcopy(model)
    backend = df.compile_backend(progress=False)
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(4, 8)
    with pytest.warns(UserWarning, match="cannot plan this (forward|backward) graph of a training step .*cond") as caught:
        compiled(x).sum().backward()
    assert sorted(str(w.message).split()[4] for w in caught) == ["backward", "forward"]
    reference(x).sum().backward()
    _assert_same_gradients(model, reference)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                               # warned once: aten from then on
        compiled(x).sum().backward()
    assert [jitted.cache_info().entries for jitted in backend.graphs] == [0, 0]


def test_checkpointed_dropout_runs_with_aten_kernels_after_a_warning_naming_the_operator():
    """Activation checkpointing replays a region's random numbers through higher-order operators
    (`run_and_save_rng_state` in the forward, `run_with_rng_state` in the backward), which df's tracer
    does not run: both graphs fall back to aten kernels, each with a warning that names its operator
    (not torch's internal "no rule registered" text), and the gradient is the step's own mask's."""
    weight = torch.nn.Parameter(torch.randn(8))
    region = lambda x: torch.nn.functional.dropout(x * weight, 0.5, training=True)           # noqa: E731
    compiled = torch.compile(lambda x: torch.utils.checkpoint.checkpoint(region, x, use_reentrant=False),
                             backend=df.compile_backend(progress=False))
    x = torch.randn(16, 8)
    with pytest.warns(UserWarning, match="cannot plan this") as caught:
        y = compiled(x)
        y.sum().backward()
    texts = sorted(str(w.message) for w in caught if "cannot plan" in str(w.message))
    assert len(texts) == 2
    assert "backward graph" in texts[0] and "calls run_with_rng_state" in texts[0]
    assert "forward graph" in texts[1] and "calls run_and_save_rng_state" in texts[1]
    assert not any("object at 0x" in text for text in texts)
    torch.testing.assert_close(weight.grad, (x * (y != 0) * 2).sum(0))


def test_under_no_grad_the_captured_graph_is_planned_as_it_is():
    model = MLP()
    backend = df.compile_backend(progress=False)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    with torch.no_grad():
        x = torch.randn(4, 32)
        torch.testing.assert_close(compiled(x), model(x))
    (jitted,) = backend.graphs
    inputs = [node.name for node in jitted.fn.__self__.graph.nodes if node.op == "placeholder"]
    assert "l_x_" in inputs and not any(name.startswith("primals") for name in inputs)   # Dynamo's, not AOTAutograd's


@pytest.mark.parametrize("buckets", [None, (4, 8)])
def test_inference_outputs_that_are_views_are_views_of_the_real_tensors(buckets):
    model = Views()
    backend = df.compile_backend(progress=False, buckets=buckets)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for rows in (4, 6, 7, 3):                                     # symbolic sizes from 6 on; 3 pads to 4
            x = torch.randn(rows, 8)
            outputs, expected = compiled(x), model(x)
            torch.testing.assert_close(outputs, expected)
            assert outputs[2]._base is x                               # a view of the caller's tensor itself
            assert outputs[2].data_ptr() == x.data_ptr() + expected[2].storage_offset() * x.element_size()
            assert outputs[1]._base is outputs[0]._base or outputs[1]._base is outputs[0]
            outputs[2].fill_(7.0)                                      # writes through to x, as in eager
            assert torch.equal(x.view(rows * 2, 4)[rows // 2:], torch.full_like(expected[2], 7.0))


class WritesItsArgument(torch.nn.Module):
    """Writes its argument in place and returns it, views of it, and an in-place op's result."""

    def forward(self, x):
        x.mul_(2)
        y = torch.nn.functional.leaky_relu(x, 0.5, True)             # in place, named by no trailing _
        return x, y, x.view(-1, 2).t(), x.add_(1), x.detach()


def test_inference_outputs_that_are_written_arguments_are_the_arguments_written_once():
    model = WritesItsArgument()
    compiled = torch.compile(model, backend=df.compile_backend(progress=False), dynamic=False)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, 6)
            expected_x = x.clone()
            expected = model(expected_x)
            outputs = compiled(x)
            torch.testing.assert_close(x, expected_x)                  # every write applied once
            torch.testing.assert_close(outputs, expected)
            assert outputs[0] is x and outputs[1] is x and outputs[3] is x
            assert outputs[2]._base is x
            assert outputs[4] is not x and outputs[4].data_ptr() == x.data_ptr()   # detach: x's memory, not x


def test_without_aot_autograd_training_runs_dynamos_graph_with_eager_autograd(monkeypatch):
    torch._dynamo.list_backends()       # Dynamo imports its own backends, which need AOTAutograd, first
    monkeypatch.delattr(importlib.import_module("torch._dynamo.backends.common"), "aot_autograd")
    model = MLP()
    reference = copy.deepcopy(model)
    backend = df.compile_backend(progress=False)
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(4, 32)
    with pytest.warns(UserWarning, match="AOTAutograd, which this torch lacks"):
        compiled(x).sum().backward()
    reference(x).sum().backward()
    _assert_same_gradients(model, reference)
    assert backend.graphs == []


@pytest.mark.cuda
@pytest.mark.parametrize("kernels", ["cudagraph", "auto"])
def test_training_on_cuda_replays_one_cuda_graph_per_forward_and_backward(kernels):
    model = _without_dropout(tiny_llama(layers=2)).cuda()
    reference = copy.deepcopy(model)
    backend = df.compile_backend(backend=kernels, progress=False)
    compiled = torch.compile(model, backend=backend)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True) for m in (model, reference)]
    tolerance = dict(rtol=1e-4, atol=1e-5) if kernels == "cudagraph" else dict(rtol=2e-3, atol=2e-4)
    for step in range(4):
        ids = torch.randint(0, 128, (2, 16), device="cuda")
        loss = compiled(ids, labels=ids, use_cache=False).loss
        expected = reference(ids, labels=ids, use_cache=False).loss
        torch.testing.assert_close(loss, expected, **tolerance)
        loss.backward()
        expected.backward()
        _assert_same_gradients(model, reference, **tolerance)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    assert {jitted.name for jitted in backend.graphs} == {"forward", "backward"}
    captures = {jitted.name: jitted.cache_info().captures for jitted in backend.graphs}
    # The loss is held over the next forward, so two forward captures take turns. The backward reads
    # the activations each saved in place, with a capture for each, and copies in only what no graph
    # handed out: the gradients of the outputs and the step's batch.
    assert captures == {"forward": 2, "backward": 2}
    (backward,) = [jitted for jitted in backend.graphs if jitted.name == "backward"]
    (replayer,) = [replayer for replayers in backward._cache.values() for replayer in replayers]
    for executable in (replayer.executable, replayer.spare):
        copied = [replayer.binding.names[i] for i in executable.copied]
        assert copied and not [name for name in copied if name.startswith(("mm", "rsqrt", "embedding"))], copied


@pytest.mark.parametrize("buckets", [None, (4, 8)], ids=["per size", "buckets"])
def test_the_backend_keeps_no_tensor_of_the_calls_it_compiled_for_alive(buckets):
    """Dynamo's example inputs are the call's own tensors (a KV cache, say): a graph planned later, per
    size or per bucket, must not hold them once the caller lets them go."""
    class ReadsACache(torch.nn.Module):
        def forward(self, x, cache):
            return x * 2 + cache.sum()

    torch._dynamo.reset()
    compiled = torch.compile(ReadsACache(), backend=df.compile_backend(buckets=buckets, progress=False))
    caches = []
    with torch.no_grad():
        for rows in (2, 3, 5):                  # the second call makes Dynamo's graph with a symbolic batch
            cache = torch.randn(64, 64)
            caches.append(weakref.ref(cache))
            torch.testing.assert_close(compiled(torch.ones(rows, 4), cache), 2 + cache.sum().expand(rows, 4))
            del cache
    gc.collect()
    assert [ref() for ref in caches] == [None, None, None]
    torch._dynamo.reset()
