"""Process groups for collectives: the caller's, or a second communicator with a budget of thread blocks.

The overlap transform moves a program's collectives onto `comm_group(max_ctas)` so they can run
beside compute; `df.distributed` hands the same groups to users.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ..compat import resolve_process_group
from ..errors import DistributedError, InputError


def resolve_group(group: Any) -> Any:
    """The group to run a collective on: `group`, or the default (world) group."""
    if not dist.is_available() or not dist.is_initialized():
        raise DistributedError("no process group is initialized: call torch.distributed.init_process_group "
                               "(torchrun sets up the environment for it) before tracing collectives")
    return group if group is not None else dist.group.WORLD


def comm_group(max_ctas: int, group: Any = None) -> Any:
    """A second communicator over the ranks of `group` whose collectives use at most `max_ctas` CUDA
    thread blocks (NCCL's `max_ctas`, through ProcessGroupNCCL options).

    Why: an all-reduce on the default communicator grabs as many SMs as NCCL likes and only gets them
    when the GEMMs beside it drain, so it overlaps nothing; with a small budget it runs beside them.
    On other backends (gloo) the group is a plain copy. Every rank must ask for the same groups in the
    same order (tracing does, since every rank traces the same program); groups are made once and reused.
    """
    group = resolve_group(group)
    if max_ctas < 1:
        raise InputError(f"max_ctas must be at least 1, got {max_ctas}")
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
