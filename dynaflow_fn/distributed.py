"""`df.distributed`: collectives inside traced programs, and the checks that keep ranks in step.

Use torch's functional collectives in model code (`all_reduce` below is one); they trace into the
Program as comm-kind nodes that schedulers put on their own stream. Planning is deterministic, so
every rank builds the same schedule from the same program; `check_consistent` proves it at run time
by comparing each rank's sequence of collectives before the first call, which turns a mismatch
(different shapes, a different order, a rank running other code) into an error naming the collective
instead of a hang.

Data parallelism: `grads = df.distributed.average(grads)` inside the jitted training step.

Tensor parallelism for the examples and benchmarks:

    w_col = df.distributed.shard(w_qkv, dim=1)          # column-parallel: each rank a slice of outputs
    w_row = df.distributed.shard(w_o, dim=0)            # row-parallel: each rank a slice of inputs
    y = df.distributed.all_reduce(x @ w_row)            # partial sums -> full result on every rank
"""

from __future__ import annotations

import ast as _ast
import datetime as _datetime
from typing import Any

import optree as _optree
import torch as _torch
import torch.distributed as _dist
from torch import Tensor

from .compat import OpOverload, default_store, functional_collectives
from .errors import DistributedError
from .ir import ops as _ops
from .plan.plan import Plan
from .transforms.communicators import comm_group, resolve_group

__all__ = [
    "CHECK_TIMEOUT_S", "DistributedError", "all_reduce", "average", "check_consistent", "collective_signature",
    "comm_group", "input_signature", "shard",
]

CHECK_TIMEOUT_S = 60.0
"""How long `check_consistent` (run by df.jit before a new plan's first call) waits for the other ranks."""


def all_reduce(tensor: Tensor, group: Any = None, op: str = "sum") -> Tensor:
    """Functional all-reduce (a new tensor; the input is unchanged) that traces into a Program."""
    return functional_collectives().all_reduce(tensor, op, resolve_group(group))


def shard(tensor: Tensor, dim: int, group: Any = None) -> Tensor:
    """This rank's contiguous slice of `tensor` along `dim` (which the world size must divide)."""
    group = resolve_group(group)
    world, rank = _dist.get_world_size(group), _dist.get_rank(group)
    if tensor.shape[dim] % world:
        raise DistributedError(f"cannot shard dimension {dim} of size {tensor.shape[dim]} over {world} ranks")
    return tensor.chunk(world, dim)[rank].contiguous()


def average(tree: Any, group: Any = None, bucket_mb: float = 25.0) -> Any:
    """The mean across ranks of every tensor in a pytree: data-parallel gradient averaging.

    Tensors are packed into buckets of about `bucket_mb` and each bucket is all-reduced once, as DDP
    does. Buckets are filled from the last leaf in insertion order (dicts as built, not sorted by key),
    which for a model's parameters in registration order is the order in which a backward pass
    produces their gradients. That order matters: the comm stream runs the buckets one after another,
    so a bucket that is ready late (sorted keys put "embed" beside "head", and "blocks.10" beside
    "blocks.1") holds back every bucket after it. Under df.jit the packing copies nothing: each
    gradient kernel writes straight into its place in the bucket. With `T.overlap`, a bucket's
    all-reduce runs on the comm stream as soon as its gradients exist, beside the rest of the
    backward pass.
    """
    group = resolve_group(group)
    world = _dist.get_world_size(group)
    nccl_averages = _dist.get_backend(group) == "nccl"      # NCCL averages in the all-reduce: no extra pass
    with _optree.dict_insertion_ordered(True, namespace=_INSERTION_ORDER):
        leaves, spec = _optree.tree_flatten(tree, namespace=_INSERTION_ORDER)
    averaged: list[Any] = list(leaves)
    for bucket in _buckets(leaves, bucket_mb * 2**20):
        flat = _torch.cat([leaves[i].reshape(-1) for i in bucket])
        flat = all_reduce(flat, group, op="avg") if nccl_averages else all_reduce(flat, group) / world
        pieces = flat.split([leaves[i].numel() for i in bucket])
        for i, piece in zip(bucket, pieces):
            averaged[i] = piece.view(leaves[i].shape)
    return _optree.tree_unflatten(spec, averaged)


