"""How you test your own strategy: a user-style test file for a Scheduler of your own.

    pytest examples/test_my_strategy.py

`check_scheduler` runs the scheduler over random programs (valid schedule, race-free plan, exact
results, the same plan twice); `assert_equivalent` checks your model under it on fresh inputs,
uneven micro-batches included. The plugin seeds every test from its name and skips GPU tests
where there is no GPU (the `cuda_device` fixture). The README's first set-up command installs what it
needs (the examples extra brings pytest and hypothesis).
"""

import torch

import dynaflow_fn as df
from dynaflow_fn import testing as dft
from dynaflow_fn import transforms as T

pytest_plugins = ["dynaflow_fn.testing.pytest_plugin"]


class LongestFirst(df.Scheduler):
    """Among the ready stages, the costliest first; micro-batch i on stream i (shared work on 0)."""

    def streams(self, graph):
        return [df.Stream(i, f"mb{i}") for i in range(max(1, len(graph.micro_batches)))]

    def pick(self, ready, graph, issued):
        stage = max(ready, key=lambda s: (s.cost.seconds, -s.index))
        return stage, graph.micro_batches.index(stage.mb) if stage.mb is not None else 0


def model():
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                               torch.nn.Linear(64, 16))


def my_strategy(fn):
    step = T.partition(T.microbatch(fn, num=2, in_axes=(None, 0)), rules=[T.Module(torch.nn.Linear)])
    return T.overlap(step, strategy=LongestFirst())


def test_the_scheduler_is_valid_exact_and_deterministic():
    dft.check_scheduler(LongestFirst, max_examples=20)


def test_the_model_under_my_strategy_equals_eager(seed):
    fn, params = df.pure(model())
    dft.assert_equivalent(fn, my_strategy(fn), params, torch.randn(8, 32), draws=4, seed=seed)


def test_on_the_gpu_one_cuda_graph_too(seed, cuda_device):
    fn, params = df.pure(model().to(cuda_device))
    dft.assert_equivalent(fn, my_strategy(fn), params, torch.randn(8, 32, device=cuda_device), seed=seed)
