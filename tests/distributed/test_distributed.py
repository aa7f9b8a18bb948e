"""Collectives on two CPU processes (gloo): same plan on every rank, results equal the one-process model,
and mismatches end in an error, never a hang (every test runs under a deadline)."""

import contextlib
import os
import socket
import sys
import threading
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import dynaflow_fn as df
from dynaflow_fn import transforms as T
from example_loader import load_example

DEADLINE_S = 300
"""A hang is caught, not a slow machine: every rank compiles Inductor kernels of its own, which took 140 s
with the test suite running beside it on 15 processes."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, task, queue, finished):
    """Run `task` on one rank and report it. The rank leaves only when every rank is done (`finished`,
    a barrier of the processes): one that closed its connections early, having nothing to do, made gloo
    fail the setup of a slower rank with "Connection closed by peer"."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        import datetime

        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
        queue.put((rank, True, task(rank, world)))
    except Exception:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        with contextlib.suppress(threading.BrokenBarrierError):
            finished.wait(timeout=DEADLINE_S)
        if dist.is_initialized():
            dist.destroy_process_group()


def queue_empty():
    import queue

    return queue.Empty


def _spawn(task, world=2):
    context = mp.get_context("spawn")
    queue = context.Queue()
    port, finished = _free_port(), context.Barrier(world)
    processes = [context.Process(target=_worker, args=(rank, world, port, task, queue, finished))
                 for rank in range(world)]
    for p in processes:
        p.start()
    results = {}
    try:
        for _ in range(world):
            rank, ok, payload = queue.get(timeout=DEADLINE_S)
            results[rank] = (ok, payload)
    except queue_empty():
        pytest.fail(f"workers did not finish within {DEADLINE_S} s")
    finally:
        for p in processes:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    return [results[r] for r in range(world)]


def _payloads(task, world=2):
    """What `task` returned on each rank, after checking that no rank raised."""
    results = _spawn(task, world)
    assert all(ok for ok, _ in results), [payload for ok, payload in results if not ok]
    return [payload for _, payload in results]


def _distributed_error(call) -> str:
    """The message of the DistributedError that call() raises on this rank, or "no error"."""
    try:
        call()
    except df.distributed.DistributedError as error:
        return str(error)
    return "no error"


def _weights():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(16, 64, generator=generator), torch.randn(64, 16, generator=generator)


def _sharded_example():
    """(x, w1, w2): the same input on every rank, and this rank's column and row shards of the weights."""
    w1, w2 = _weights()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    return x, df.distributed.shard(w1, dim=1), df.distributed.shard(w2, dim=0)


def _one_process_result():
    """What the tensor-parallel MLP computes on `_sharded_example()`, on one process with the whole weights."""
    w1, w2 = _weights()
    return F.gelu(torch.randn(8, 16, generator=torch.Generator().manual_seed(1)) @ w1) @ w2


def _tensor_parallel_mlp(x, w1, w2):
    """Column-parallel first layer, row-parallel second, one all-reduce of the partial sums."""
    return df.distributed.all_reduce(F.gelu(x @ w1) @ w2)


def _plan_fingerprint(plan):
    return [(s.stream, str(s.op), s.node, s.waits, s.records) for s in plan.steps]


def _same_plan_and_result(rank, world):
    x, w1, w2 = _sharded_example()
    step = T.overlap(T.microbatch(_tensor_parallel_mlp, num=2, in_axes=(0, None, None)), strategy="roundrobin")
    fast = df.jit(step)
    out = fast(x, w1, w2)
    plan = df.verify(fast.lower(x, w1, w2))
    return _plan_fingerprint(plan), out.numpy(), [str(s) for s in plan.streams]


@pytest.mark.slow
def test_every_rank_builds_the_same_plan_and_matches_one_process():
    (fingerprint0, out0, streams), (fingerprint1, out1, _) = _payloads(_same_plan_and_result)
    assert fingerprint0 == fingerprint1
    assert any("comm" in s for s in streams)
    expected = _one_process_result()
    torch.testing.assert_close(torch.from_numpy(out0), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.from_numpy(out1), expected, rtol=1e-5, atol=1e-5)


