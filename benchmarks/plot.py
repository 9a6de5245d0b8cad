"""Plot the harness's CSV: TFLOP/s per GPU against sequence length, one line per method (and world size),
one panel per (pass, causal, dtype, head_dim, heads/kv_heads, mask, layout): the fwd and fwd+bwd timings of a
case are side by side, never on one axis, and so are a masked case and its unmasked twin. Runs on a CPU machine (needs matplotlib: the ``bench`` extra); the GPU
machine only writes the CSV.

    python -m benchmarks.plot benchmarks/results/x.csv --out benchmarks/results/x.png --table

Several CSVs may be given (their rows are pooled; a CSV written before the ``pass`` column existed holds
fwd rows). Where a (method, world, case, pass) was run more than once, the last row in the file counts.
The x axis is the global sequence length (``--x global``, default: a 2-GPU ring case, its single-GPU
share and the world-1 fused run of the same problem line up) or seq_local (``--x local``). ``--table`` prints, as markdown, one table per pass of every fused row with its
ratios (recomputed from all rows, so world-1 rows appended after the W-GPU run count for the scaling
efficiency).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys

if __package__ in (None, ""):  # run as a script path: make `benchmarks` importable from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import MASK_RATIOS, METHODS, PASSES, RATIOS, compute_ratios, upgrade_rows  # noqa: E402

CASE_FIELDS = ("causal", "dtype", "head_dim", "heads", "kv_heads", "batch", "mask", "layout")
PANEL_KEY = ("pass", *CASE_FIELDS)
STYLE = {  # method: (color, linestyle, marker)
    "torch_fused": ("tab:red", "-", "o"),
    "jax_fused": ("tab:orange", "-", "s"),
    "torch_fused_det": ("tab:pink", "-", "o"),
    "jax_fused_det": ("tab:olive", "-", "s"),
    "torch_ref": ("tab:gray", ":", "v"),
    "jax_xla": ("tab:brown", ":", "^"),
    "jax_cudnn_ring": ("tab:purple", "-.", "D"),
    "torch_cp": ("tab:blue", "-.", "P"),
    "torch_cudnn_1gpu": ("black", "--", "x"),
    "jax_cudnn_1gpu": ("tab:green", "--", "+"),
}


def load_rows(paths) -> list:
    rows = []
    for p in paths:
        with open(p, newline="") as f:
            rows.extend(upgrade_rows(csv.DictReader(f)))
    return rows


def _f(x):
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def latest(rows) -> list:
    """Rows that timed something, the last one per (method, world, case, pass); rows without ``pass`` are fwd."""
    keep = {}
    for r in upgrade_rows(rows):
        if r.get("error") or _f(r.get("tflops_per_gpu")) is None:
            continue
        key = (r["method"], r["world"], *(r.get(k, "") for k in PANEL_KEY), r["seq_local"])
        keep.pop(key, None)
        keep[key] = r  # re-inserted: the order of the file is kept, the last row wins
    return list(keep.values())


def panels(rows, x: str = "global") -> dict:
    """{panel key: {line label: [(seq, tflops), ...] sorted}} from the latest timed rows."""
    out = {}
    for r in latest(rows):
        pkey = tuple(r.get(k, "") for k in PANEL_KEY)
        info = METHODS.get(r["method"])
        share = info is not None and info.kind == "limit"
        label = f"{r['method']} ({'share of ' if share else ''}W={r['world']})"
        seq = int(r["seq_global"] if x == "global" else r["seq_local"])
        out.setdefault(pkey, {}).setdefault(label, []).append((seq, _f(r["tflops_per_gpu"])))
    for lines in out.values():
        for pts in lines.values():
            pts.sort()
    return out


def case_title(ckey) -> str:
    """The case of a CASE_FIELDS tuple, in words."""
    causal, dtype, d, h, hkv, b, mask, layout = ckey
    default = "zigzag" if str(causal) in ("1", "True") else "contiguous"
    lay = layout or default  # rows from before the layout could be chosen: the default
    what = f"causal ({lay})" if str(causal) in ("1", "True") else "non-causal" + ("" if lay == default else f" ({lay})")
    return (f"{what}, {dtype}, D={d}, H={h}/{hkv}" + (f", B={b}" if str(b) != "1" else "")
            + ("" if mask in ("", "none") else f", {mask}"))


def panel_title(pkey) -> str:
    return f"{pkey[0]}: {case_title(pkey[1:])}"


def _pass_order(name: str) -> int:
    return list(PASSES).index(name) if name in PASSES else len(PASSES)


def _seq_label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def plot(rows, out: str, x: str = "global", title: str | None = None) -> int:
    """Write the PNG; returns the number of panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = panels(rows, x)
    if not data:
        raise SystemExit("no timed rows to plot")
    keys = sorted(data, key=lambda k: (k[2], int(k[3]), int(k[4]), int(k[5]), int(k[6]), k[1], _pass_order(k[0])))
    ncol = min(2, len(keys))
    nrow = math.ceil(len(keys) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(9 * ncol, 4.6 * nrow), squeeze=False)
    for ax, pkey in zip(axes.flat, keys):
        seqs = set()
        for label in sorted(data[pkey], key=lambda lab: (list(METHODS).index(lab.split()[0]), lab)):
            pts = data[pkey][label]
            color, ls, marker = STYLE.get(label.split()[0], (None, "-", "."))
            world1 = label.endswith("(W=1)")
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, color=color, marker=marker,
                    linestyle=":" if world1 else ls, alpha=0.6 if world1 else 1.0,
                    linewidth=2.2 if METHODS.get(label.split()[0]) and METHODS[label.split()[0]].kind == "fused" else 1.4)
            seqs.update(p[0] for p in pts)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(seqs))
        ax.set_xticklabels([_seq_label(s) for s in sorted(seqs)])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set_xlabel("global sequence length (tokens)" if x == "global" else "seq_local (tokens per GPU)")
        ax.set_ylabel("TFLOP/s per GPU")
        ax.set_title(panel_title(pkey))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return len(keys)


