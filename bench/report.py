"""Turn bench/results/*.json into bench/results/README.md (one table per benchmark) and PNG plots.

    python -m bench.report
"""

from __future__ import annotations

import json
import os

from bench.common import RESULTS
from bench.plot import plot

COLUMNS = ("case", "tree", "variant", "caches", "median_ms", "p10_ms", "p90_ms", "speedup_vs_compile", "speedup_vs_baseline",
           "speedup_vs_best_compile", "speedup_vs_df", "speedup_vs_eager", "back_to_back_ms", "back_to_back_speedup",
           "ratio_vs_hand_graph", "hidden_fraction", "peak_mem_mb", "mem_vs_baseline", "build_s", "first_call_s",
           "ready_s", "choice", "probe_wait_us", "probe_waited", "gemm_slowdown", "host_us_per_call", "share_of_call",
           "ratio_vs_this_tree",
           "tokens_per_s", "tokens_per_s_min", "tokens_per_s_max", "rounds", "vs_hf_compile_ro", "vs_compile_ro",
           "first_generate_s", "sizes_planned", "first_pass_s", "first_pass_per_size_s", "captures", "graph_mb",
           "allocated_mb", "reserved_mb", "padding_waste", "tokens_match", "mismatched", "total_s", "rel_err", "error")


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def table(record: dict) -> list[str]:
    rows = record["rows"]
    columns = [c for c in COLUMNS if any(c in row for row in rows)]
    lines = [f"## {record['name']}", "",
             f"{record['device']} x{max(record['num_gpus'], 1)}, torch {record['torch']}, CUDA {record['cuda']}, "
             f"{record['date']}", "", *([record["note"], ""] if record.get("note") else []),
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return lines + [""]


def main() -> None:
    lines = ["# Benchmark results", "",
             "Written by `python -m bench.report` from the JSON files beside this one; ratios can be recomputed "
             "from them. Times are medians of CUDA-event-timed replays.", ""]
    for name in sorted(f[:-5] for f in os.listdir(RESULTS) if f.endswith(".json")):
        with open(os.path.join(RESULTS, f"{name}.json")) as f:
            lines += table(json.load(f))
        path = plot(name)
        if path:
            lines += [f"![{name}]({os.path.basename(path)})", ""]
    with open(os.path.join(RESULTS, "README.md"), "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {os.path.join(RESULTS, 'README.md')}")


if __name__ == "__main__":
    main()
