"""How transforms apply to functions and to Programs.

A transform is a `Pass`: `apply(program) -> program`, never mutating its input. Applied to a Python
function, a transform returns a `Transformed` function that remembers the passes; tracing it traces
the original function and applies the passes in order. Called eagerly, a `Transformed` function
computes what the transformed program computes (micro-batches run one after another; with a pass that
changes values, such as a substitution, by running its traced Program), so it is also
the reference that transformed programs are tested against.

A transform called without a function returns itself as a one-argument transform, so transforms
compose: `T.compose(T.microbatch(num=2, in_axes=(None, 0)), T.overlap(strategy="tbo"))(fn)`.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from typing import Any, Callable, Sequence

from ..errors import InputError, TransformError
from ..ir.program import Program
from ..ir.tree import Flat
from ..tracing.tracer import trace_function


class Pass(abc.ABC):
    """A Program -> Program rewrite. `describe()` is the provenance line printed with the program.

    A pass that finds nothing to change returns the very Program it was given (through `record`),
    and then adds no provenance line: a printed program lists only the passes that changed it.

    `changes_values` is True for a pass whose Program computes something the function's code does
    not (a substitution): calling the transformed function eagerly then traces it and runs its
    Program, so that the eager call stays the reference for what the jitted one computes."""

    changes_values = False

    @abc.abstractmethod
    def apply(self, program: Program) -> Program:
        """The rewritten program, a new one: `program` itself stays as it is."""

    @abc.abstractmethod
    def describe(self) -> str:
        """The pass as one line of the program's provenance, like the call that made it: `microbatch(num=2)`."""

    def wrap_body(self, body: Callable[..., Any]) -> Callable[..., Any] | None:
        """Passes that change what gets traced (microbatch) return the new body; the others None."""
        return None

    def check_call(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        """Check the arguments of a call of the transformed function as the caller passed them.

        Tracing sees only shapes and dtypes; a pass that needs more (microbatch asks which tensors are
        nn.Parameters) raises here, before the call runs or is traced. The default accepts everything."""


class Transformed:
    """A function `fn` with the `passes` of its transforms attached, in order. Calling it runs `fn`
    eagerly (micro-batch after micro-batch); tracing it traces `fn` and applies the passes."""

    def __init__(self, fn: Callable[..., Any], passes: Sequence[Pass]):
        self.fn = fn
        self.passes = tuple(passes)
        functools.update_wrapper(self, fn, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if any(p.changes_values for p in self.passes):
            return self.__dynaflow_trace__(Flat.of(args, kwargs))(*args, **kwargs)
        self._check_call(args, kwargs)
        body = self.fn
        for p in self.passes:
            body = p.wrap_body(body) or body
        return body(*args, **kwargs)

    def __dynaflow_trace__(self, flat: Flat) -> Program:
        """Trace: passes that rewrite the body before the first Program pass are traced directly."""
        args, kwargs = flat.args, flat.kwargs
        self._check_call(args, kwargs)
        body, leading = self.fn, 0
        for p in self.passes:
            wrapped = p.wrap_body(body)
            if wrapped is None:
                break
            body, leading = wrapped, leading + 1
        program = trace_function(self.fn, args, kwargs, body=body,
                                 provenance=[p.describe() for p in self.passes[:leading]], flat=flat)
        for p in self.passes[leading:]:
            program = p.apply(program)
        return program

    def _check_call(self, args: tuple, kwargs: dict) -> None:
        for p in self.passes:
            p.check_call(self.fn, args, kwargs)

    def __repr__(self) -> str:
        return f"<transformed {getattr(self.fn, '__name__', 'fn')}: {' -> '.join(p.describe() for p in self.passes)}>"


def record(program: Program, new: Program, p: Pass) -> Program:
    """`new`, the result of pass `p` on `program`, stamped with `p`'s provenance line (printed under
    "passes") and remembering `p` for re-tracing. A `T.Pass`'s `apply` returns this. A result that is
    `program` itself changed nothing: it gets no line, but the pass is remembered all the same, since
    on a program traced again it may find something to do."""
    provenance = program.provenance if new is program else program.provenance + (p.describe(),)
    if new is not program:
        _check_values_recorded(new, p)
    return dataclasses.replace(new, provenance=provenance, passes=program.passes + (p,))


def _check_values_recorded(program: Program, p: Pass) -> None:
    """Raise a TransformError naming a node that `p` added without the fake value (`meta["val"]`) every
    later stage reads: lowering plans each result's memory by its shape, strides and dtype."""
    for node in program.graph.nodes:
        if node.op == "call_function" and "val" not in node.meta:
            raise TransformError(
                f"{p.describe()} left node {node.name} ({node.target}) without node.meta['val'], the fake tensor "
                f"that says its shape, strides and dtype, which lowering plans its memory by. Set it on every node "
                f"a pass adds: copy it from a node of the same result (node.meta['val'] = other.meta['val']), or call "
                f"the op on its arguments' meta['val'] values")


def retraced(program: Program, p: Pass, name: str) -> Program:
    """How a pass that changes what gets traced (`wrap_body`) applies to a Program: trace the
    Program's source again with the pass's body, then redo the passes the Program had."""
    source = program.source
    if source is None:
        raise TransformError(f"{name} needs the function a Program was traced from; this Program has none")
    new = trace_function(source.fn, source.args, source.kwargs, body=p.wrap_body(source.body))
    for earlier in program.passes:
        new = earlier.apply(new)
    return new


def apply_transform(target: Any, p: Pass) -> Any:
    """Apply the pass `p` to `target`: a Program (a new Program), a function (a `T.Transformed`), or
    None (a one-argument transform, for `T.compose`)."""
    if target is None:
        return lambda fn: apply_transform(fn, p)
    if isinstance(target, Program):
        return p.apply(target)
    if isinstance(target, Transformed):
        return Transformed(target.fn, target.passes + (p,))
    if callable(target):
        return Transformed(target, (p,))
    raise InputError(f"transforms take a function or a Program, got {type(target).__qualname__}")


def compose(*transforms: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Chain `transforms` (each called without a function first) left to right:
    `compose(a, b)(fn) == b(a(fn))`.

    >>> strategy = T.compose(T.microbatch(num=2, in_axes=(None, 0)), T.overlap(strategy="roundrobin"))
    >>> fast = df.jit(strategy(fn))
    """
    for t in transforms:
        if not callable(t):
            raise InputError(f"compose takes transforms (call them without a function first), got {t!r}")

    def composed(target: Any) -> Any:
        for t in transforms:
            target = t(target)
        return target
    return composed
