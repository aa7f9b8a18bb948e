"""Exception types. Every error names the thing at fault (an argument path, a node, a rule) and the way out."""

from __future__ import annotations


class DynaflowError(Exception):
    """Base class of every error raised by dynaflow_fn."""


class TraceError(DynaflowError):
    """The function could not be turned into a Program (data-dependent control flow, an untraceable op, ...)."""


class InputError(DynaflowError, TypeError):
    """An argument has a structure, type, device or value that the function or transform cannot take."""


class TransformError(DynaflowError):
    """A transform was given options that do not fit the program, or was applied in an order that makes no sense."""


class ScheduleError(DynaflowError):
    """A Scheduler produced an issue order or stream assignment that is not a valid schedule."""


class VerificationError(DynaflowError):
    """A Plan failed the static happens-before check: some read or buffer reuse is not ordered."""
