"""Where the host time of one df.jit call goes: bench/overhead.py's launch-bound model, part by part.

A decoding loop waits for every step, so the host time of a call is paid on every token. This times
each part of a call on its own, through the objects the call runs (internals, not public API: the
names below say which), with the device queue nearly empty:

  df call (params dict)        fast(params, x), the whole call
  df call (closed over)        the same with the parameters closed over: fast(x)
  hand graph                   a torch.cuda.graph captured by hand: copy the input, replay, clone the output
  call_state()                 the process-wide state a plan depends on (autocast, matmul precision, ...)
  guard.admitted_leaves        the per-call check: the call's leaves by the last call's structure, every
                               leaf, the module flags, the state
  guard.flatten_known          its flatten, by a function written for the structure (`call.flattener`)
  guard.fit (C++)              its check of the leaves, one call into dynaflow_fn's C++ checks (or torch's guards)
  replayer.replay              the part after the guard: the executable and the outputs' structure
  executable                   the CUDA-graph executable: input copy, replay, handing out the outputs
  graph.replay()               the replay alone
  input copy_                  one copied-in input
  handouts                     whether a caller holds the last outputs, and the new handouts
  turns                        the lock and stream check calls take turns with
  resident addresses           the check that every resident input is at its captured address (one C++ call)
  free capture                 the choice of a capture no caller holds the outputs of
  load inputs                  the copied-in inputs' copies, with their checks
  executable, replay left out  the executable with its graph's replay made a no-op

Host microseconds per part: the median over rounds of `inner` calls each, the device synchronized
between rounds. Written to bench/results/overhead-parts.json.

    python -m bench.host_parts
"""

from __future__ import annotations

import optree
import torch

import dynaflow_fn as df
from bench.common import print_table, time_host, write_results
from bench.overhead import LAYERS, WIDTH, LaunchBound, hand_graph
from dynaflow_fn.jitting.guard import call_state


def host_us(fn) -> float:
    return time_host(fn, repeats=30, inner=20)["median_ms"] * 1e3


def part_rows() -> list[dict]:
    torch.manual_seed(0)
    model = LaunchBound().cuda().eval()
    fn, params = df.pure(model)
    x = torch.randn(1, WIDTH, device="cuda")
    fast = df.jit(fn, progress=False)
    closed = df.jit(lambda x: fn(params, x), progress=False)
    hand = hand_graph(model, x)
    parts = {}
    with torch.no_grad():
        torch.testing.assert_close(fast(params, x), model(x), rtol=1e-4, atol=1e-4)
        closed(x)
        replayer = fast._last
        guard, executable = replayer.guard, replayer.executable
        call = ((params, x), {})
        leaves = optree.tree_flatten(call)[0]
        tensors = replayer.tensors_of(leaves)
        capture = executable.captures[0]
        static, state = executable.static_inputs[executable.copied[0]], call_state()
        turns = executable.turns
        parts["df call (params dict)"] = host_us(lambda: fast(params, x))
        parts["df call (closed over)"] = host_us(lambda: closed(x))
        parts["hand graph"] = host_us(lambda: hand(x))
        parts["call_state()"] = host_us(call_state)
        parts["guard.admitted_leaves"] = host_us(lambda: guard.admitted_leaves(call, state))
        parts["guard.flatten_known"] = host_us(lambda: guard.flatten_known(call))
        parts["guard.fit (C++)"] = host_us(lambda: guard.fit((leaves, guard.fixed)))
        parts["replayer.replay"] = host_us(lambda: replayer.replay(leaves))
        parts["executable"] = host_us(lambda: executable(tensors))
        parts["graph.replay()"] = host_us(capture.graph.replay)
        parts["input copy_"] = host_us(lambda: static.copy_(x))
        parts["handouts"] = host_us(lambda: capture.free() and capture.results(tensors))
        parts["turns"] = host_us(lambda: (turns.__enter__(), turns.__exit__(None, None, None)))
        parts["resident addresses"] = host_us(lambda: executable.at_captured_addresses(tensors))
        parts["free capture"] = host_us(lambda: executable._free_capture(tensors))
        parts["load inputs"] = host_us(lambda: executable.copy_in(tensors))
        capture.graph.replay = lambda: None
        parts["executable, replay left out"] = host_us(lambda: executable(tensors))
        del capture.graph.replay
    whole = parts["df call (params dict)"]
    case = f"{LAYERS} layers x {WIDTH}, batch 1, {len(tensors)} tensors"
    return [{"case": case, "variant": name, "host_us_per_call": us, "share_of_call": us / whole}
            for name, us in parts.items()]


def main() -> None:
    rows = part_rows()
    print_table(rows, ["case", "variant", "host_us_per_call", "share_of_call"], "host time of one call, part by part")
    print(f"\nwrote {write_results('overhead-parts', rows)}")


if __name__ == "__main__":
    main()
