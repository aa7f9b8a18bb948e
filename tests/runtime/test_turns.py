"""runtime/turns.py: calls of one executable take turns, so threads calling at once, which share its
arena, each get exactly the result of their own inputs."""

import time

import torch

import dynaflow_fn as df
from dynaflow_fn.runtime.eager import EagerExecutable
from dynaflow_fn.runtime.turns import Turns
from fixtures import flat_tensors, plan_of, run_together
from models import MLP

THREADS = 6


def test_only_one_call_is_inside_at_a_time():
    turns = Turns(torch.device("cpu"))
    inside, most = [0], [0]

    def work(index):
        for _ in range(20):
            with turns:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
                time.sleep(0.0005)
                inside[0] -= 1

    run_together(work, THREADS)
    assert most[0] == 1 and inside[0] == 0
    assert not turns.lock.locked()


def test_a_call_that_raises_gives_up_its_turn():
    turns = Turns(torch.device("cpu"))
    try:
        with turns:
            raise KeyError("inside")
    except KeyError:
        pass
    assert turns.lock.acquire(timeout=1)
    turns.lock.release()


def test_threads_calling_one_executable_get_exactly_their_own_results():
    model = MLP((64, 256, 256, 64))
    fn, params = df.pure(model)
    plan = plan_of(fn, params, torch.randn(32, 64))
    executable = EagerExecutable(plan, torch.device("cpu"))
    inputs = [torch.randn(32, 64) for _ in range(THREADS)]
    alone = [executable(flat_tensors(params, x))[0] for x in inputs]
    wrong = []

    def work(index):
        for _ in range(5):
            got = executable(flat_tensors(params, inputs[index]))[0]
            if not torch.equal(got, alone[index]):
                wrong.append(index)

    run_together(work, THREADS)
    assert not wrong, f"wrong results in threads {sorted(set(wrong))}"
    for x, expected in zip(inputs, alone):
        torch.testing.assert_close(expected, model(x))

