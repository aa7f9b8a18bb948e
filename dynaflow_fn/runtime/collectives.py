"""Collectives as a plan runs them."""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from ..compat import resolve_process_group


def all_reduce_on_current_stream(tensor: Tensor, reduce_op: str, group_name: str) -> Tensor:
    """How a plan runs an inplace all-reduce (`_c10d_functional.all_reduce_`): through c10d's blocking
    call, which launches NCCL on the current stream, i.e. the plan's comm stream with its priority.
    The functional op would launch on the process group's internal stream and join back through two
    events, which a CUDA graph keeps as cross-stream edges on every collective."""
    dist.all_reduce(tensor, op=getattr(dist.ReduceOp, reduce_op.upper()), group=resolve_process_group(group_name))
    return tensor
