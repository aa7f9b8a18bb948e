"""`T.overlap`: run a Scheduler over the stage DAG and fix every node's stream and issue position.

The schedule is checked before anything runs: every stage exactly once, after the stages it needs,
on a declared stream. A program that was not partitioned is first cut by cost-model kind
(collectives, GEMM-like work and memory-bound work become separate stages), which is the granularity
NanoFlow overlaps at.
"""

from __future__ import annotations

from typing import Any, Sequence

from ..errors import ScheduleError, TransformError
from ..program import NodeInfo, Program, Stream, copy_graph_module, info
from .base import Pass, apply_transform, record
from .partition import Kind, PartitionPass
from .schedule import Issue, Scheduler, StageGraph, resolve

DEFAULT_RULES = (Kind("comm"), Kind("compute"))


class OverlapPass(Pass):
    def __init__(self, strategy: "str | Scheduler", comm_ctas: int | None = None):
        self.scheduler = resolve(strategy)
        if comm_ctas is not None and comm_ctas < 1:
            raise TransformError(f"comm_ctas must be a positive number of thread blocks, got {comm_ctas}")
        self.comm_ctas = comm_ctas

    def describe(self) -> str:
        ctas = f", comm_ctas={self.comm_ctas}" if self.comm_ctas is not None else ""
        return f"overlap({self.scheduler.describe()}{ctas})"

    def apply(self, program: Program) -> Program:
        if program.is_scheduled():
            raise TransformError("overlap was already applied to this program; apply it once, last")
        if all(info(n).stage is None for n in program.ops()):
            program = PartitionPass(DEFAULT_RULES, warn_unmatched=False).apply(program)
        if self.comm_ctas is not None:
            program = _on_comm_group(program, self.comm_ctas)
        graph = StageGraph.from_program(program)
        streams = tuple(self.scheduler.streams(graph))
        issues = list(self.scheduler.schedule(graph))
        _check_schedule(graph, streams, issues, self.scheduler)
        stream_of = {issue.stage: issue.stream for issue in issues}
        order: dict[str, int] = {}
        members = {stage.index: stage.nodes for stage in graph.stages}
        for issue in issues:
            for name in members[issue.stage]:
                order[name] = len(order)
        after = {issue.stage: tuple(issue.after) for issue in issues}

        def update(node: Any, node_info: NodeInfo) -> NodeInfo:
            if node.name not in order:
                return node_info
            return node_info.replace(order=order[node.name], stream=stream_of[node_info.stage],
                                     after=after[node_info.stage])

        return record(program, program.annotate(update, streams=streams, collective_sms=self.comm_ctas), self)


def _on_comm_group(program: Program, max_ctas: int) -> Program:
    """The program with every collective moved to a communicator of at most `max_ctas` thread blocks."""
    from .. import distributed, ops

    graph_module, _ = copy_graph_module(program.graph_module)
    for node in graph_module.graph.nodes:
        if node.op != "call_function" or not ops.launches_collective(node.target):
            continue
        group = ops.bind_arguments(node.target, node.args, node.kwargs).get("group_name")
        if group is None:
            continue
        node.args, node.kwargs = ops.replace_arguments(
            node.target, node.args, node.kwargs, {"group_name": distributed.comm_group_name(group, max_ctas)})
    return program.with_graph(graph_module)


def _check_schedule(graph: StageGraph, streams: Sequence[Stream], issues: Sequence[Issue],
                    scheduler: Scheduler) -> None:
    name = type(scheduler).__name__
    for position, stream in enumerate(streams):
        if not isinstance(stream, Stream) or stream.index != position:
            raise ScheduleError(f"{name}.streams() must return Stream(index, name, priority) objects numbered "
                                f"0, 1, ... in order; entry {position} is {stream!r}")
    issued: set[int] = set()
    for position, issue in enumerate(issues):
        if not isinstance(issue, Issue) or not 0 <= issue.stage < len(graph.stages):
            raise ScheduleError(f"{name} issued {issue!r} at position {position}, which names no stage")
        stage = graph.stages[issue.stage]
        if issue.stage in issued:
            raise ScheduleError(f"{name} issued {stage} twice")
        if not 0 <= issue.stream < len(streams):
            raise ScheduleError(f"{name} put {stage} on stream {issue.stream}, but declared only "
                                f"{len(streams)} streams in streams()")
        missing = sorted(stage.needs - issued)
        if missing:
            raise ScheduleError(f"{name} issued {stage} before {graph.stages[missing[0]]}, whose results it reads")
        early = [s for s in issue.after if s not in issued]
        if early:
            raise ScheduleError(f"{name} issued {stage} after={list(issue.after)}, but stage {early[0]} is not "
                                f"issued before it; a stage can only wait for stages issued earlier")
        issued.add(issue.stage)
    left = [s for s in graph.stages if s.index not in issued]
    if left:
        raise ScheduleError(f"{name} never issued {left[0]}" + (f" and {len(left) - 1} more" if len(left) > 1 else ""))


def overlap(fn: Any = None, strategy: "str | Scheduler" = "roundrobin", comm_ctas: int | None = None) -> Any:
    """Schedule the program's stages on streams with a strategy: "sequential", "roundrobin", "tbo",
    "branches" or a `df.Scheduler`. Apply it last, after microbatch and partition.

    comm_ctas: run the collectives on a dedicated communicator limited to this many thread blocks
        (`df.distributed.comm_group`), and have the kernels that may run beside a collective leave as
        many SMs free (cuBLAS's SM carveout), so that the collective need not wait for a persistent
        GEMM to drain.

    >>> step = T.overlap(step, strategy="tbo")
    """
    if isinstance(fn, (str, Scheduler)):
        fn, strategy = None, fn
    return apply_transform(fn, OverlapPass(strategy, comm_ctas))