def grouped_bars(bars: dict, png: str, *, ylabel: str, title: str, label=str, figsize=(9, 4), ylim=None) -> None:
    """A bar chart of ``bars`` ({series: {x key: value}}): one group per x key (sorted, ticks from ``label``), one bar
    per series (``--runs``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({k for v in bars.values() for k in v})
    fig, ax = plt.subplots(figsize=figsize)
    width = 0.8 / max(len(bars), 1)
    for i, (name, vals) in enumerate(bars.items()):
        ax.bar([j + i * width for j in range(len(keys))], [vals.get(k, 0) for k in keys], width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(keys))])
    ax.set_xticklabels([label(k) for k in keys])
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if ylim:
        ax.set_ylim(*ylim)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def nodes_timing(paths, png: str, title: str | None = None) -> str:
    """tests/gpu/gpu_nodes.py's timing CSV(s): each two-level row's per-call time over the flat ring's (one node of
    as many ranks, ``nodes`` 1) on the same problem, as grouped bars in ``png``; returns the markdown table."""
    rows = []
    for path in paths:
        with open(path, newline="") as f:
            rows += list(csv.DictReader(f))
    flat = {(int(r["seq_local"]), r["pass_"], r.get("mask", "none")): float(r["ms"]) for r in rows
            if int(r["nodes"]) == 1}
    bars, lines = {}, ["| S_local | mask | pass | nodes x ranks | ms | flat ring ms | over the flat ring |",
                       "|---" * 7 + "|"]
    for r in rows:
        key = (int(r["seq_local"]), r["pass_"], r.get("mask", "none"))
        if int(r["nodes"]) == 1 or key not in flat:
            continue
        ratio = float(r["ms"]) / flat[key]
        bars.setdefault(f"{r['nodes']} nodes x {r['node_size']} ranks", {})[key] = ratio
        lines.append(f"| {_seq_label(key[0])} | {key[2]} | {key[1]} | {r['nodes']} x {r['node_size']} | "
                     f"{float(r['ms']):.1f} | {flat[key]:.1f} | {ratio:.2f} |")
    grouped_bars(bars, png, ylabel="per-call time over the flat ring's",
                 label=lambda k: f"{_seq_label(k[0])} {k[1]}" + ("" if k[2] == "none" else f"\n{k[2]}"),
                 title=title or "two-level ring against the flat ring, same problem")
    return "\n".join(lines)


def table(rows) -> str:
    """Markdown: one table per pass (under a ``### pass`` heading) of the fused rows (latest per case) with
    TFLOP/s per GPU and ratios (each against the same pass's rows)."""
    cols = (*RATIOS, "scaling_eff", *MASK_RATIOS, "ring_steps")
    fused = [r for r in latest(compute_ratios(rows)) if METHODS.get(r["method"]) and METHODS[r["method"]].kind == "fused"]
    head = ["method", "W", "case", "seq_local", "TFLOP/s/GPU", *cols]
    blocks = []
    for name in sorted({r["pass"] for r in fused}, key=_pass_order):
        lines = [f"### {name}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in (r for r in fused if r["pass"] == name):
            vals = [r["method"], r["world"], case_title(tuple(r.get(k, "") for k in CASE_FIELDS)), r["seq_local"],
                    f"{_f(r['tflops_per_gpu']):.1f}",
                    *(("–" if _f(r.get(c)) is None else f"{_f(r[c]):.0f}" if c == "ring_steps" else f"{_f(r[c]):.2f}")
                      for c in cols)]
            lines.append("| " + " | ".join(str(v) for v in vals) + " |")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) or "(no timed fused rows)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.plot", description=__doc__.splitlines()[0])
    ap.add_argument("csv", nargs="+", help="CSV file(s) written by benchmarks.attention")
    ap.add_argument("--out", default=None, help="PNG to write (default: the first CSV with .png)")
    ap.add_argument("--x", default="global", choices=("global", "local"), help="x axis: global or per-GPU length")
    ap.add_argument("--title", default=None)
    ap.add_argument("--table", action="store_true", help="print the fused rows and their ratios as markdown, "
                                                         "one table per pass")
    ap.add_argument("--runs", action="store_true", help="A/B runs: one series per CSV (its name), bars of each fused "
                                                        "row's ratio to cuDNN in its own run, one group per case")
    ap.add_argument("--ratio", default="vs_cudnn_1gpu", choices=("vs_cudnn_1gpu", "vs_dense"),
                    help="--runs: the ratio column (vs_dense: a masked row against the dense one of its own run)")
    ap.add_argument("--nodes", action="store_true", help="the CSV is tests/gpu/gpu_nodes.py's timing: bars of the "
                                                         "two-level ring's time over the flat ring's, and a table")
    a = ap.parse_args(argv)
    if a.nodes:
        out = a.out or os.path.splitext(a.csv[0])[0] + ".png"
        print(nodes_timing(a.csv, out, a.title))
        print(f"wrote {out}")
        return 0
    if a.runs:
        out = a.out or os.path.splitext(a.csv[0])[0] + "_runs.png"
        bars = {}
        for path in a.csv:
            for r in compute_ratios(load_rows([path])):
                if METHODS.get(r["method"]) and METHODS[r["method"]].kind == "fused" and _f(r.get(a.ratio)):
                    key = (r["method"], int(r["head_dim"]), r["kv_heads"], int(r["seq_local"]), r["causal"],
                           r.get("mask") or "none", r.get("pass") or "fwd")
                    bars.setdefault(os.path.splitext(os.path.basename(path))[0], {})[key] = _f(r[a.ratio])
        causal = ("1", "True")
        ylabel = {"vs_cudnn_1gpu": "ratio to cuDNN (same run)", "vs_dense": "ratio to dense (same run)"}[a.ratio]
        grouped_bars(bars, out, ylabel=ylabel, title=a.title or "A/B runs", figsize=(16, 5),
                     ylim=(0.7, 1.15) if a.ratio == "vs_cudnn_1gpu" else (0.6, 1.0),
                     label=lambda k: f"D{k[1]} kv{k[2]}\n{k[3] // 1024}k{' c' * (k[4] in causal)}"
                                     + (f"\n{k[5]} {k[6]}" if k[5] != "none" else ""))
        print(f"wrote {out}")
        return 0
    rows = load_rows(a.csv)
    out = a.out or os.path.splitext(a.csv[0])[0] + ".png"
    n = plot(rows, out, a.x, a.title)
    print(f"wrote {out} ({n} panel{'s' * (n != 1)})")
    if a.table:
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