def _on_a_dedicated_communicator(rank, world):
    x, w1, w2 = _sharded_example()
    step = T.overlap(T.microbatch(_tensor_parallel_mlp, num=2, in_axes=(0, None, None)), "roundrobin", comm_ctas=4)
    fast = df.jit(step)
    out = fast(x, w1, w2)
    plan = df.verify(fast.lower(x, w1, w2))
    groups = {s.args[-1] for s in plan.steps if "all_reduce" in str(s.op)}       # (tensor, op, group_name)
    return (groups, dist.group.WORLD.group_name, df.distributed.comm_group(4).group_name, out.numpy(),
            _carveouts_match_concurrency(plan))


def _carveouts_match_concurrency(plan):
    """Whether exactly the kernels unordered with some collective leave SMs to it: (ok, how many do)."""
    from dynaflow_fn.ir import ops
    from dynaflow_fn.plan.ordering import Clocks

    clocks = Clocks(plan.steps, len(plan.streams))
    collectives = [s.index for s in plan.steps if ops.launches_collective(s.op)]
    ok = True
    for step in plan.steps:
        beside = step.kind.name in ("KERNEL", "ALLOC") and step.index not in collectives and any(
            not clocks.before(step.index, c) and not clocks.before(c, step.index) for c in collectives)
        ok &= (step.sm_carveout == 4) if beside else step.sm_carveout is None
    return ok, sum(1 for s in plan.steps if s.sm_carveout)


@pytest.mark.slow
def test_comm_ctas_moves_collectives_to_a_dedicated_communicator_and_leaves_them_sms():
    expected = _one_process_result()
    for groups, world_name, dedicated_name, out, (carveouts_ok, marked) in _payloads(_on_a_dedicated_communicator):
        assert groups == {dedicated_name} and dedicated_name != world_name
        assert carveouts_ok and marked > 0
        torch.testing.assert_close(torch.from_numpy(out), expected, rtol=1e-5, atol=1e-5)


def _inductor_around_collectives(rank, world):
    x, w1, w2 = _sharded_example()
    step = T.overlap(T.microbatch(_tensor_parallel_mlp, num=2, in_axes=(0, None, None)), strategy="roundrobin")
    fast = df.jit(step, backend="inductor", progress=False)
    out = fast(x, w1, w2)
    plan = df.verify(fast.lower(x, w1, w2))
    kinds = [type(s.op).__name__ if type(s.op).__name__ == "CompiledRun" else str(s.op) for s in plan.steps]
    return kinds, out.numpy()


@pytest.mark.slow
def test_inductor_compiles_around_collectives_on_every_rank():
    (kinds0, out0), (kinds1, out1) = _payloads(_inductor_around_collectives)
    expected = _one_process_result()
    assert kinds0 == kinds1
    assert kinds0.count("_c10d_functional.all_reduce_.default") == 2 and "CompiledRun" in kinds0
    for out in (out0, out1):
        torch.testing.assert_close(torch.from_numpy(out), expected, rtol=1e-4, atol=1e-4)


def _every_collective(rank, world):
    import torch.distributed._functional_collectives as funcol
    from dynaflow_fn.ir.program import info

    all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor

    def fn(x):
        gathered = all_gather(x * 2, 0, dist.group.WORLD)
        exchanged = funcol.all_to_all_single(x + 1, None, None, dist.group.WORLD)
        scattered = reduce_scatter(gathered, "sum", 0, dist.group.WORLD)
        return gathered, exchanged, scattered

    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(rank))
    step = T.overlap(fn, strategy="roundrobin")
    program = df.trace(step, x)
    comm = next(s.index for s in program.streams if "comm" in s.name)
    placed = {n.target.__name__.split(".")[0]: (info(n).kind, info(n).stream) for n in program.ops()
              if "c10d" in str(n.target) and "wait" not in str(n.target)}
    fast = df.jit(step)
    out = fast(x)
    df.verify(fast.lower(x))
    return placed, comm, [o.numpy() for o in out], [e.numpy() for e in fn(x)]


@pytest.mark.slow
def test_every_functional_collective_runs_on_the_comm_stream_and_equals_eager():
    for placed, comm, outs, expected in _payloads(_every_collective):
        assert set(placed) == {"all_gather_into_tensor", "all_to_all_single", "reduce_scatter_tensor"}
        assert all(kind == "comm" and stream == comm for kind, stream in placed.values())
        for out, reference in zip(outs, expected):
            torch.testing.assert_close(torch.from_numpy(out), torch.from_numpy(reference))


