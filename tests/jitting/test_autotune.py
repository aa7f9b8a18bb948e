import dataclasses
import json
import weakref

import pytest
import torch

import dynaflow_fn as df
from dynaflow_fn.errors import TransformError, VerificationError
from dynaflow_fn.ir.tree import Flat
from dynaflow_fn.jitting import autotune, pipeline
from models import MLP


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNAFLOW_CACHE_DIR", str(tmp_path))


def _fixed_timings(times):
    """Stands in for measuring: builds and runs every candidate as usual, then reports `times`."""
    def measure(names, build, progress=True, skipped=None):
        for name in names:
            build(name)()
        return dict(times)
    return measure


def test_auto_picks_a_candidate_and_matches_eager():
    fn, params = df.pure(MLP())
    fast = df.jit(fn, strategy="auto", in_axes=(None, 0), progress=False)
    x = torch.randn(8, 32)
    torch.testing.assert_close(fast(params, x), fn(params, x))
    (choice,) = fast.choices.values()
    first = {name: ms for name, ms in choice.median_ms.items() if not name.endswith(" (rematch)")}
    rematch = {name.removesuffix(" (rematch)"): ms for name, ms in choice.median_ms.items()
               if name.endswith(" (rematch)")}
    assert set(first) == {"none", "branches", "microbatch2-roundrobin", "microbatch2-tbo",
                          "microbatch4-roundrobin", "microbatch4-tbo"}
    assert choice.strategy == autotune.choose(rematch or first) and choice.skipped == {}     # a first-round winner other than none is rematched


@pytest.mark.parametrize("best, expected", [(9.9, "none"), (5.0, "microbatch2-tbo")])
def test_auto_never_picks_a_strategy_that_does_not_beat_no_overlap(monkeypatch, best, expected):
    times = {"none": 10.0, "branches": 12.0, "microbatch2-roundrobin": 11.0, "microbatch2-tbo": best,
             "microbatch4-roundrobin": 13.0, "microbatch4-tbo": 14.0}
    monkeypatch.setattr(autotune, "measure", _fixed_timings(times))
    fn, params = df.pure(MLP())
    fast = df.jit(fn, strategy="auto", in_axes=(None, 0), progress=False)
    x = torch.randn(8, 32)
    torch.testing.assert_close(fast(params, x), fn(params, x))
    (choice,) = fast.choices.values()
    assert choice.strategy == expected


@pytest.mark.parametrize("rematch, expected", [(10.5, "none"), (8.0, "microbatch2-tbo")])
def test_the_winner_is_kept_only_if_it_wins_a_rematch_with_no_overlap(monkeypatch, rematch, expected):
    rounds = iter([{"none": 10.0, "branches": 12.0, "microbatch2-roundrobin": 11.0, "microbatch2-tbo": 5.0,
                    "microbatch4-roundrobin": 13.0, "microbatch4-tbo": 14.0},
                   {"none": 10.0, "microbatch2-tbo": rematch}])
    measured = []

    def measure(names, build, progress=True, skipped=None):
        measured.append(list(names))
        for name in names:
            build(name)()
        return next(rounds)

    monkeypatch.setattr(autotune, "measure", measure)
    fn, params = df.pure(MLP())
    fast = df.jit(fn, strategy="auto", in_axes=(None, 0), progress=False)
    x = torch.randn(8, 32)
    torch.testing.assert_close(fast(params, x), fn(params, x))
    (choice,) = fast.choices.values()
    assert choice.strategy == expected and measured[1] == ["none", "microbatch2-tbo"]


def test_decisions_are_stored_and_reused_without_measuring(monkeypatch):
    fn, params = df.pure(MLP())
    x = torch.randn(8, 32)
    first = df.jit(fn, strategy="auto", in_axes=(None, 0), progress=False)
    first(params, x)
    (choice,) = first.choices.values()
    with open(autotune.cache_path()) as f:
        stored = json.load(f)
    assert [entry["choice"] for entry in stored.values()] == [choice.strategy]

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(autotune, "measure", no_measuring)
    second = df.jit(fn, strategy="auto", in_axes=(None, 0), progress=False)
    torch.testing.assert_close(second(params, x), fn(params, x))
    assert list(second.choices.values()) == [autotune.Choice(choice.strategy, {}, {})]


def test_auto_leaves_donated_arguments_to_the_real_call():
    def step(state, x):
        return {"w": state["w"] + x.sum()}, state["w"].mean()

    state = {"w": torch.zeros(4)}
    x = torch.ones(3)
    fast = df.jit(step, strategy="auto", donate_argnums=(0,), progress=False)
    new_state, _ = fast(state, x)
    assert new_state["w"].tolist() == [3.0] * 4 and new_state["w"] is state["w"]


