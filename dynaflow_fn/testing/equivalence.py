"""`assert_equivalent`: a transformed function computes what the original does, on fresh inputs."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from optree import tree_leaves

from ..errors import EquivalenceError, InputError
from ..jitting.jitted import jit
from ..transforms.base import Transformed
from ..transforms.microbatching import MicrobatchPass
from .compare import first_difference
from .inputs import batch_axes, draw_like, edge_batch_sizes


def assert_equivalent(fn: Callable[..., Any], transformed: Callable[..., Any], *example_args: Any,
                      draws: int = 3, exact: bool | None = None, in_axes: Any = None, num: int | None = None,
                      seed: int | None = None, backend: str | None = None, **example_kwargs: Any) -> None:
    """Check that `df.jit(transformed)` computes what `fn` computes, on fresh random inputs.

    Each draw makes new inputs shaped like the examples (`draw_like`). Draw 0 keeps the examples'
    batch size; the next ones try the edge sizes of the split (`edge_batch_sizes`: one row per
    micro-batch, an uneven split), then the examples' size again with other values. The batch axes
    come from `in_axes` (as `T.microbatch` takes it) and the number of micro-batches from `num`, by
    default both from the `T.microbatch` transforms of `transformed`; without batch axes, only the
    values change.

    Two comparisons per draw:
      - exact (default: whenever `transformed` is a transformed function, `T.*(fn)` or `T.Transformed`):
        bit for bit against calling `transformed` eagerly, which runs the micro-batches one after
        another on the original function: the contract of every schedule and of a transform that
        only reorders work. Pass `exact=False` for transforms that change the arithmetic (Inductor
        kernels, another precision).
      - within the dtype's tolerance against `fn` itself, unsplit.

    `backend` is df.jit's; by default eager PyTorch's own kernels (a CUDA graph on CUDA, the interpreter
    elsewhere), so that the exact comparison judges the schedule, not Inductor's rounding. To check a
    plan with Inductor's kernels (df.jit's default on CUDA), pass backend="auto" and exact=False.

    A failure is an AssertionError naming the first differing output leaf by its path, its largest
    difference, the draw's batch size and seed; `seed=` reruns exactly that draw first.
    """
    if not isinstance(draws, int) or draws < 1:
        raise InputError(f"assert_equivalent needs draws of at least 1, got {draws!r}: with none, nothing is compared")
    exact = isinstance(transformed, Transformed) if exact is None else exact
    if in_axes is None:
        in_axes = _microbatch_in_axes(transformed)
    axes = batch_axes(in_axes, example_args, example_kwargs) if in_axes is not None else None
    seed = int(torch.randint(0, 2**31 - 1, ())) if seed is None else seed
    fast = jit(transformed, backend=backend or aten_kernels_for(example_args, example_kwargs))
    for draw, rows in enumerate(_draw_rows(example_args, example_kwargs, axes, num or _split_count(transformed), draws)):
        generator = torch.Generator().manual_seed(seed + draw)
        args, kwargs = draw_like((example_args, example_kwargs), generator, axes, rows)
        where = (f"draw {draw} of {draws} (seed={seed + draw}"
                 + (f", batch of {rows}" if rows is not None else "") + ")")
        got = fast(*args, **kwargs)
        if exact:
            _fail_if(first_difference(got, transformed(*args, **kwargs), exact=True), where,
                     "df.jit(transformed) differs from calling transformed eagerly (micro-batches one after another)")
        _fail_if(first_difference(got, fn(*args, **kwargs), exact=False), where,
                 "df.jit(transformed) differs from fn")


def aten_kernels_for(args: tuple, kwargs: dict) -> str:
    """The backend that runs eager PyTorch's kernels where the example tensors live."""
    on_cuda = any(isinstance(leaf, torch.Tensor) and leaf.is_cuda for leaf in tree_leaves((args, kwargs)))
    return "cudagraph" if on_cuda else "eager"


def _fail_if(problem: str | None, where: str, what: str) -> None:
    if problem is not None:
        raise EquivalenceError(f"{what}: {problem}; in {where}")


def _draw_rows(args: tuple, kwargs: dict, axes: list[int | None] | None, num: int, draws: int) -> list[int | None]:
    """The batch size of each draw: the examples', the edge sizes, then the examples' again."""
    if axes is None:
        return [None] * draws
    sizes = {leaf.shape[axis] for leaf, axis in zip(tree_leaves((args, kwargs), none_is_leaf=True), axes)
             if axis is not None}
    if len(sizes) != 1:
        return [None] * draws
    rows = sizes.pop()
    edges = edge_batch_sizes(rows, num)
    return [edges[i] if i < len(edges) else rows for i in range(draws)]


def _microbatch_passes(transformed: Callable[..., Any]) -> list[MicrobatchPass]:
    passes = transformed.passes if isinstance(transformed, Transformed) else ()
    return [p for p in passes if isinstance(p, MicrobatchPass)]


def _microbatch_in_axes(transformed: Callable[..., Any]) -> Any:
    passes = _microbatch_passes(transformed)
    return passes[0].in_axes if passes else None


def _split_count(transformed: Callable[..., Any]) -> int:
    """How many micro-batches the batch is cut into, through every nested `T.microbatch`: the fewest rows it takes."""
    return math.prod(p.num for p in _microbatch_passes(transformed))
