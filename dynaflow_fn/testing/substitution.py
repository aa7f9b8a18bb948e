"""`check_substitution`: a substitution computes what the code it replaces computes, on every shape."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from ..transforms.partition_rules import Rule
from ..transforms.substituting import substitute
from .equivalence import assert_equivalent


def check_substitution(fn: Callable[..., Any], rules: Mapping[Rule, Callable[..., Any]], *example_args: Any,
                       draws: int = 3, in_axes: Any = None, seed: int | None = None,
                       tolerances: Mapping[torch.dtype, tuple[float, float]] | None = None,
                       **example_kwargs: Any) -> None:
    """Check `T.substitute(fn, rules)` against `fn` on fresh inputs of several shapes.

    Each draw (see `assert_equivalent`; `in_axes` names the batch axes to vary, as `T.microbatch`
    takes it) traces the substitution for the draw's shapes with `check=True`, so every matched
    region and its implementation are first compared on random inputs of exactly those shapes, against
    the region run in float64 (a TransformError shows the largest difference), then runs the jitted
    function against `fn` within the dtype's tolerance. An implementation right only for the
    example's shapes fails on an edge shape (a batch of one, an uneven split)."""
    substituted = substitute(fn, dict(rules), check=True, tolerances=tolerances)
    assert_equivalent(fn, substituted, *example_args, draws=draws, in_axes=in_axes, seed=seed, **example_kwargs)
