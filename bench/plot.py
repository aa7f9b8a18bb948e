"""Plot benchmark results: one PNG per results file, speedup of each variant against its baseline.

    python -m bench.plot                      # every bench/results/*.json that has ratios
    python -m bench.plot single_gpu overhead  # chosen ones
"""

from __future__ import annotations

import json
import os
import sys

from bench.common import RESULTS

RATIO_KEYS = ("speedup_vs_baseline", "speedup_vs_eager")


def plot(name: str) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(os.path.join(RESULTS, f"{name}.json")) as f:
        record = json.load(f)
    rows = [r for r in record["rows"] if any(k in r for k in RATIO_KEYS)]
    if not rows:
        return None
    key = next(k for k in RATIO_KEYS if k in rows[0])
    rows = [r for r in rows if not r["variant"].endswith("-alone")]
    labels, values, colors = [], [], []
    palette = plt.get_cmap("tab10")
    for c_index, case in enumerate(dict.fromkeys(r["case"] for r in rows)):
        for row in (r for r in rows if r["case"] == case):
            labels.append(f"{case}  |  {row['variant']}")
            values.append(row[key])
            colors.append(palette(c_index % 10))
    figure, axes = plt.subplots(figsize=(9, 0.28 * len(rows) + 1.2))
    positions = list(range(len(rows)))[::-1]
    axes.barh(positions, values, color=colors)
    for y, v in zip(positions, values):
        axes.text(v, y, f" {v:.3f}", va="center", fontsize=7)
    axes.axvline(1.0, color="black", linewidth=0.8)
    axes.set_yticks(positions)
    axes.set_yticklabels(labels, fontsize=7)
    axes.set_xlabel(key.replace("_", " "))
    axes.set_xlim(0, max(values) * 1.15)
    axes.set_title(f"{name} on {record['device']} (torch {record['torch']})", fontsize=9)
    figure.tight_layout()
    path = os.path.join(RESULTS, f"{name}.png")
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def main() -> None:
    names = sys.argv[1:] or sorted(f[:-5] for f in os.listdir(RESULTS) if f.endswith(".json"))
    for name in names:
        path = plot(name)
        if path:
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
