"""How df.jit knows that the Python state of the modules a plan was traced from changed: what it costs per
call, what it re-checks, which entries it drops, and its fallback where torch's mutators cannot be observed."""

import torch
from torch import nn

import dynaflow_fn as df
from dynaflow_fn.jitting import object_watch


def _model():
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])


def _counting_fingerprints(monkeypatch):
    calls = []
    original = object_watch._fingerprint
    monkeypatch.setattr(object_watch, "_fingerprint", lambda objects, keep: calls.append(1) or original(objects, keep))
    return calls


def test_a_call_with_nothing_changed_compares_one_counter(monkeypatch):
    model = _model()
    fast = df.jit(lambda x: model(x))
    x = torch.randn(2, 8)
    with torch.no_grad():
        fast(x), fast(x)
        calls = _counting_fingerprints(monkeypatch)
        for _ in range(20):
            fast(x)
    assert calls == [] and fast.cache_info().misses == 1


def test_an_unrelated_change_fingerprints_once_and_traces_nothing(monkeypatch):
    model, other = _model(), _model()
    fast = df.jit(lambda x: model(x))
    x = torch.randn(2, 8)
    with torch.no_grad():
        fast(x)
        calls = _counting_fingerprints(monkeypatch)
        torch.nn.modules.module.register_module_forward_hook(lambda *args: None).remove()   # global: all watches
        other[0].weight = nn.Parameter(torch.randn(8, 8))                                     # not watched
        for _ in range(5):
            torch.testing.assert_close(fast(x), model(x), rtol=0, atol=0)
    assert len(calls) == 1 and fast.cache_info().misses == 1


def test_the_entry_of_a_removed_hook_is_dropped():
    model = _model()
    fast = df.jit(lambda x: model(x))
    x = torch.randn(2, 8)
    with torch.no_grad():
        fast(x)
        for _ in range(3):                                  # capture activations, then stop
            seen = []
            handle = model[1].register_forward_hook(lambda mod, args, out: seen.append(out.shape))
            fast(x)
            handle.remove()
            torch.testing.assert_close(fast(x), model(x), rtol=0, atol=0)
    assert fast.cache_info().entries == 1 and fast.cache_info().misses == 4


def test_without_observed_mutators_every_call_compares_the_state(monkeypatch):
    monkeypatch.setattr(object_watch, "_observed", False)
    model = _model()
    fast = df.jit(lambda x: model(x))
    x = torch.randn(2, 8)
    with torch.no_grad():
        fast(x)
        model[2]._forward_hooks[-1] = lambda mod, args, out: out * 2      # past every mutator
        torch.testing.assert_close(fast(x), model(x), rtol=0, atol=0)
        del model[2]._forward_hooks[-1]
        torch.testing.assert_close(fast(x), model(x), rtol=0, atol=0)
    assert fast.cache_info().misses == 2


def test_scalars_are_compared_by_value_dicts_by_their_items_and_the_rest_by_identity():
    model = nn.Linear(4, 4)
    model.scale, model.table, model.helper = 0.0, {"w": torch.randn(2)}, object()
    watch = object_watch.ObjectWatch([model])
    model.scale, model.table = float("0"), dict(model.table)        # other objects, the same state
    assert watch.unchanged()
    for change, undo in [(("scale", -0.0), ("scale", 0.0)),                 # equal by ==, not by bits
                         (("table", {"w": torch.randn(2)}), ("table", model.table)),
                         (("helper", object()), ("helper", model.helper))]:
        setattr(model, *change)
        assert not watch.unchanged()
        setattr(model, *undo)
        assert watch.unchanged()


class _SlicesItsLayers(nn.Module):
    """transformers' decoders run `for layer in self.layers[:n]`: slicing a ModuleList builds a new one."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.calls = 0

    def forward(self, x):
        self.calls = self.calls + 1
        for layer in self.layers[:2]:
            x = layer(x)
        return x


def test_torch_compile_traces_none_of_the_watch_and_sees_attribute_changes(monkeypatch):
    """Dynamo runs nn.Module's wrapped mutators symbolically when a forward builds a module. The observer
    must not run in that trace: its table changes under weak-reference callbacks at any moment (the trace
    then failed with 'dictionary changed size during iteration'). A change the compiled call makes to a
    module that outlives it breaks the graph there and is seen."""
    from dynaflow_fn.compat import modules

    seen = []
    observer = modules._module_observer[0]
    monkeypatch.setattr(modules, "_module_observer", [lambda owner, attribute: seen.append(
        (torch.compiler.is_dynamo_compiling(), attribute)) or observer(owner, attribute)])
    model = _SlicesItsLayers()
    object_watch._watch(model)                     # as a df.jit plan traced from it would
    compiled = torch.compile(model, backend="eager")
    before = object_watch.changes.tick
    compiled(torch.randn(2, 8))
    assert seen and not any(compiling for compiling, _ in seen), [entry for entry in seen if entry[0]]
    assert (False, "calls") in seen and model.calls == 1 and object_watch.changes.tick != before
