"""Run every benchmark this machine can run, then write the report.

    python -m bench              # 1 GPU: overhead, host_parts, single_gpu, inductor, substitute, train, streams, coldstart, serving;
                                 # N >= 2 GPUs: also tp and dp under torchrun;
                                 # no GPU: only the trace + lower timing (bench.overhead --trace), nothing written
    python -m bench --report     # only rebuild bench/results/README.md and the plots from the JSON files
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys

import torch

SINGLE_GPU = ("bench.overhead", "bench.host_parts", "bench.single_gpu", "bench.inductor", "bench.substitute", "bench.train", "bench.streams",
              "bench.coldstart", "bench.serving")
MULTI_GPU = ("bench.tp", "bench.dp")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", action="store_true", help="only write the report from existing results")
    options = parser.parse_args()
    if not options.report:
        if not torch.cuda.is_available():
            run_without_gpu()
            return
        for module in SINGLE_GPU:
            subprocess.run([sys.executable, "-m", module], check=True)
        gpus = torch.cuda.device_count()
        if gpus >= 2:
            for module in MULTI_GPU:
                subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={gpus}", "-m",
                                module], check=True)
    from bench import report

    report.main()


def run_without_gpu() -> None:
    """What a machine without CUDA can measure: how long tracing and lowering take (host work).

    Its numbers are printed, never written: bench/results/ holds one GPU machine's measurements,
    and a CPU's times beside them would read as that machine's."""
    print("No CUDA device, so these are skipped: bench.overhead's per-call timings, " + ", ".join(SINGLE_GPU[1:])
          + " (they time GPU work), " + " and ".join(MULTI_GPU) + " (2 or more GPUs) and the report. Nothing is "
          "written to bench/results/, which holds GPU measurements.", flush=True)
    if importlib.util.find_spec("transformers") is None:
        print("Skipping the trace + lower timing too: it builds a transformers Llama, and transformers is not "
              "installed (pip install -e '.[examples]').", flush=True)
        return
    print("Running the part that needs no GPU: bench.overhead --trace (trace + lower a 32-layer "
          "Llama-3-8B-like model with parameters on the meta device).", flush=True)
    subprocess.run([sys.executable, "-m", "bench.overhead", "--trace"], check=True)


if __name__ == "__main__":
    main()
