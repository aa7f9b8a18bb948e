"""Which modules' train/eval mode a trace depends on: the ones whose `training` flag it read.

A traced program bakes in every `module.training` that Python code read while tracing: dropout and
batch norm read their own, Hugging Face attention reads it to pick its dropout, and a function may
branch on `model.training` without calling `model` at all. Only those flags need checking on each
call; a Llama-like stack with fifty modules and no dropout then checks none.

While a trace runs, `nn.Module` carries a `training` data descriptor, which Python consults before an
instance's `__dict__`. It returns the flag stored there, as before, and on the tracing thread records
the module and the value it saw. Other threads read and write the flag exactly as without it. A
module class that defines `training` itself shadows the descriptor; such modules, when called, are
recorded by the caller (see `shadows_flag`).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

_local = threading.local()


class _RecordedFlag:
    """`nn.Module.training` while a trace runs: the instance's own flag, recorded when read."""

    def __get__(self, module: torch.nn.Module | None, owner: type) -> object:
        if module is None:
            return self
        if "training" not in module.__dict__:      # not set yet: what the lookup would find without this flag
            return type(module).__getattr__(module, "training")
        value = module.__dict__["training"]
        reads = getattr(_local, "reads", None)
        if reads is not None:
            reads.setdefault(id(module), (module, value))
        return value

    def __set__(self, module: torch.nn.Module, value: bool) -> None:
        module.__dict__["training"] = value

    def __delete__(self, module: torch.nn.Module) -> None:
        del module.__dict__["training"]


_FLAG = _RecordedFlag()
_installed = 0
_install_lock = threading.Lock()


@contextlib.contextmanager
def recording_mode_reads() -> Iterator[dict[int, tuple[torch.nn.Module, bool]]]:
    """Record, on this thread, every module whose `training` flag is read inside the block, with the
    value read, in order of first read. Nested blocks share the outer block's record, since what an
    inner trace reads the outer program depends on too."""
    global _installed
    outer = getattr(_local, "reads", None)
    if outer is not None:
        yield outer
        return
    with _install_lock:
        if _installed == 0:
            torch.nn.Module.training = _FLAG
        _installed += 1
    _local.reads = reads = {}
    try:
        yield reads
    finally:
        _local.reads = None
        with _install_lock:
            _installed -= 1
            if _installed == 0:
                del torch.nn.Module.training


def shadows_flag(module: torch.nn.Module) -> bool:
    """Whether the module's class defines `training` itself, so its reads are not recorded."""
    for cls in type(module).__mro__:
        if cls is torch.nn.Module:
            return False
        if "training" in cls.__dict__:
            return True
    return False
