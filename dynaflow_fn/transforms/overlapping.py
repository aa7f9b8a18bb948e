"""`T.overlap`: run a Scheduler over the stage DAG and fix every node's stream and issue position.

See `overlap` for what it does and the strategies it takes.
"""

from __future__ import annotations

import reprlib
from collections.abc import Iterable
from typing import Any, Sequence

from ..errors import ScheduleError, TransformError
from ..ir.program import NodeInfo, Program, Stream, copy_graph_module, info
from ..ir.scopes import ScopeKind
from .base import Pass, apply_transform, record
from .partition_rules import Kind
from .partitioning import PartitionPass
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
        _refuse_nested_microbatches(program)
        if all(info(n).stage is None for n in program.ops()):
            program = PartitionPass(DEFAULT_RULES, warn_unmatched=False).apply(program)
        if self.comm_ctas is not None:
            program = _on_comm_group(program, self.comm_ctas)
        graph = StageGraph.from_program(program)
        streams = _as_list(self.scheduler.streams(graph), self.scheduler, "streams", "Stream objects")
        issues = _as_list(self.scheduler.schedule(graph), self.scheduler, "schedule", "T.Issue objects")
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

        return record(program, program.annotate(update, streams=streams, sm_carveout=self.comm_ctas), self)


def _on_comm_group(program: Program, max_ctas: int) -> Program:
    """The program with every collective moved to a communicator of at most `max_ctas` thread blocks."""
    from ..ir import ops
    from .communicators import comm_group_name

    graph_module, _ = copy_graph_module(program.graph_module)
    for node in graph_module.graph.nodes:
        if node.op != "call_function" or not ops.launches_collective(node.target):
            continue
        group = ops.bind_arguments(node.target, node.args, node.kwargs).get("group_name")
        if group is None:
            continue
        node.args, node.kwargs = ops.replace_arguments(
            node.target, node.args, node.kwargs, {"group_name": comm_group_name(group, max_ctas)})
    return program.with_graph(graph_module)


def _refuse_nested_microbatches(program: Program) -> None:
    """The schedulers overlap one level of micro-batches: a node of a micro-batch inside a micro-batch
    belongs to two of them, and the default partition cuts them into stages that wait on each other."""
    for node in program.ops():
        if sum(scope.kind is ScopeKind.MICROBATCH for scope in info(node).scopes) > 1:
            raise TransformError("overlap schedules one level of micro-batches, but this program applies T.microbatch "
                                 "to a function that T.microbatch already splits; split once instead, with num the "
                                 "product of the two")


def _as_list(result: Any, scheduler: Scheduler, method: str, items: str) -> list[Any]:
    """A Scheduler method's result as a list, or a ScheduleError if it returned no sequence."""
    if isinstance(result, (str, bytes)) or not isinstance(result, Iterable):
        raise ScheduleError(f"{type(scheduler).__name__}.{method}() returned {reprlib.repr(result)}; it must return "
                            f"a list of {items}")
    return list(result)


