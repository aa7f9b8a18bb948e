"""df.jit's per-call checks in C++ (`checks.cpp`), built on first use for the torch and Python at hand.

A replayed call is checked twice: its leaves against the call its plan was built for (a `Guard`), and
its resident inputs' addresses against those its CUDA graph captured (the executable). A decode step
passes hundreds of weights, and torch's own C++ checks cost about 130 ns a tensor each
(torch.compile's TENSOR_MATCH guard computes the dispatch keys it compares under the thread's
settings; `torch._C._tensors_data_ptrs_at_indices_equal` converts its arguments to C++ vectors):
8.5 and 7.4 us for 65 tensors on an H200's host, where the whole call took 63. These read each
tensor's TensorImpl in place: the layouts in 1.3 us there.

They are compiled with torch.utils.cpp_extension (a C++ compiler and ninja, no network) once per
source, torch build and Python, into torch's extensions directory (TORCH_EXTENSIONS_DIR, else
~/.cache/torch_extensions): 10 to 15 s, under a progress bar, the first time; later processes load
the built library directly. Where it cannot be built, df.jit checks through torch's C++ guards
instead, after one warning that says why; DYNAFLOW_NATIVE=0 skips the build and the warning.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Sequence

import torch

from ..errors import warn
from ..ir.progress import progress_bar

NATIVE_ENV = "DYNAFLOW_NATIVE"
SOURCE = Path(__file__).with_name("checks.cpp")
_BUILT = "built"                        # the file, beside the library, that says its build finished


def leaf_checker(example: Sequence[Any], checks: Sequence[Any]) -> Callable[[Sequence[Any]], bool] | None:
    """`compat.leaf_checker`'s check (`checks` are `compat.LeafCheck`s of paths of length 2), made by
    the C++ checks, which compare each tensor's raw dispatch keys rather than those under the
    thread's settings: a tensor made under `torch.inference_mode()` matches only another such.
    None where they are not built, or cannot read a tensor of the example (a nested tensor)."""
    checks_module = module()
    if checks_module is None:
        return None
    places = [(*check.path, check.attribute) for check in checks]
    try:
        return checks_module.LeafCheck(example, places)
    except (ValueError, TypeError, IndexError, AttributeError):
        return None


def address_checker(indices: Sequence[int], addresses: Sequence[int]) -> Callable[[Sequence[Any]], bool] | None:
    """Whether `inputs[indices[k]]` starts at `addresses[k]` (its `data_ptr()`) for every k, in one C++
    call; None where the C++ checks are not built."""
    checks_module = module()
    return None if checks_module is None else checks_module.AddressCheck(list(indices), list(addresses))


@functools.cache
def module() -> ModuleType | None:
    """The built checks, built now if need be; None where DYNAFLOW_NATIVE=0 or they cannot be built."""
    if os.environ.get(NATIVE_ENV) == "0":
        return None
    name = f"dynaflow_fn_checks_{_build_key()}"
    directory = _extensions_directory() / name
    try:
        built = directory / _BUILT
        if built.exists():
            try:
                return _load(name, Path(built.read_text()))
            except (OSError, ImportError):       # the library was deleted since: build it again
                pass
        return _build(name, directory)
    except Exception as error:           # no compiler or headers, a read-only cache, a failed build ...
        warn(f"dynaflow_fn could not build its C++ call checks ({type(error).__name__}: {_first_line(error)}); "
             f"df.jit checks each call through torch's guards instead, about 0.2 us more per tensor. Set "
             f"{NATIVE_ENV}=0 to skip building them.")
        return None


def _build(name: str, directory: Path) -> ModuleType:
    """Compile the checks into `directory` (another process building them meanwhile is waited for) and
    record where the library is, for later processes to load it directly."""
    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
    with progress_bar(total=1, desc="dynaflow_fn: compiling its C++ call checks (once per torch build)",
                      leave=True) as bar, warnings.catch_warnings():
        warnings.simplefilter("ignore")          # the build's own notes (compiler versions): it works or it raises
        built = cpp_extension.load(name, [str(SOURCE)], build_directory=str(directory), extra_cflags=["-O2"],
                                   with_cuda=False, verbose=False)
        bar.update(1)
    record = directory / f"{_BUILT}.{os.getpid()}"
    record.write_text(built.__file__)
    record.replace(directory / _BUILT)
    return built


def _load(name: str, library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, library)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


def _build_key() -> str:
    """What the library depends on: the source, the torch build (its C++ ABI) and the Python."""
    parts = (SOURCE.read_bytes(), torch.__version__.encode(), str(torch.version.git_version).encode(),
             torch.__file__.encode(), sys.version.encode())
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _extensions_directory() -> Path:
    configured = os.environ.get("TORCH_EXTENSIONS_DIR")
    if configured:
        return Path(configured)
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "torch_extensions"


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "no message"
