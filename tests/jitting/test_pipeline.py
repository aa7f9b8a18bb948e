"""df.jit's pipeline: one list of stages, one driver, every stage's result printable."""

import functools

import optree
import torch

import dynaflow_fn as df
from dynaflow_fn import transforms as T
from dynaflow_fn.ir.program import Program
from dynaflow_fn.plan.plan import Plan
from models import MLP


def test_the_pipeline_lists_its_stages_and_when_each_applies():
    fast = df.jit(MLP())
    text = str(fast.pipeline)
    assert "trace -> causal masks -> [inductor] -> lower -> [verify]" in text
    assert "inductor: " in text and "when the kernels are Inductor's" in text


def test_every_stage_result_is_printable_and_the_plan_is_the_one_a_call_runs():
    fn, params = df.pure(MLP())
    step = T.overlap(T.microbatch(fn, num=2, in_axes=(None, 0)), "roundrobin")
    fast = df.jit(step)
    x = torch.randn(4, 32)
    built = fast.pipeline.run(params, x)
    assert [name for name, _ in built.results] == ["trace", "causal masks", "lower", "verify"]
    assert all(isinstance(value, Program) for _, value in built.results[:2])
    assert isinstance(built.plan, Plan) and built.plan.provenance[-1] == "verify(2 streams)"
    text = str(built)
    assert "=== trace\n# Program" in text and "=== verify\n# Plan" in text
    torch.testing.assert_close(fast(params, x), fn(params, x))
    assert fast.lower(params, x).provenance == built.plan.provenance


def test_a_first_call_flattens_its_arguments_once(monkeypatch):
    fn, params = df.pure(MLP())
    fast = df.jit(fn)
    args = (params, torch.randn(4, 32))
    flattened = []
    for name in ("tree_flatten", "tree_flatten_with_path"):
        real = getattr(optree, name)

        @functools.wraps(real)
        def counting(tree, *rest, _real=real, _name=name, **options):
            if isinstance(tree, tuple) and len(tree) == 2 and tree[0][:1] == (params,):
                flattened.append(_name)
            return _real(tree, *rest, **options)
        monkeypatch.setattr(optree, name, counting)
    fast(*args)
    assert flattened == ["tree_flatten"]
