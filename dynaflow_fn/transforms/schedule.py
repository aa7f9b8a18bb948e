"""Schedulers: the programmable part of a strategy. They run once, in the overlap pass
(`T.overlap`, transforms/overlapping.py), when the Program is transformed, never per call.

A Scheduler sees the DAG of stages (each with its micro-batch, kind, tags and cost estimate) and
returns a total issue order with a stream for every stage. Write one by overriding `pick` (choose the
next stage among the ready ones, and its stream) or `schedule` (return the whole order at once), and
`streams` to declare the streams it uses with their priorities:

    class KindPairing(df.Scheduler):
        def streams(self, graph):
            return [Stream(0, "main"), Stream(1, "side")]
        def pick(self, ready, graph, issued):
            ...                                   # return (stage, stream index)

Built-ins: `Sequential` (one stream, trace order), `RoundRobin` (NanoFlow-style interleaving of
micro-batches, collectives on a high-priority stream), `TBO` (two-batch overlap: micro-batch 1 runs
one stage behind micro-batch 0) and `Branches` (independent subgraphs of one batch on side streams).
"""

from __future__ import annotations

import reprlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

from torch import fx

from ..errors import InputError, ScheduleError
from ..ir import cost
from ..ir.program import Program, Stream, info

COMM_PRIORITY = -1


@dataclass(frozen=True)
class Stage:
    """A group of nodes of one micro-batch (or of none: shared work) that is scheduled as a unit.

    index: its position in `StageGraph.stages`, which `Issue.stage` names it by.
    mb: its micro-batch, or None for work every micro-batch shares.
    kind: the cost model's kind of its costliest part ("compute" or "memory"), or "comm" if it holds
        a collective.
    tags: the tags of the partition rule that made it (see `T.Rule`).
    cost: the cost model's estimate (`flops`, `bytes`, `seconds`) of all its nodes.
    nodes: the names of its nodes, in trace order.
    needs: the indices of the stages whose results it reads.
    """

    index: int
    mb: int | None
    kind: cost.CostKind
    tags: frozenset[str]
    cost: cost.Cost
    nodes: tuple[str, ...]
    needs: frozenset[int]

    def __str__(self) -> str:
        where = f"mb{self.mb}" if self.mb is not None else "shared"
        tags = f" [{','.join(sorted(self.tags))}]" if self.tags else ""
        return f"stage {self.index} ({where} {self.kind}{tags}, {len(self.nodes)} nodes)"


class StageGraph:
    """The `stages` of a partitioned Program (a tuple, in trace order) and the order constraints
    between them; `micro_batches` lists the micro-batch numbers, and `ready(issued)` the stages whose
    inputs are all issued."""

    def __init__(self, stages: Sequence[Stage]):
        self.stages = tuple(stages)
        self.micro_batches = sorted({s.mb for s in stages if s.mb is not None})

    @classmethod
    def from_program(cls, program: Program) -> "StageGraph":
        members: dict[int, list[fx.Node]] = defaultdict(list)
        for node in program.ops():
            members[info(node).stage].append(node)
        stage_of = {node: stage for stage, nodes in members.items() for node in nodes}
        stages = []
        for index in sorted(members):
            nodes = members[index]
            total = sum((cost.node_cost(n) for n in nodes), cost.ZERO)
            needs = frozenset(stage_of[src] for n in nodes for src in n.all_input_nodes
                              if src in stage_of and stage_of[src] != index)
            first = info(nodes[0])
            stages.append(Stage(index, first.mb, total.kind, first.tags, total, tuple(n.name for n in nodes), needs))
        return cls(stages)

    def ready(self, issued: set[int]) -> list[Stage]:
        """Stages not yet issued whose every need is issued, in trace order."""
        return [s for s in self.stages if s.index not in issued and s.needs <= issued]

    def of_micro_batch(self, mb: int | None) -> list[Stage]:
        return [s for s in self.stages if s.mb == mb]

    def has_comm(self) -> bool:
        return any(s.kind is cost.CostKind.COMM for s in self.stages)


@dataclass(frozen=True)
class Issue:
    """One entry of a schedule: issue `stage` on `stream`.

    `after` names stages (issued earlier) that must finish before this one starts although it reads
    nothing of theirs. A CUDA graph runs every kernel whose inputs are ready, whatever the issue order;
    such pacing edges keep an intended offset between micro-batches (two-batch overlap) in the graph.
    """

    stage: int
    stream: int
    after: tuple[int, ...] = ()


