"""Transforms: functions (or Programs) in, transformed functions (or Programs) out.

    step = T.microbatch(fn, num=2, in_axes=(None, 0))     # split the batch, merge the outputs
    step = T.partition(step, rules=[T.Region("attn")])    # cut into stages
    step = T.substitute(step, {T.Region("attn"): flash})   # run your own kernel for a region or module
    step = T.overlap(step, strategy="tbo")                # order the stages on streams
    fast = df.jit(step)
"""

from .base import Pass, Transformed, apply_transform, compose, record
from .microbatching import microbatch
from .overlapping import overlap
from .partition_rules import Kind, Module, Op, Region, Rule
from .partitioning import partition
from .schedule import TBO, Branches, Issue, RoundRobin, Scheduler, Sequential, Stage, StageGraph
from .substituting import substitute

__all__ = [
    "Branches", "Issue", "Kind", "Module", "Op", "Pass", "Region", "RoundRobin", "Rule", "Scheduler", "Sequential",
    "Stage", "StageGraph", "TBO", "Transformed", "apply_transform", "compose", "record", "microbatch", "overlap", "partition",
    "substitute",
]
