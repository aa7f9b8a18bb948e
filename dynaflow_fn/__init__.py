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
from .ir.program import Program, Stream
from .jitting.jitted import CacheInfo, Jitted, jit
from .lowering.lower import lower
from .plan.plan import Plan
from .plan.verify import verify
from .pure import pure
from .tracing.regions import region
from .tracing.tracer import trace
from .transforms.schedule import Scheduler

__all__ = [
    "CacheInfo", "CompileBackend", "DynaflowError", "InputError", "Jitted", "Plan", "Program", "ScheduleError", "Scheduler", "Stream",
    "TraceError", "TransformError", "VerificationError", "compile_backend", "distributed", "grad", "jit", "lower", "optim", "pure", "region", "trace",
    "transforms", "value_and_grad", "verify",
]