class Scheduler:
    """Base class of strategies: override `pick` (or `schedule`) and `streams`.

    A Scheduler sees the stage DAG (`StageGraph`: each `Stage` with its micro-batch, kind, tags and
    cost estimate) once, when `T.overlap` applies, and returns a total issue order with a stream for
    every stage. `streams(graph)` declares the streams it uses (`df.Stream(index, name, priority)`,
    numbered 0, 1, ...; the default is one stream); `pick(ready, graph, issued)` returns the next
    stage among the ready ones and the index of its stream; or `schedule(graph)` returns the whole
    order as `T.Issue`s at once. More in `dynaflow_fn.transforms.schedule`.
    """

    def streams(self, graph: StageGraph) -> Sequence[Stream]:
        return (Stream(0, "main"),)

    def schedule(self, graph: StageGraph) -> list[Issue]:
        """The whole issue order. The default asks `pick` for one ready stage at a time."""
        issued: set[int] = set()
        order: list[Issue] = []
        streams = len(self.streams(graph))
        while len(order) < len(graph.stages):
            ready = graph.ready(issued)
            stage, stream = self._checked_pick(self.pick(ready, graph, order), ready, issued, streams)
            order.append(Issue(stage.index, stream))
            issued.add(stage.index)
        return order

    def _checked_pick(self, picked: object, ready: list[Stage], issued: set[int], streams: int) -> tuple[Stage, int]:
        """`pick`'s answer if it is a ready stage and a declared stream; else a ScheduleError saying what
        came back and what was expected."""
        name = type(self).__name__
        expected = (f"expected (stage, stream): one of the ready stages ({', '.join(str(s.index) for s in ready)}) "
                    f"and the index of one of the {streams} streams that streams() declares")
        if not isinstance(picked, (tuple, list)) or len(picked) != 2:
            raise ScheduleError(f"{name}.pick returned {_shown(picked)}; {expected}")
        stage, stream = picked
        if not isinstance(stage, Stage):
            raise ScheduleError(f"{name}.pick returned {_shown(stage)} as the stage; {expected}")
        if stage.index not in {s.index for s in ready}:
            waits_for = sorted(stage.needs - issued)
            why = ("it was issued already" if stage.index in issued else
                   f"it reads stage {waits_for[0]}, which is not issued yet" if waits_for else "it is not in the graph")
            raise ScheduleError(f"{name}.pick returned {stage}, which is not ready ({why}); {expected}")
        if type(stream) is not int or not 0 <= stream < streams:
            raise ScheduleError(f"{name}.pick put {stage} on stream {_shown(stream)}; {expected}")
        return stage, stream

    def pick(self, ready: list[Stage], graph: StageGraph, issued: list[Issue]) -> tuple[Stage, int]:
        """The next stage to issue, one of `ready` (stages whose inputs are all issued, in trace order),
        and the index of the stream to issue it on. `issued` is the order so far."""
        raise ScheduleError(f"{type(self).__name__} must override pick() or schedule()")

    def describe(self) -> str:
        return type(self).__name__


def _shown(value: object) -> str:
    """A Scheduler's answer as a message shows it: a Stage by its summary, anything else by a short repr."""
    return str(value) if isinstance(value, Stage) else reprlib.repr(value)


class Sequential(Scheduler):
    """Everything on one stream, in trace order: the reference every other schedule must equal."""

    def pick(self, ready: list[Stage], graph: StageGraph, issued: list[Issue]) -> tuple[Stage, int]:
        return ready[0], 0


def _with_comm_stream(compute: int, graph: StageGraph, comm_stream: bool, comm_priority: int) -> list[Stream]:
    streams = [Stream(0, "main")] + [Stream(i, f"compute{i}") for i in range(1, compute)]
    if comm_stream and graph.has_comm():
        streams.append(Stream(len(streams), "comm", comm_priority))
    return streams


class RoundRobin(Scheduler):
    """NanoFlow-style: issue the next ready stage of each micro-batch in turn.

    Micro-batch i computes on stream i mod `compute_streams` (default: one stream per micro-batch);
    with `comm_stream`, collective stages go to their own stream of priority `comm_priority`.
    """

    def __init__(self, compute_streams: int | None = None, comm_stream: bool = True,
                 comm_priority: int = COMM_PRIORITY):
        self.compute_streams, self.comm_stream, self.comm_priority = compute_streams, comm_stream, comm_priority

    def _compute(self, graph: StageGraph) -> int:
        return self.compute_streams or max(1, len(graph.micro_batches))

    def streams(self, graph: StageGraph) -> Sequence[Stream]:
        return _with_comm_stream(self._compute(graph), graph, self.comm_stream, self.comm_priority)

    def stream_for(self, stage: Stage, graph: StageGraph) -> int:
        if stage.kind is cost.CostKind.COMM and self.comm_stream:
            return self._compute(graph)
        return 0 if stage.mb is None else graph.micro_batches.index(stage.mb) % self._compute(graph)

    def pick(self, ready: list[Stage], graph: StageGraph, issued: list[Issue]) -> tuple[Stage, int]:
        mbs = graph.micro_batches
        last = next((graph.stages[i.stage].mb for i in reversed(issued) if graph.stages[i.stage].mb is not None),
                    None)
        start = (mbs.index(last) + 1) % len(mbs) if last is not None else 0
        for offset in range(len(mbs)):
            mb = mbs[(start + offset) % len(mbs)] if mbs else None
            for stage in ready:
                if stage.mb == mb:
                    return stage, self.stream_for(stage, graph)
        return ready[0], self.stream_for(ready[0], graph)

    def describe(self) -> str:
        return f"roundrobin(compute_streams={self.compute_streams}, comm_stream={self.comm_stream})"


