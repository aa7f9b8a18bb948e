"""The per-call check of df.jit in C++ against the same check in Python, side by side, on the CPU.

    python -m bench.guard_check                  # the eager runtime on the CPU: needs no GPU
    python -m bench.guard_check --device cuda    # the CUDA-graph runtime, where parameters are read in place

A 16-layer MLP (LayerNorm + Linear per layer: 64 weight tensors), batch 1, called two ways: with its
parameters as a dict (`fast(params, x)`: 65 tensor leaves to check) and with them closed over
(`fast(x)`: one leaf and 64 closed-over tensors). Each is jitted twice in one process, its guard built
with the C++ check (torch's guard manager, `jitting/guard.py`) and with the Python one
(DYNAFLOW_PYTHON_GUARD=1, what every guard checked with before). For each it prints the microseconds of
`Guard.admits` alone and of the whole call, under torch.no_grad (as a decoding loop calls), and the
parts of a call that stay in Python either way: flattening the arguments, reading `call_state`, and
comparing the pytree structure. Times are the best of several rounds of back-to-back calls (the least
disturbed by other work on the machine). Prints a table; writes nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from typing import Any, Callable, Iterator

import optree
import torch

import dynaflow_fn as df
from bench.common import print_table
from bench.overhead import LaunchBound
from dynaflow_fn.jitting import guard as guard_module
from dynaflow_fn.jitting.guard import Guard, call_state

WIDTH, LAYERS = 64, 16


def best_us(fn: Callable[[], Any], calls: int, rounds: int = 7) -> float:
    """Microseconds per call of `fn`: the fastest of `rounds` rounds of `calls` back-to-back calls."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    sync()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


@contextlib.contextmanager
def python_check_forced(forced: bool) -> Iterator[None]:
    """Guards built inside check in Python (DYNAFLOW_PYTHON_GUARD=1) if `forced`, else in C++."""
    previous = os.environ.pop(guard_module.PYTHON_GUARD_ENV, None)
    if forced:
        os.environ[guard_module.PYTHON_GUARD_ENV] = "1"
    try:
        yield
    finally:
        os.environ.pop(guard_module.PYTHON_GUARD_ENV, None)
        if previous is not None:
            os.environ[guard_module.PYTHON_GUARD_ENV] = previous


def jitted(fn: Callable[..., Any], args: tuple, backend: str) -> Callable[..., Any]:
    """df.jit(fn), called twice on `args` so that its plan and its guard exist."""
    fast = df.jit(fn, backend=backend, progress=False)
    fast(*args)
    fast(*args)
    return fast


def rows(device: torch.device, calls: int) -> list[dict]:
    torch.manual_seed(0)
    model = LaunchBound(WIDTH, LAYERS).to(device).eval()
    fn, params = df.pure(model)
    x = torch.randn(1, WIDTH, device=device)
    backend = "cudagraph" if device.type == "cuda" else "eager"
    weights = list(params.values())
    cases = {"params dict": (fn, (params, x), []), "closed over": (lambda x: fn(params, x), (x,), weights)}
    table = []
    for case, (function, args, closed_over) in cases.items():
        leaves, treedef = optree.tree_flatten((args, {}))
        state = call_state()
        for label, python_check in (("C++", False), ("Python", True)):
            with python_check_forced(python_check):
                fast = jitted(function, args, backend)
                guard = Guard(treedef, leaves, state, closed_over=closed_over)   # the guard df.jit builds
            assert guard.admits(treedef, leaves, state)
            table.append({"case": case, "check": label, "leaves": len(leaves), "closed_over": len(closed_over),
                          "admits_us": best_us(lambda: guard.admits(treedef, leaves, state), calls * 10),
                          "call_us": best_us(lambda: fast(*args), calls)})
        flatten_us = best_us(lambda: optree.tree_flatten((args, {})), calls * 10)
        table.append({"case": case, "check": "(Python either way)", "leaves": len(leaves),
                      "flatten_us": flatten_us, "call_state_us": best_us(call_state, calls * 10),
                      "treedef_eq_us": best_us(lambda: treedef == guard.treedef, calls * 10)})
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu (the eager runtime) or cuda (the CUDA-graph runtime)")
    parser.add_argument("--calls", type=int, default=300, help="back-to-back whole calls per round")
    options = parser.parse_args()
    torch.set_num_threads(1)
    with torch.no_grad():
        table = rows(torch.device(options.device), options.calls)
    print_table(table, ["case", "check", "leaves", "closed_over", "admits_us", "call_us", "flatten_us",
                        "call_state_us", "treedef_eq_us"],
                f"df.jit's per-call check: {LAYERS}-layer MLP of width {WIDTH} (64 weights) on {options.device}, "
                f"torch {torch.__version__}; microseconds per call, best of 7 rounds")


if __name__ == "__main__":
    main()
