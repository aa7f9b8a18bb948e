"""Run-time checks a plan does not run, said while tracing.

Some torch functions check their result on the device and raise from the host: `torch.linalg.inv`
raises LinAlgError for a singular matrix, `torch.linalg.cholesky` for one that is not positive
definite, through `aten._linalg_check_errors`, which reads the result's `info` on the host.
`torch._assert_async` checks a condition. Such a check returns nothing, so the trace's dead-code
pass drops it, and inside a CUDA graph it could not run anyway (it waits for the device). A plan
then returns what the kernel computed (inf or NaN for a singular matrix) where eager PyTorch
raises: tracing warns, naming the check, instead of dropping it without a word.
"""

from __future__ import annotations

import torch
from torch import fx

from ..errors import warn

_LINALG = ("the check of a torch.linalg result, which raises LinAlgError for a singular or non-positive-definite "
           "input; a plan does not run it, so such an input gives what the kernel computes (inf or NaN) instead. "
           "Check inputs outside the function: the *_ex variants (torch.linalg.inv_ex, cholesky_ex) return the "
           "info tensor")
_ASSERT = ("torch._assert_async; a plan does not run it, so a call whose condition fails returns its results "
           "instead of raising. Check the condition outside the function")
_CHECKS = {
    torch.ops.aten._linalg_check_errors.default: _LINALG,
    torch.ops.aten._assert_async.default: _ASSERT,
    torch.ops.aten._assert_async.msg: _ASSERT,
}


def warn_dropped_checks(graph: fx.Graph, name: str) -> None:
    """Warn once per kind of run-time check in the traced `graph` of function `name`."""
    for check in dict.fromkeys(_CHECKS[node.target] for node in graph.nodes if node.target in _CHECKS):
        warn(f"{name} runs {check}.")
