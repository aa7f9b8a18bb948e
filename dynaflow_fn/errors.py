"""Exception types, and warnings attributed to the user's line.

Every error names the thing at fault (an argument path, a node, a rule) and the way out.
"""

from __future__ import annotations

import inspect
import os
import site
import sysconfig
import warnings

import optree
import torch


class DynaflowError(Exception):
    """Base class of every error raised by dynaflow_fn."""


class TraceError(DynaflowError):
    """The function could not be turned into a Program (data-dependent control flow, an untraceable op, ...)."""


class InputError(DynaflowError, TypeError):
    """An argument has a structure, type, device or value that the function or transform cannot take."""


class UnpaddableError(InputError):
    """Padding a function's batch to a bucket would not give its real rows' results. Raised where the
    caller chose the padding itself and can plan each size instead (`df.compile_backend`), which says
    why in its own words: `reason`."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


class PaddedUpdateError(UnpaddableError):
    """A function given buckets updates in place an input that in_axes pads: the update would land in the
    padded copy. Raised for every caller: `updated` names those inputs."""

    def __init__(self, message: str, updated: list[str]):
        super().__init__(message, f"it updates {', '.join(updated)} in place, which hold the batch's rows, and a "
                                  f"padded copy would take the update instead of the caller's tensor (a KV cache made "
                                  f"for each batch, as transformers' StaticCache is)")
        self.updated = updated


class TransformError(DynaflowError):
    """A transform was given options that do not fit the program, or was applied in an order that makes no sense."""


class ScheduleError(DynaflowError):
    """A Scheduler produced an issue order or stream assignment that is not a valid schedule."""


class DistributedError(DynaflowError):
    """Ranks disagree about the collectives they are about to run, or a rank did not join in time."""


class VerificationError(DynaflowError):
    """A Plan failed the static happens-before check: some read or buffer reuse is not ordered."""


class GradientError(DynaflowError, RuntimeError):
    """A call that eager autograd refuses, or whose effect on the autograd graph a compiled plan cannot
    reproduce: an in-place update, inside the function, of a tensor that requires grad."""


class KernelError(DynaflowError, RuntimeError):
    """A kernel of a plan failed on the tensors it was given, though tracing had accepted the op: the
    failure depends on the values (an index out of range), or torch's shape-only (meta) kernels, which
    tracing runs, check less than some real ones do (the dtypes of a matrix product's operands). The
    message names the op, its node and its operands; eager PyTorch raises the same error (the cause) at
    the line that calls the op. An op that runs but cannot be captured into a CUDA graph fails the same
    way, and the message says so."""


class KernelIndexError(KernelError, IndexError):
    """A `KernelError` from an index out of range (`embedding` of a token id past the table, on the
    CPU): an IndexError too, as eager PyTorch's error is."""


class InternalError(DynaflowError, AssertionError):
    """An invariant of dynaflow_fn itself broke: a bug in dynaflow_fn, not in the caller's code.
    The message names the invariant; please report it with the code that raised it."""


class EquivalenceError(DynaflowError, AssertionError):
    """A check of `dynaflow_fn.testing` found two computations that must agree and do not: a transformed
    function and the original, a scheduled plan and the sequential one, two plannings of one program.
    An AssertionError, as `torch.testing.assert_close` raises, so test runners report a failed test."""


class BackwardError(DynaflowError, RuntimeError):
    """Backward reached a tensor that no autograd graph stands behind (an output of a df.jit plan).
    A RuntimeError, like the error torch's own autograd raises for it."""


KERNEL_ERRORS = (RuntimeError, TypeError, ValueError, IndexError)
"""What torch's kernels raise for inputs they cannot take (`torch._check` and its variants, TORCH_CHECK
in C++; NotImplementedError and torch.OutOfMemoryError are RuntimeErrors): a probe that runs a kernel
catches these and no more, so a bug elsewhere still surfaces."""


_LIBRARY_DIRS = tuple(os.path.dirname(path) + os.sep for path in (__file__, torch.__file__, optree.__file__))
_GENERATED_CODE = "<eval_with_key>"    # the source name of code that torch.fx generates
_INSTALLED_DIRS = tuple({os.path.join(path, "") for path in (*site.getsitepackages(), site.getusersitepackages(),
                                                            sysconfig.get_path("purelib"), sysconfig.get_path("platlib"))})
_STANDARD_LIBRARY_DIRS = tuple({os.path.join(sysconfig.get_path(name), "") for name in ("stdlib", "platstdlib")})


class ResidentInputMoved(Exception):
    """Control flow, never seen by users: a resident tensor (one a CUDA graph reads at its own address)
    arrived at a new address, so the graph must be captured again (df.jit does)."""




class MetaKernelRejection(RuntimeError):
    """An op's fake (meta) kernel rejected its inputs, and so did the real kernel (`confirmed`), or no
    real kernel could be asked (the meta device, an op outside aten)."""

    def __init__(self, op: object, message: str, confirmed: bool):
        super().__init__(message)
        self.op = op
        self.confirmed = confirmed


class OutsideValueRead(RuntimeError):
    """A traced function read the value of a tensor it does not receive (a module buffer, a closed-over
    tensor) as a Python value; the tracer words it as a TraceError naming the user's line."""

    def __init__(self, op: object):
        super().__init__(f"{op} reads the value of a tensor the traced function does not receive")
        self.op = op


STRICT_ENV = "DYNAFLOW_STRICT"


def strict() -> bool:
    """Whether a broken invariant that dynaflow_fn could survive (a strategy=auto candidate whose plan
    fails verification) raises instead of being skipped with a warning: under test suites, set by
    `dynaflow_fn.testing.pytest_plugin`, or by DYNAFLOW_STRICT=1."""
    return os.environ.get(STRICT_ENV, "") not in ("", "0")


def is_library_file(filename: str) -> bool:
    """Whether code in `filename` belongs to dynaflow_fn, a library it runs the user's code through
    (torch, optree, torch.fx's generated code) or Python's standard library (`contextlib`, `functools`),
    rather than to the user. Other installed packages (transformers) are model code: see
    `is_installed_package_file`."""
    return (filename.startswith(_LIBRARY_DIRS) or filename.startswith(_GENERATED_CODE)
            or (filename.startswith(_STANDARD_LIBRARY_DIRS) and not is_installed_package_file(filename)))


def is_installed_package_file(filename: str) -> bool:
    """Whether `filename` lies in an installed package (site-packages): code the user runs but did not
    write here, so a line of their own is the better one to name."""
    return filename.startswith(_INSTALLED_DIRS)


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """Issue a warning attributed to the user's line: the innermost calling frame outside dynaflow_fn,
    torch and optree.

    A fixed `stacklevel` points at whichever internal function happens to sit that many calls up,
    which depends on the path that reached the warning (`df.trace`, `df.jit`, a transform applied to
    a Program); the user's line is what they can change, and what warning filters by module match.
    """
    caller = inspect.currentframe().f_back
    frame = caller
    while frame is not None and is_library_file(frame.f_code.co_filename):
        frame = frame.f_back
    frame = frame or caller
    warnings.warn_explicit(message, category, frame.f_code.co_filename, frame.f_lineno,
                           module=frame.f_globals.get("__name__", "<unknown>"),
                           registry=frame.f_globals.setdefault("__warningregistry__", {}))
