"""What goes wrong while a function is traced, said in the user's terms.

A failure inside torch while tracing (mismatched shapes, a value read of a fake tensor, an op with
no fake kernel) becomes a one-line `TraceError` that names the user's line and what to do
(`translating_errors`); the function's own exceptions and dynaflow_fn's errors pass unchanged.
Reads of the value of a tensor the function does not receive, which FakeTensorMode would answer
from the real tensor and bake in, are refused here too (`refusing_outside_value_reads`).
"""

from __future__ import annotations

import contextlib
import os
import re
import traceback
from typing import Any, Iterator

import torch

from ..compat import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedOperatorException,
    refusing_value_reads_of_outside_tensors,
)
from ..errors import (DynaflowError, MetaKernelRejection, OutsideValueRead, TraceError, is_installed_package_file,
                      is_library_file)
from ..ir.formatting import op_name


def refusing_outside_value_reads() -> contextlib.AbstractContextManager:
    """Enter inside make_fx's trace: a read of the value of a tensor the function did not receive (as
    a number, a bool, a list) raises OutsideValueRead, which `translating_errors` words."""
    return refusing_value_reads_of_outside_tensors(OutsideValueRead)


_READS = {"_local_scalar_dense.default": "as a Python number: float(), int(), .item(), an index or size",
          "is_nonzero.default": "as a bool", "equal.default": "torch.equal", "tolist": ".tolist()",
          "numpy": ".numpy()", "__array__": "numpy.asarray"}
"""How each read of a tensor's data that `refusing_outside_value_reads` refuses looks in the user's code."""

_TRACER_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tracer.py")
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_COMPAT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "compat") + os.sep


def user_frame(tb: Any) -> traceback.FrameSummary | None:
    """The line of the traced function's code where the error arose: the innermost frame inside the
    trace (after `flat_body`; the caller's own line that started the trace is not the culprit) that
    belongs to neither the standard library, torch nor dynaflow_fn, preferring the user's own files
    to installed packages (a line of theirs that calls transformers, over transformers' own)."""
    frames = traceback.extract_tb(tb)
    entry = next((i for i in reversed(range(len(frames))) if frames[i].name == "flat_body"
                  and frames[i].filename == _TRACER_FILE), None)
    inside = [f for f in frames[entry + 1:] if not is_library_file(f.filename) and not f.filename.startswith("<")] \
        if entry is not None else []
    own = [f for f in inside if not is_installed_package_file(f.filename)]
    return (own or inside or [None])[-1]


def _where(error: BaseException) -> str:
    frame = user_frame(error.__traceback__)
    if frame is None:
        return "in the traced function"
    return f"at {frame.filename}:{frame.lineno}: `{(frame.line or '').strip()}`"


def _raised_inside_torch(error: BaseException) -> bool:
    """Whether the innermost frame of the error is torch's (a kernel or check), or compat's wrapping
    one of torch's calls (`x.numpy()` of a fake tensor), not the function's own `raise` (which
    reaches the caller unchanged) nor the rest of dynaflow_fn's."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and frames[-1].filename.startswith((_TORCH_DIR, _COMPAT_DIR))


def _first_lines(error: BaseException, count: int = 3) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return " ".join(lines[:count]) + (" ..." if len(lines) > count else "")


_HIGHER_ORDER_WITHOUT_RULE = re.compile(r"no rule registered for HigherOrderOperator (\w+)")   # torch's words


def _hint(error: BaseException) -> str:
    text = str(error)
    if "numpy" in text or "data pointer" in text or "data_ptr" in text:
        return (" A traced function runs on fake tensors, which hold no data: keep the computation in torch "
                "ops, or move the code that needs values (numpy, printing, I/O) out of the jitted function.")
    return ""


def _traced_error(message: str, original: BaseException) -> TraceError:
    """A TraceError that replaces `original` in the traceback (its own is long and names torch's
    internals); `original` stays reachable for debugging."""
    error = TraceError(message)
    error.original = original
    return error


@contextlib.contextmanager
def translating_errors(fn_name: str) -> Iterator[None]:
    """Turn failures inside torch while tracing into TraceErrors that point at the user's line and
    say what to do. Exceptions the function raises itself, and dynaflow_fn's own errors, pass unchanged."""
    try:
        yield
    except DynaflowError:
        raise
    except DynamicOutputShapeException as error:
        raise _traced_error(
            f"{fn_name} calls {error.func} {_where(error)}, whose output shape depends on tensor data (boolean-mask "
            f"indexing, nonzero, unique, ...). A Plan has fixed shapes: keep the shape static with torch.where, "
            f"masked_fill or a fixed-size top-k instead.", error) from None
    except OutsideValueRead as error:
        raise _traced_error(
            f"{fn_name} reads the value of a tensor it does not receive as an argument (a module buffer, a closed-over "
            f"or global tensor) {_where(error)} ({_READS.get(error.op.__name__, error.op.__name__)}). A plan would "
            f"keep the value the tensor had while being traced, where eager PyTorch reads it anew on every call (and "
            f"sees the function's own updates of it). Use it as a tensor in torch ops (`x * s`, torch.where), or "
            f"pass the value as a Python scalar argument (a static argument: each distinct value is traced once).",
            error) from None
    except DataDependentOutputException as error:
        raise _traced_error(
            f"{fn_name} reads the value of a tensor {_where(error)} ({error.func}). A traced program has one fixed "
            f"sequence of ops, so Python control flow cannot depend on tensor data. Compute both branches and "
            f"select with torch.where, or pass the deciding value as a Python scalar (a static argument: each "
            f"distinct value is traced once).", error) from None
    except UnsupportedOperatorException as error:
        raise _traced_error(
            f"{fn_name} calls {error.func} {_where(error)}, which has no fake-tensor (meta) implementation. Register "
            f"one with torch.library.register_fake, or keep that op outside the jitted function.", error) from None
    except MetaKernelRejection as error:
        verdict = ("eager PyTorch rejects these inputs too" if error.confirmed else
                   "its fake-tensor kernel rejects the inputs and no real kernel could be asked (trace with tensors "
                   "on a real device instead of meta)")
        raise _traced_error(f"{fn_name} calls {op_name(error.op)} {_where(error)} on inputs it cannot take: "
                            f"{_first_lines(error)} ({verdict}).", error) from None
    except NotImplementedError as error:
        if not (operator := _HIGHER_ORDER_WITHOUT_RULE.search(str(error))) or not _raised_inside_torch(error):
            raise
        raise _traced_error(f"{fn_name} calls {operator[1]} {_where(error)}, a higher-order operator that fake "
                            f"tensors cannot run under dynaflow_fn's tracer (activation checkpointing's replay of "
                            f"random numbers: run_and_save_rng_state, run_with_rng_state). Keep random ops out of "
                            f"checkpointed regions, or the region outside the jitted function.", error) from None
    except Exception as error:
        if not _raised_inside_torch(error):
            raise
        raise _traced_error(f"{fn_name} failed {_where(error)} while being traced: {type(error).__name__}: "
                            f"{_first_lines(error)}{_hint(error)}", error) from None
