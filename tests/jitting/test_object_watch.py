"""How df.jit knows that the Python state of the modules a plan was traced from changed: what it costs per
call, what it re-checks, which entries it drops, and its fallback where torch's mutators cannot be observed."""

import gc

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


def test_a_compiled_forward_that_changes_a_watched_module_compiles_once_and_is_seen():
    """Dynamo traces nn.Module's mutators when a forward changes a module. One the forward builds
    (slicing a ModuleList) concerns no watch; an attribute set on a watched module breaks the graph
    there and moves the counter on every call. (The counter entered Dynamo's guards before, and the
    forward recompiled on every call.)"""
    from torch._dynamo.testing import CompileCounter

    model = _SlicesItsLayers()
    object_watch._watch(model)                     # as a df.jit plan traced from it would
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter)
    ticks = []
    for _ in range(4):
        compiled(torch.randn(2, 8))
        ticks.append(object_watch.changes.tick)
    assert model.calls == 4 and len(set(ticks)) == 4
    assert counter.frame_count <= 2                # the graphs around the break, compiled once


def test_a_watched_module_that_dies_leaves_the_table_to_the_next_watch():
    """Dynamo reads the table while it traces a mutator, and a weak-reference callback can run at any
    allocation: a collected module must not change the table under it (Dynamo's trace failed with
    'dictionary changed size during iteration'). The next watch removes it."""
    other, dying = nn.Linear(2, 2), nn.Linear(2, 2)
    object_watch._watch(dying)
    key, size = id(dying), len(object_watch._watched)
    del dying
    gc.collect()
    assert key in object_watch._watched and len(object_watch._watched) == size
    object_watch._watch(other)
    assert key not in object_watch._watched and id(other) in object_watch._watched