def test_candidates_alternate_with_no_overlap_two_at_a_time_and_failures_are_skipped():
    """The reference drifts from 2 ms to 4 ms between candidates a and b, which run 1.5x and 1.25x
    its time: rescaled, their times compare as the ratios do."""
    calls, alive, most_alive = [], set(), []
    def out_of_memory():
        yield 1.0
        raise torch.OutOfMemoryError("CUDA out of memory")

    samples = {"none": iter([2.0] * 3 + [3.0] + [4.0] * 3), "a": iter([3.0] * 3), "b": iter([5.0] * 3),
               "fails in round 2": out_of_memory()}

    def build(name):
        if name == "broken":
            raise TransformError("cannot build")
        alive.add(name)
        most_alive.append(len(alive))
        def timer():
            calls.append(name)
            return next(samples[name])

        weakref.finalize(timer, alive.discard, name)
        return timer

    names = ["none", "a", "broken", "fails in round 2", "b"]
    skipped = {}
    timings = autotune.measure(names, build, progress=False, rounds=3, skipped=skipped)
    assert timings == {"none": 3.0, "a": 4.5, "b": 3.75}
    assert skipped == {"broken": "TransformError: cannot build", "fails in round 2": "OutOfMemoryError: CUDA out of memory"}
    assert calls == ["a", "none"] * 3 + ["fails in round 2", "none", "fails in round 2"] + ["b", "none"] * 3
    assert max(most_alive) == 2


def _verification_fails_on_several_streams(monkeypatch):
    def verify(plan, context):
        raise VerificationError(f"plan {plan.name} is not safe to run on {len(plan.streams)} streams: (planted)")

    stages = tuple(dataclasses.replace(stage, run=verify) if stage.name == "verify" else stage
                   for stage in pipeline.STAGES)
    monkeypatch.setattr(pipeline, "STAGES", stages)


def test_a_candidate_that_breaks_an_invariant_fails_the_test_suite(monkeypatch):
    _verification_fails_on_several_streams(monkeypatch)
    fn, params = df.pure(MLP())
    fast = df.jit(fn, strategy="auto", in_axes=(None, 0), progress=False)
    with pytest.raises(VerificationError, match="planted"):
        fast(params, torch.randn(8, 32))


def test_for_users_a_broken_candidate_is_skipped_with_one_warning_that_calls_it_a_bug(monkeypatch):
    monkeypatch.setenv("DYNAFLOW_STRICT", "0")
    _verification_fails_on_several_streams(monkeypatch)
    fn, params = df.pure(MLP())
    fast = df.jit(fn, strategy="auto", in_axes=(None, 0), progress=False)
    x = torch.randn(3, 32)                                    # too few rows for 4 micro-batches
    with pytest.warns(UserWarning) as caught:
        torch.testing.assert_close(fast(params, x), fn(params, x))
    messages = [str(w.message) for w in caught if "strategy='auto'" in str(w.message)]
    assert len(messages) == 1 and "skipped 4 of 6 candidates for MLP(x: f32[3, 32])" in messages[0]
    (choice,) = fast.choices.values()
    assert choice.strategy in ("none", "branches")            # branches keeps an MLP on one stream
    assert set(choice.skipped) == {"microbatch2-roundrobin", "microbatch2-tbo", "microbatch4-roundrobin",
                                   "microbatch4-tbo"}
    assert "a bug in dynaflow_fn" in choice.skipped["microbatch2-tbo"]
    assert choice.skipped["microbatch4-tbo"].startswith("TransformError: microbatch(num=4) needs at least 4 rows")


def test_an_error_auto_does_not_document_is_raised(monkeypatch):
    def build(name):
        if name == "a":
            raise RuntimeError("an error of the caller's own code")
        return lambda: 1.0

    with pytest.raises(RuntimeError, match="caller's own code"):
        autotune.measure(["none", "a"], build, progress=False)


def test_strategy_must_be_none_or_auto():
    with pytest.raises(df.InputError, match=r"T.overlap\(fn, strategy='tbo'\)"):
        df.jit(lambda x: x, strategy="tbo")
    with pytest.raises(df.InputError, match="in_axes tells strategy='auto'"):
        df.jit(lambda x: x, in_axes=0)


def _two_attentions(q, k, v, q2, k2, v2):
    with df.region("prefill"):
        a = torch.softmax(q @ k.transpose(-1, -2), -1) @ v
    with df.region("decode"):
        b = torch.softmax(q2 @ k2.transpose(-1, -2), -1) @ v2
    return a, b


def test_the_branches_candidate_puts_independent_regions_on_streams_of_their_own(monkeypatch):
    monkeypatch.setattr(autotune, "measure", _fixed_timings({"none": 10.0, "branches": 5.0}))
    fast = df.jit(_two_attentions, strategy="auto", progress=False)
    args = [torch.randn(2, 8, 4) for _ in range(6)]
    outputs = fast(*args)
    for got, expected in zip(outputs, _two_attentions(*args)):
        torch.testing.assert_close(got, expected)
    (choice,) = fast.choices.values()
    assert choice.strategy == "branches" and len(df.verify(fast.lower(*args)).streams) == 2
    assert autotune.region_names(df.trace(_two_attentions, *args)) == ["prefill", "decode"]
    in_one_microbatch = autotune.check_in_axes(_two_attentions, (0,) * 6, Flat.of(tuple(args), {}))
    assert autotune.region_names(in_one_microbatch) == ["prefill", "decode"]