def _mismatched_shapes(rank, world):
    _, w1, w2 = _sharded_example()
    return _distributed_error(lambda: df.jit(_tensor_parallel_mlp)(torch.randn(4 + 2 * rank, 16), w1, w2))


@pytest.mark.slow
def test_mismatched_collective_shapes_are_an_error_naming_the_collective():
    messages = _payloads(_mismatched_shapes)
    assert all("collective #0 differs" in m and "_c10d_functional.all_reduce" in m for m in messages), messages


def _different_reduce_ops(rank, world):
    op = "sum" if rank == 0 else "avg"
    return _distributed_error(lambda: df.jit(lambda x: df.distributed.all_reduce(x * 2, op=op))(torch.randn(4, 16)))


@pytest.mark.slow
def test_collectives_that_differ_in_a_non_tensor_argument_show_the_argument():
    on_rank_0, on_rank_1 = _payloads(_different_reduce_ops)
    assert "reduce_op is 'sum' on rank 0 but 'avg' on rank 1" in on_rank_0, on_rank_0
    assert "reduce_op is 'avg' on rank 1 but 'sum' on rank 0" in on_rank_1, on_rank_1


def _smaller_last_batch_on_rank_0(rank, world):
    df.distributed.CHECK_TIMEOUT_S = 3
    fn, params, optimizer, state = _mlp_training()

    def train_step(params, state, x, y):
        loss, grads = df.value_and_grad(lambda p: F.mse_loss(fn(p, x), y))(params)
        params, state = optimizer.update(df.distributed.average(grads), state, params)
        return params, state, loss

    step = df.jit(train_step, donate_argnums=(0, 1))

    def two_steps():
        for rows in (4, 3 if rank == 0 else 4):
            step(params, state, torch.randn(rows, 32), torch.randn(rows, 16))
    return _distributed_error(two_steps)


@pytest.mark.slow
def test_a_rank_that_retraces_alone_is_told_which_argument_differs():
    results = _spawn(_smaller_last_batch_on_rank_0)
    ok, message = results[0]
    assert ok, message
    assert "x is f32[3, 32] on rank 0 but f32[4, 32] on rank 1" in message, message
    assert "y is f32[3, 16] on rank 0 but f32[4, 16] on rank 1" in message, message
    assert "drop or pad the last batch" in message, message
    # rank 1 replayed its plan and waited in the collective until rank 0 gave up: it fails, it does not hang
    assert results[1][0] is False


def _one_rank_missing(rank, world):
    if rank == 1:
        return "skipped"
    _, w1, w2 = _sharded_example()
    plan = df.jit(_tensor_parallel_mlp).lower(torch.randn(4, 16), w1, w2)
    return _distributed_error(lambda: df.distributed.check_consistent(plan, timeout=3))


@pytest.mark.slow
def test_a_rank_that_does_not_join_is_reported_not_waited_for():
    results = _spawn(_one_rank_missing)
    assert results[1] == (True, "skipped")
    ok, message = results[0]
    assert ok and "rank(s) [1] did not reach" in message, message


def test_collectives_need_an_initialized_process_group():
    with pytest.raises(df.distributed.DistributedError, match="init_process_group"):
        df.distributed.all_reduce(torch.ones(2))


def _mlp_training():
    """The same initial MLP, AdamW and state on every rank and in the one-process reference."""
    from models import MLP

    torch.manual_seed(0)
    fn, params = df.pure(MLP())
    params = {k: v.detach().clone() for k, v in params.items()}
    optimizer = df.optim.adamw(lr=1e-2)
    return fn, params, optimizer, optimizer.init(params)


def _data_parallel_steps(rank, world):
    fn, params, optimizer, state = _mlp_training()

    def train_step(params, state, x, y):
        loss, grads = df.value_and_grad(lambda p: F.mse_loss(fn(p, x), y))(params)
        grads = df.distributed.average(grads, bucket_mb=0.01)
        params, state = optimizer.update(grads, state, params)
        return params, state, df.distributed.average(loss)

    step = df.jit(T.overlap(train_step, strategy="roundrobin"), donate_argnums=(0, 1))
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        x, y = torch.randn(8, 32, generator=generator), torch.randn(8, 16, generator=generator)
        rows = slice(4 * rank, 4 * rank + 4)
        params, state, loss = step(params, state, x[rows], y[rows])
        losses.append(loss.item())
    plan = df.verify(step.lower(params, state, x[rows], y[rows]))
    buckets = sum(1 for s in plan.steps if "all_reduce" in str(s.op) and "wait" not in str(s.op))
    comm_streams = {s.stream for s in plan.steps if "all_reduce" in str(s.op)}
    return {k: v.numpy() for k, v in params.items()}, losses, buckets, sorted(comm_streams)


