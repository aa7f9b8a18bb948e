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

import datetime
from typing import Any

import torch
import torch.distributed as dist

from . import ops
from .compat import default_store, functional_collectives, resolve_process_group
from .errors import DynaflowError
from .plan import Plan


class DistributedError(DynaflowError):
    """Ranks disagree about the collectives they are about to run, or a rank did not join in time."""


def _group(group: Any) -> Any:
    if not dist.is_available() or not dist.is_initialized():
        raise DistributedError("no process group is initialized: call torch.distributed.init_process_group "
                               "(torchrun sets up the environment for it) before tracing collectives")
    return group if group is not None else dist.group.WORLD


def all_reduce(tensor: torch.Tensor, group: Any = None, op: str = "sum") -> torch.Tensor:
    """Functional all-reduce (a new tensor; the input is unchanged) that traces into a Program."""
    return functional_collectives().all_reduce(tensor, op, _group(group))


def comm_group(max_ctas: int, group: Any = None) -> Any:
    """A second communicator over the ranks of `group` whose collectives use at most `max_ctas` CUDA
    thread blocks (NCCL's `max_ctas`, through ProcessGroupNCCL options).

    Why: an all-reduce on the default communicator grabs as many SMs as NCCL likes and only gets them
    when the GEMMs beside it drain, so it overlaps nothing; with a small budget it runs beside them.
    On other backends (gloo) the group is a plain copy. Every rank must ask for the same groups in the
    same order (tracing does, since every rank traces the same program); groups are made once and reused.
    """
    group = _group(group)
    if max_ctas < 1:
        raise ValueError(f"max_ctas must be at least 1, got {max_ctas}")
    ranks = tuple(dist.get_process_group_ranks(group))
    key = (ranks, max_ctas)
    if key not in _comm_groups:
        if dist.get_backend(group) == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options.config.max_ctas = max_ctas
            options.is_high_priority_stream = True
            _comm_groups[key] = dist.new_group(list(ranks), backend="nccl", pg_options=options)
        else:
            _comm_groups[key] = dist.new_group(list(ranks))
    return _comm_groups[key]


_comm_groups: dict[tuple, Any] = {}


def comm_group_name(group_name: str, max_ctas: int) -> str:
    """The name of `comm_group(max_ctas)` over the ranks of the group named `group_name`, as functional
    collectives refer to groups."""
    return comm_group(max_ctas, resolve_process_group(group_name)).group_name


def all_reduce_on_current_stream(tensor: torch.Tensor, reduce_op: str, group_name: str) -> torch.Tensor:
    """How a plan runs an in-place all-reduce (`_c10d_functional.all_reduce_`): through c10d's blocking
    call, which launches NCCL on the current stream, i.e. the plan's comm stream with its priority.
    The functional op would launch on the process group's internal stream and join back through two
    events, which a CUDA graph keeps as cross-stream edges on every collective."""
    dist.all_reduce(tensor, op=getattr(dist.ReduceOp, reduce_op.upper()), group=resolve_process_group(group_name))
    return tensor


def shard(tensor: torch.Tensor, dim: int, group: Any = None) -> torch.Tensor:
    """This rank's contiguous slice of `tensor` along `dim` (which the world size must divide)."""
    group = _group(group)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
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
    import optree

    group = _group(group)
    world = dist.get_world_size(group)
    nccl_averages = dist.get_backend(group) == "nccl"      # NCCL averages in the all-reduce: no extra pass
    with optree.dict_insertion_ordered(True, namespace=_INSERTION_ORDER):
        leaves, spec = optree.tree_flatten(tree, namespace=_INSERTION_ORDER)
    averaged: list[Any] = list(leaves)
    for bucket in _buckets(leaves, bucket_mb * 2**20):
        flat = torch.cat([leaves[i].reshape(-1) for i in bucket])
        flat = all_reduce(flat, group, op="avg") if nccl_averages else all_reduce(flat, group) / world
        pieces = flat.split([leaves[i].numel() for i in bucket])
        for i, piece in zip(bucket, pieces):
            averaged[i] = piece.view(leaves[i].shape)
    return optree.tree_unflatten(spec, averaged)


_INSERTION_ORDER = "dynaflow_fn.insertion_order"    # an optree namespace in which dicts keep their order


def _buckets(leaves: list[torch.Tensor], capacity: float) -> list[list[int]]:
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
    """The plan's collectives in issue order: op, arguments that are not tensors, and tensor shapes."""
    signature = []
    for step in plan.steps:
        if not ops.launches_collective(step.op):
            continue
        shapes = tuple((plan.slots[s].layout.shape, str(plan.slots[s].layout.dtype)) for s in step.reads())
        constants = tuple(a for a in step.args if isinstance(a, (int, float, str)))
        signature.append((str(step.op), constants, shapes))
    return signature


def check_consistent(plan: Plan, group: Any = None, timeout: float = 60.0) -> None:
    """Raise DistributedError unless every rank of `group` runs the same collectives in the same order.

    Uses the process group's store with a timeout, so a rank that never arrives is reported, not
    waited for forever.
    """
    group = _group(group)
    mine = collective_signature(plan)
    world = dist.get_world_size(group)
    if world == 1:
        return
    store = default_store()
    rank = dist.get_rank(group)
    key = f"dynaflow/collectives/{plan.name}/{_counter(plan.name)}"
    store.set(f"{key}/{rank}", repr(mine))
    names = [f"{key}/{r}" for r in range(world)]
    try:
        store.wait(names, datetime.timedelta(seconds=timeout))
    except Exception as error:
        missing = [r for r, n in enumerate(names) if not store.check([n])]
        raise DistributedError(f"rank(s) {missing} did not reach {plan.name}'s first call within {timeout:.0f} s "
                               f"while ranks compared their collectives; every rank must call it") from error
    for other in range(world):
        theirs = store.get(names[other]).decode()
        if theirs != repr(mine):
            raise DistributedError(_difference(plan.name, rank, mine, other, theirs))


_calls: dict[str, int] = {}


def _counter(name: str) -> int:
    _calls[name] = _calls.get(name, 0) + 1
    return _calls[name]


def _difference(name: str, rank: int, mine: list[tuple], other: int, theirs: str) -> str:
    import ast

    parsed = ast.literal_eval(theirs)
    for index, (a, b) in enumerate(zip(mine, parsed)):
        if repr(a) != repr(b):
            return (f"{name}: collective #{index} differs between rank {rank} ({a[0]}, inputs {a[2]}) and rank "
                    f"{other} ({b[0]}, inputs {b[2]}); every rank must run the same collectives on the same shapes")
    return (f"{name}: rank {rank} runs {len(mine)} collectives but rank {other} runs {len(parsed)}; every rank "
            f"must run the same collectives")