_INSERTION_ORDER = "dynaflow_fn.insertion_order"    # an optree namespace in which dicts keep their order


def _buckets(leaves: list[Tensor], capacity: float) -> list[list[int]]:
    """Indices of leaves grouped into buckets of one dtype and device, filled from the last leaf."""
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0.0
    for i in reversed(range(len(leaves))):
        leaf = leaves[i]
        fits = current and (leaf.dtype, leaf.device) == (leaves[current[0]].dtype, leaves[current[0]].device)
        if current and (not fits or size + leaf.numel() * leaf.element_size() > capacity):
            buckets.append(current)
            current, size = [], 0.0
        current.append(i)
        size += leaf.numel() * leaf.element_size()
    if current:
        buckets.append(current)
    return buckets


def collective_signature(plan: Plan) -> list[tuple]:
    """The plan's collectives in issue order: op, named arguments that are not tensors (the reduce op,
    the group, split sizes, ...) and the dtype and shape (`f32[8, 32]`) of each tensor they read."""
    signature = []
    for step in plan.steps:
        if not _ops.launches_collective(step.op):
            continue
        shapes = tuple(str(plan.slots[s].layout) for s in step.reads())
        signature.append((_ops.op_info(step.op).name, _constant_arguments(step.op, step.args, step.kwargs), shapes))
    return signature


def _constant_arguments(op: OpOverload, args: tuple, kwargs: dict) -> tuple[tuple[str, Any], ...]:
    """(name, value) of each argument that holds no tensor, named as in the op's schema."""
    return tuple((name, value) for name, value in _ops.bind_arguments(op, args, kwargs).items() if _is_literal(value))