def _check_schedule(graph: StageGraph, streams: Sequence[Stream], issues: Sequence[Issue],
                    scheduler: Scheduler) -> None:
    name = type(scheduler).__name__
    for position, stream in enumerate(streams):
        if not isinstance(stream, Stream) or stream.index != position:
            raise ScheduleError(f"{name}.streams() must return Stream(index, name, priority) objects numbered "
                                f"0, 1, ... in order; entry {position} is {stream!r}")
    issued: set[int] = set()
    for position, issue in enumerate(issues):
        if not isinstance(issue, Issue):
            raise ScheduleError(f"{name}.schedule() returned {issue!r} at position {position}; it must return "
                                f"T.Issue(stage index, stream index) objects")
        if type(issue.stage) is not int or not 0 <= issue.stage < len(graph.stages):
            raise ScheduleError(f"{name} issued {issue!r} at position {position}, which names no stage: Issue.stage "
                                f"is a stage's index, 0 to {len(graph.stages) - 1}")
        stage = graph.stages[issue.stage]
        if issue.stage in issued:
            raise ScheduleError(f"{name} issued {stage} twice")
        if type(issue.stream) is not int or not 0 <= issue.stream < len(streams):
            raise ScheduleError(f"{name} put {stage} on stream {issue.stream!r}, but declared only "
                                f"{len(streams)} streams in streams(); Issue.stream is a stream's index")
        missing = sorted(stage.needs - issued)
        if missing:
            raise ScheduleError(f"{name} issued {stage} before {graph.stages[missing[0]]}, whose results it reads")
        if not isinstance(issue.after, (tuple, list)) or any(type(s) is not int for s in issue.after):
            raise ScheduleError(f"{name} issued {stage} with after={issue.after!r}; Issue.after is a tuple of the "
                                f"indices of stages issued earlier")
        early = [s for s in issue.after if s not in issued]
        if early:
            raise ScheduleError(f"{name} issued {stage} after={list(issue.after)}, but stage {early[0]} is not "
                                f"issued before it; a stage can only wait for stages issued earlier")
        issued.add(issue.stage)
    left = [s for s in graph.stages if s.index not in issued]
    if left:
        raise ScheduleError(f"{name} never issued {left[0]}" + (f" and {len(left) - 1} more" if len(left) > 1 else ""))


def overlap(fn: Any = None, strategy: "str | Scheduler" = "roundrobin", comm_ctas: int | None = None) -> Any:
    """Fix the order in which the stages of `fn` (a function or a Program) are issued and the stream
    each runs on, by a scheduling strategy. Returns the transformed function (or Program; with no
    `fn`, a transform to apply later).

    The stages come from `T.partition`; a program that was not partitioned is first cut by cost-model
    kind (collectives, GEMM-like work and memory-bound work become separate stages, the granularity
    NanoFlow overlaps at). The strategy sees the DAG of stages (each with its micro-batch, kind, tags
    and cost estimate) and returns a total issue order with a stream for every stage. Lowering adds
    an event wherever a stage reads the results of another stream, so the overlapped program computes
    exactly what the sequential one does. Scheduling runs once, when the plan is built, never per call.

    strategy:
        "sequential"   one stream, in trace order: the reference every other schedule must equal.
        "roundrobin"   NanoFlow style: the next ready stage of each micro-batch in turn, micro-batch i
                       on compute stream i, collectives on a high-priority comm stream.
        "tbo"          two-batch overlap: micro-batch 1 runs one stage behind micro-batch 0 (one's
                       attention beside the other's MLP), paced so the offset holds in a CUDA graph.
        "branches"     independent subgraphs of one batch (no micro-batches needed) on side streams.
        a Scheduler    the built-ins with options (`T.RoundRobin(compute_streams=2)`, `T.TBO(offset=2,
                       pace=False)`, `T.Branches(max_streams=2)`) or your own `df.Scheduler` subclass:
                       override `pick` (the next ready stage and its stream) or `schedule` (the whole
                       order), and `streams` (the streams it uses, with priorities).

    The schedule is checked before anything runs: every stage exactly once, after the stages it reads
    and the stages it is paced after, on a stream that `streams()` declares. A violation is a
    ScheduleError naming the scheduler, the stage and what was expected.

    comm_ctas: run the collectives on a dedicated communicator limited to this many thread blocks
        (`df.distributed.comm_group`), and have the kernels that may run beside a collective leave as
        many SMs free (cuBLAS's SM carveout), so that the collective need not wait for a persistent
        GEMM to drain.

    Apply overlap once and last, after microbatch and partition: the schedule it fixes is what
    lowering builds the plan from.

    >>> step = T.partition(T.microbatch(fn, num=2, in_axes=(None, 0)), rules=[T.Region("attn")])
    >>> fast = df.jit(T.overlap(step, strategy="tbo"))
    >>> print(fast.lower(params, x))       # the Plan: streams, steps, events
    """
    if isinstance(fn, (str, Scheduler)):
        fn, strategy = None, fn
    return apply_transform(fn, OverlapPass(strategy, comm_ctas))
