"""dynaflow_fn: intra-device parallelism for PyTorch as composable function transforms.

    fn, params = df.pure(model)        # an nn.Module as a pure function of (params, *args)
    prog = df.trace(fn, params, x)     # the Program: an aten graph that prints as code
    fast = df.jit(fn)                  # trace + lower on the first call, replay a CUDA graph after
    print(fast.lower(params, x))       # the Plan: streams, steps, events, buffers
"""

__version__ = "0.1.0"

from . import distributed, optim, transforms
from .autodiff import grad, value_and_grad
from .dynamo import CompileBackend, compile_backend
from .errors import DynaflowError, InputError, ScheduleError, TraceError, TransformError, VerificationError
from .jit import CacheInfo, Jitted, jit
from .lower import lower
from .plan import Plan
from .program import Program, Stream
from .pure import pure
from .regions import region
from .trace import trace
from .transforms.schedule import Scheduler
from .verify import verify

__all__ = [
    "CacheInfo", "CompileBackend", "DynaflowError", "InputError", "Jitted", "Plan", "Program", "ScheduleError", "Scheduler", "Stream",
    "TraceError", "TransformError", "VerificationError", "compile_backend", "distributed", "grad", "jit", "lower", "optim", "pure", "region", "trace",
    "transforms", "value_and_grad", "verify",
]