def _is_literal(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_is_literal(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def input_signature(plan: Plan) -> list[tuple[str, str]]:
    """The plan's inputs as (argument path, `f32[8, 32]` for a tensor or the repr of a static value)."""
    tensors = iter(plan.input_slots)
    return [(spec.path, str(plan.slots[next(tensors)].layout) if spec.is_tensor else repr(spec.static_value))
            for spec in plan.inputs]


def check_consistent(plan: Plan, group: Any = None, timeout: float | None = None) -> None:
    """Raise DistributedError unless every rank of `group` runs the same collectives in the same order.

    Uses the process group's store with a timeout (default `CHECK_TIMEOUT_S`), so a rank that never
    arrives is reported, not waited for forever. Every rank also publishes the input signature of the
    latest plan it checked for each function: when a rank built a plan for inputs of other shapes
    than the others (a smaller last batch on one rank of a data-parallel job retraces that rank
    alone), the timeout names the argument whose shape differs.
    """
    group = resolve_group(group)
    world = _dist.get_world_size(group)
    if world == 1:
        return
    timeout = CHECK_TIMEOUT_S if timeout is None else timeout
    store = default_store()
    rank = _dist.get_rank(group)
    inputs, mine = input_signature(plan), collective_signature(plan)
    store.set(f"{_LATEST_INPUTS}/{plan.name}/{rank}", repr(inputs))
    key = f"dynaflow/collectives/{plan.name}/{_counter(plan.name)}"
    store.set(f"{key}/{rank}", repr((inputs, mine)))
    names = [f"{key}/{r}" for r in range(world)]
    try:
        store.wait(names, _datetime.timedelta(seconds=timeout))
    except RuntimeError as error:          # the store's timeout (torch.distributed.DistStoreError is one)
        missing = [r for r, n in enumerate(names) if not store.check([n])]
        raise DistributedError(_missing_ranks(plan.name, store, rank, inputs, missing, timeout)) from error
    for other in range(world):
        their_inputs, theirs = _ast.literal_eval(store.get(names[other]).decode())
        if repr(theirs) != repr(mine):
            raise DistributedError(_difference(plan.name, rank, (inputs, mine), other, (their_inputs, theirs)))


_LATEST_INPUTS = "dynaflow/latest_inputs"     # store key prefix: per function and rank, its latest plan's inputs
_calls: dict[str, int] = {}


def _counter(name: str) -> int:
    _calls[name] = _calls.get(name, 0) + 1
    return _calls[name]


_SAME_SHAPES = ("every rank must call it with inputs of the same shapes (in data-parallel training, drop or pad "
                "the last batch, e.g. DataLoader(drop_last=True))")


def _missing_ranks(name: str, store: Any, rank: int, inputs: list[tuple[str, str]], missing: list[int],
                   timeout: float) -> str:
    """Why ranks did not arrive: other inputs than theirs (when they published theirs), else just who."""
    for other in missing:
        if not store.check([f"{_LATEST_INPUTS}/{name}/{other}"]):
            continue
        theirs = _ast.literal_eval(store.get(f"{_LATEST_INPUTS}/{name}/{other}").decode())
        differences = _input_differences(rank, inputs, other, theirs)
        if differences:
            return (f"rank(s) {missing} did not reach the first call of {name} for this rank's input shapes within "
                    f"{timeout:g} s. Rank {rank} built a new plan for inputs that differ from the ones rank {other} "
                    f"last built {name} for: {'; '.join(differences)}. A rank that gets new shapes traces a new plan "
                    f"alone, and the ranks then run different collectives; {_SAME_SHAPES}")
    return (f"rank(s) {missing} did not reach {name}'s first call within {timeout:g} s while ranks compared their "
            f"collectives; every rank must call it")


def _input_differences(rank: int, mine: list[tuple[str, str]], other: int, theirs: list[tuple[str, str]]) -> list[str]:
    """'x is f32[3, 32] on rank 0 but f32[4, 32] on rank 1', per argument path that differs."""
    mine_by_path, theirs_by_path = dict(mine), dict(theirs)
    differences = []
    for path, text in mine_by_path.items():
        if path not in theirs_by_path:
            differences.append(f"{path} is passed on rank {rank} only")
        elif theirs_by_path[path] != text:
            differences.append(f"{path} is {text} on rank {rank} but {theirs_by_path[path]} on rank {other}")
    differences += [f"{path} is passed on rank {other} only" for path in theirs_by_path if path not in mine_by_path]
    return differences


def _difference(name: str, rank: int, mine: tuple[list, list[tuple]], other: int,
                theirs: tuple[list, list[tuple]]) -> str:
    """What differs between two ranks' collectives (op, non-tensor arguments, input shapes) and inputs."""
    (my_inputs, my_collectives), (their_inputs, their_collectives) = mine, theirs
    inputs = _input_differences(rank, my_inputs, other, their_inputs)
    because = f" (their inputs differ: {'; '.join(inputs)})" if inputs else ""
    for index, (a, b) in enumerate(zip(my_collectives, their_collectives)):
        if repr(a) == repr(b):
            continue
        (op, arguments, shapes), (their_op, their_arguments, their_shapes) = a, b
        if op != their_op:
            what = f"rank {rank} runs {op} but rank {other} runs {their_op}"
        elif arguments != their_arguments:
            mine_by_name, theirs_by_name = dict(arguments), dict(their_arguments)
            what = "; ".join(f"{key} is {mine_by_name.get(key)!r} on rank {rank} but {theirs_by_name.get(key)!r} on "
                             f"rank {other}" for key in dict.fromkeys([*mine_by_name, *theirs_by_name])
                             if mine_by_name.get(key) != theirs_by_name.get(key))
        else:
            what = f"it reads {', '.join(shapes)} on rank {rank} but {', '.join(their_shapes)} on rank {other}"
        return (f"{name}: collective #{index} differs between rank {rank} and rank {other} ({op}): {what}{because}; "
                f"every rank must run the same collectives with the same arguments on the same shapes")
    return (f"{name}: rank {rank} runs {len(my_collectives)} collectives but rank {other} runs "
            f"{len(their_collectives)}{because}; every rank must run the same collectives")