class TBO(RoundRobin):
    """Two-batch overlap: micro-batch i runs `offset` stages behind micro-batch i-1, so stage k of one
    micro-batch is issued next to stage k+offset of the other (attention beside MLP, say).

    The stages are issued in steps: at step t, stage t - i*offset of micro-batch i. With `pace` (the
    default), a stage also waits for the other micro-batches' stages of the previous step, so the
    offset holds on the device, inside a CUDA graph too, instead of the micro-batches drifting into
    lockstep (where their collectives would queue at the same time). `comm_stream` and
    `comm_priority` as for `T.RoundRobin`: collective stages on a stream of their own, of that priority.
    """

    def __init__(self, offset: int = 1, comm_stream: bool = True, comm_priority: int = COMM_PRIORITY,
                 pace: bool = True):
        super().__init__(None, comm_stream, comm_priority)
        self.offset, self.pace = offset, pace

    def schedule(self, graph: StageGraph) -> list[Issue]:
        per_mb = {mb: graph.of_micro_batch(mb) for mb in graph.micro_batches}
        issued: set[int] = set()
        order: list[Issue] = []

        def issue(stage: Stage, after: tuple[int, ...] = ()) -> None:
            for need in sorted(stage.needs - issued):
                issue(graph.stages[need])
            if stage.index not in issued:
                issued.add(stage.index)
                order.append(Issue(stage.index, self.stream_for(stage, graph), after))

        longest = max((len(s) for s in per_mb.values()), default=0)
        previous_step: dict[int, int] = {}
        for step in range(longest + self.offset * len(per_mb)):
            this_step: dict[int, int] = {}
            for i, mb in enumerate(graph.micro_batches):
                k = step - i * self.offset
                if 0 <= k < len(per_mb[mb]):
                    stage = per_mb[mb][k]
                    pacing = tuple(s for m, s in previous_step.items() if m != mb) if self.pace else ()
                    issue(stage, pacing)
                    this_step[mb] = stage.index
            previous_step = this_step or previous_step
        for stage in graph.stages:
            issue(stage)
        return order

    def describe(self) -> str:
        return f"tbo(offset={self.offset}" + (")" if self.pace else ", pace=False)")


class Branches(Scheduler):
    """Independent subgraphs of one batch on their own streams (POD style).

    Each stage continues the stream of its first predecessor not yet continued by another stage; a
    stage with no free predecessor starts a new stream (up to `max_streams`, then the least loaded).
    Ready stages are issued rotating over the streams, so independent branches interleave.
    """

    def __init__(self, max_streams: int = 4):
        self.max_streams = max_streams

    def assign(self, graph: StageGraph) -> dict[int, int]:
        """The stream of every stage, by chain decomposition of the stage DAG."""
        stream_of: dict[int, int] = {}
        load: list[float] = []
        continued: set[int] = set()
        for stage in graph.stages:
            free = [p for p in sorted(stage.needs) if p not in continued]
            if free:
                stream = stream_of[free[0]]
                continued.add(free[0])
            elif len(load) < self.max_streams:
                stream = len(load)
                load.append(0.0)
            else:
                stream = min(range(len(load)), key=load.__getitem__)
            stream_of[stage.index] = stream
            load[stream] += stage.cost.seconds
        return stream_of

    def streams(self, graph: StageGraph) -> Sequence[Stream]:
        count = max(self.assign(graph).values(), default=0) + 1
        return [Stream(0, "main")] + [Stream(i, f"branch{i}") for i in range(1, count)]

    def schedule(self, graph: StageGraph) -> list[Issue]:
        stream_of = self.assign(graph)
        span = max(stream_of.values(), default=0) + 1
        issued: set[int] = set()
        order: list[Issue] = []
        while len(order) < len(graph.stages):
            last = order[-1].stream if order else -1
            stage = min(graph.ready(issued), key=lambda s: ((stream_of[s.index] - last - 1) % span, s.index))
            order.append(Issue(stage.index, stream_of[stage.index]))
            issued.add(stage.index)
        return order

    def describe(self) -> str:
        return f"branches(max_streams={self.max_streams})"


STRATEGIES = {"sequential": Sequential, "roundrobin": RoundRobin, "tbo": TBO, "branches": Branches}


def resolve(strategy: "str | Scheduler") -> Scheduler:
    if isinstance(strategy, Scheduler):
        return strategy
    if isinstance(strategy, type) and issubclass(strategy, Scheduler):
        return strategy()
    if not isinstance(strategy, str):
        raise InputError(f"strategy takes a name ({', '.join(STRATEGIES)}) or a df.Scheduler, got {strategy!r}")
    if strategy in STRATEGIES:
        return STRATEGIES[strategy]()
    raise InputError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)} or pass a df.Scheduler")