@pytest.mark.slow
def test_data_parallel_step_equals_the_full_batch_step():
    (params0, losses0, buckets, comm_streams), (params1, losses1, _, _) = _payloads(_data_parallel_steps)
    assert buckets > 2 and comm_streams != [0]
    fn, params, optimizer, state = _mlp_training()
    generator = torch.Generator().manual_seed(1)
    expected_losses = []
    for _ in range(3):
        x, y = torch.randn(8, 32, generator=generator), torch.randn(8, 16, generator=generator)
        loss, grads = df.value_and_grad(lambda p: F.mse_loss(fn(p, x), y))(params)
        params, state = optimizer.update(grads, state, params)
        expected_losses.append(loss.item())
    assert losses0 == pytest.approx(expected_losses, rel=1e-5) and losses1 == losses0
    for k in params:
        torch.testing.assert_close(torch.from_numpy(params0[k]), params[k])
        torch.testing.assert_close(torch.from_numpy(params1[k]), params[k])


def _bucket_sizes(rank, world):
    tree = {f"layers.{i}": torch.ones(i + 1) for i in range(12)}      # sorted keys would put 10 after 1
    program = df.trace(lambda t: df.distributed.average(t, bucket_mb=1e-6), tree)
    return [n.args[0].meta["val"].numel() for n in program.ops() if "all_reduce" in str(n.target)]


@pytest.mark.slow
def test_average_fills_buckets_in_the_order_a_backward_pass_produces_gradients():
    sizes, = _payloads(_bucket_sizes, world=1)
    assert sizes == list(range(12, 0, -1))      # last inserted first, not last in sorted key order


def _tp_example(rank, world):
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        error = load_example("tp_llama").run(hidden=128, heads=8, ffn=256, layers=2, batch=4, length=16)
    return error, printed.getvalue()


@pytest.mark.slow
def test_tensor_parallel_example_matches_one_device():
    results = _payloads(_tp_example)
    assert all(error < 1e-5 for error, _ in results), results
    printed = results[0][1]
    assert "plan verified race-free" in printed and "<Plan" not in printed, printed


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU (gloo) path")
def test_tensor_parallel_example_says_comm_ctas_applies_only_on_nccl(monkeypatch, capsys):
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", ["tp_llama.py", "--hidden", "64", "--layers", "1", "--comm-ctas", "8"])
    try:
        load_example("tp_llama").main()
    finally:
        if dist.is_initialized():            # main() failed before its own teardown
            dist.destroy_process_group()
    printed = capsys.readouterr().out
    assert "--comm-ctas 8 is ignored" in printed and "applies only on NCCL" in printed and "uses gloo" in printed
    assert "plan verified race-free" in printed


def _auto_on_two_ranks(rank, world):
    import tempfile

    from dynaflow_fn.jitting import autotune

    os.environ["DYNAFLOW_CACHE_DIR"] = tempfile.mkdtemp()
    preferred = "microbatch2-roundrobin" if rank == 0 else "microbatch2-tbo"

    def measure(names, time_candidate, progress=True, skipped=None):
        for name in names:
            time_candidate(name)
        return {name: (1.0 if name == preferred else 10.0) for name in names}

    autotune.measure = measure
    x, w1, w2 = _sharded_example()
    fast = df.jit(_tensor_parallel_mlp, strategy="auto", in_axes=(0, None, None), progress=False)
    out = fast(x, w1, w2)
    (choice,) = fast.choices.values()
    return choice.strategy, out.numpy()


@pytest.mark.slow
def test_auto_follows_rank_0_on_every_rank():
    (choice0, out0), (choice1, out1) = _payloads(_auto_on_two_ranks)
    assert choice0 == choice1 == "microbatch2-roundrobin"
    torch.testing.assert_close(torch.from_numpy(out1), _one_process_result(), rtol=1e-5, atol=1e-5)
