"""Run every benchmark this machine can run, then write the report.

    python -m bench              # 1 GPU: overhead, single_gpu, inductor, train, streams;
                                 # N >= 2 GPUs: also tp and dp under torchrun
    python -m bench --report     # only rebuild bench/results/README.md and the plots from the JSON files
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import torch

SINGLE_GPU = ("bench.overhead", "bench.single_gpu", "bench.inductor", "bench.train", "bench.streams")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", action="store_true", help="only write the report from existing results")
    options = parser.parse_args()
    if not options.report:
        if not torch.cuda.is_available():
            sys.exit("the benchmarks time GPU work and need CUDA; use --report to rebuild the report")
        for module in SINGLE_GPU:
            subprocess.run([sys.executable, "-m", module], check=True)
        gpus = torch.cuda.device_count()
        if gpus >= 2:
            for module in ("bench.tp", "bench.dp"):
                subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={gpus}", "-m",
                                module], check=True)
    from bench import report

    report.main()


if __name__ == "__main__":
    main()
