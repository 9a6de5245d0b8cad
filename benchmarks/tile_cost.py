"""What a tile (forward) or a task (backward) costs however few blocks it has, from the ``probe-tiles`` stage's CSV
(tools/gpu_session.py): one problem's work (B * S^2 of B=1, S=16k) run as B = 1, 4, 16, 64 sequences of S = 16k,
8k, 4k, 2k, so the query tiles of 128 rows (B * H * S / 128) grow 4x a row while the pairs stay. For each method,
pass and causal setting, the least-squares line of time against tiles per SM: its slope is the cost of a tile, its
intercept the work's. Causal rows also gain a diagonal block's upper half per tile (B * n(n+1)/2 blocks
of n = S / 128 per head: +5 % from B=1 to B=64), which the causal slope holds beside the tile's fixed cost. No GPU:

    python -m benchmarks.tile_cost CSV [--png PNG] [--sms 132]
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import defaultdict


def groups(path: str, sms: int) -> dict:
    """{(method, pass, causal): [(tiles per SM, ms), ...]} of the CSV's rows, tiles of 128 query rows."""
    out = defaultdict(list)
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if r.get("error") or not r.get("ms_median"):
                continue
            B, H, S = int(r["batch"]), int(r["heads"]), int(r["seq_local"])
            out[(r["method"], r["pass"], r["causal"])].append((B * H * (S // 128) / sms, float(r["ms_median"])))
    return out


def fit(path: str, sms: int = 132) -> list:
    """One line per group: (method, pass, causal, us per tile, ms of the work, the rows)."""
    import numpy as np

    lines = []
    for (method, p, causal), pts in sorted(groups(path, sms).items()):
        pts.sort()
        if len(pts) < 2:
            continue
        slope, intercept = np.polyfit([x for x, _ in pts], [y for _, y in pts], 1)
        lines.append((method, p, causal, slope * 1000, intercept, pts))
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--png", default=None)
    ap.add_argument("--sms", type=int, default=132, help="the GPU's SMs (H200: 132)")
    a = ap.parse_args(argv)
    lines = fit(a.csv, a.sms)
    print(f"$ python -m benchmarks.tile_cost {a.csv}" + (f" --png {a.png}" if a.png else ""))
    print("| method | pass | causal | us a tile | ms of the work | ms at tiles per SM |")
    print("|---|---|---|---|---|---|")
    for method, p, causal, us, ms0, pts in lines:
        at = ", ".join(f"{y:.3f} @ {x:.0f}" for x, y in pts)
        print(f"| {method} | {p} | {causal} | {us:.2f} | {ms0:.3f} | {at} |")
    if a.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        passes = sorted({p for _, p, *_ in lines})
        fig, axes = plt.subplots(1, len(passes), figsize=(6 * len(passes), 4.5), squeeze=False)
        for ax, p in zip(axes[0], passes):
            for method, lp, causal, us, ms0, pts in lines:
                if lp != p:
                    continue
                xs = [x for x, _ in pts]
                ax.plot(xs, [y for _, y in pts], marker="o", ls="-" if causal == "1" else "--",
                        label=f"{method} {'causal' if causal == '1' else 'full'}: {us:.1f} us/tile")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("query tiles (128 rows) per SM, at equal pairs (B=1 S=16k ... B=64 S=2k)")
            ax.set_ylabel("ms per call (back to back)")
            ax.set_title(f"{p}: time against tiles at fixed work")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(a.png, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
