"""Where a tile's time goes in the persistent Gluon forward, partition by partition (the packed forward: the
masked path cost 3-5 % over dense with the dense kernel's blocks, one H200, 2026-12-03; docs/performance.md).

The kernel is built with its timeline on (``RING_ATTENTION_GLUON_TIMELINE=1``, set here before ring_core is
imported; ring_core.kernels.gluon_fwd): each partition writes the SM's ``%clock64`` at its events of each of its program's
tiles (consumers: Q landed, blocks done, rows stored, and consumer 0's error record back and rows issued; the load
warp: tile known, loads issued; the planner: plan started, published) into the receive region, which no ring step
uses at world size 1. After each timed run the words of its last call are read back and summed up in SM cycles:

* ``block_cycles`` / ``tile_cycles``: a least-squares fit of a consumer's time from Q landed to blocks done against
  the tile's block count (slope: a block's cost in the loop; intercept: a tile's fixed cost inside ``_blocks``);
* ``gap_cycles``: a consumer's median wait between its rows stored and its next tile's Q landed (the load warp or
  the planner late), ``epilogue_cycles``: blocks done to rows stored;
* ``idle_share``: the consumers' time outside ``_blocks`` (gaps, epilogues, before the first tile, after the last)
  over the programs' spans;
* ``plan_lead_cycles``: how long before the load warp took a tile its plan was published (masked cases; negative:
  the load warp waited for the planner);
* consumer 0's epilogue split (medians): ``err_cycles`` blocks done -> the error record's atomic back,
  ``rows_cycles`` -> its rows of O issued, ``lse_cycles`` -> its lse stored;
* on the global clock (``%globaltimer``, the same on every SM): ``kernel_us`` from the first program's entry to the
  last one's exit, ``entry_spread_us`` between the first and the last entry, ``check_us`` a program's entry to its
  call check done (median), ``partitions_us`` from there to its partitions joined, ``tail_us`` from the last join
  to the last exit (the end barrier and status); ``clock_mhz`` the SMs' clock, a program's span in cycles over its
  entry to its join in nanoseconds (median); ``join_spread_us`` from the first program's join to the last one's,
  ``join_over_mean`` the last join over the mean one (from the first entry): 1 where every program ends together.

Each case is run two ways (``timing``): ``stream``, calls back to back (the words of the last one), as
``probe-mask-cost`` times them, and ``call``, one call after the GPU was idle, as the per-call benchmarks do.

The timeline's stores change the binary slightly (a few more bytes of spills outside the loops), so its cases are
compared with each other; ``ms`` is a call's time with the timeline on. World size 1, bf16, B=1, H=32, D=128,
seq_local 16k, causal (benchmarks/attention.py's W=1 layout), the cases of ``probe-mask-cost`` and the packed
documents of the packed benchmark:

    python -m jax_ring.launch --nproc-per-node 1 -m benchmarks.timeline --out DIR     # GPU: DIR/timeline.{csv,npz}
    python -m benchmarks.timeline --plot DIR/timeline.npz --png OUT.png                # CPU: the figure
    python -m benchmarks.timeline --summarize DIR/timeline.npz [--csv OUT.csv]         # CPU: the figures again

``--summarize`` sums up the words a run saved (each case's and timing's first repeat) as the run did, e.g. after a
change to ``summarize``.
"""
from __future__ import annotations

import argparse
import csv
import os
import sys

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TIMELINE_ENV = "RING_ATTENTION_GLUON_TIMELINE"  # ring_core.kernels.gluon_fwd.TIMELINE_ENV (checked after the import)

# name -> the harness Case's mask keywords
CASES = {
    "dense": dict(mask="none"),
    "window(16000,0)": dict(mask="window", window=(16000, 0)),
    "one document": dict(mask="packed", doc_lens=(16384, 16384)),
    "packed(512-8192)": dict(mask="packed", doc_lens=(512, 8192)),
}


def summarize(words: np.ndarray, ev: dict, capacity: int | None = None) -> dict:
    """One call's timeline words [programs, tiles, events] (-1 where never written) -> the module docstring's
    figures (cycles), and the per-tile arrays for the figure. ``capacity``: the tiles the kernel had room for
    (default: the words' second axis; the saved words, cut to the tiles run, give ring_core.kernels.gluon_fwd's
    TIMELINE_TILES here)."""
    tiles = words[:, :, ev["tile"]]
    n_per = (tiles >= 0).sum(axis=1)
    cap = words.shape[1] if capacity is None else capacity
    if (n_per >= cap).any():
        raise RuntimeError(f"a program ran {n_per.max()} tiles, more than the timeline's {cap}: raise "
                           "ring_core.kernels.gluon_fwd.TIMELINE_TILES")
    ran = n_per > 0
    per = [words[p, :n] for p, n in enumerate(n_per) if n]  # each program's tiles' words
    comp, blocks, gaps, epis = [], [], [], []
    busy = 0
    for w in per:
        for c in (0, 1):
            q, done, stored = (w[:, 3 * c + ev[k]] for k in ("q", "done", "stored"))
            comp.append(done - q)
            blocks.append(w[:, ev["blocks"]])
            gaps.append(q[1:] - stored[:-1])
            epis.append(stored - done)
            busy += int((done - q).sum())
    comp, blocks = np.concatenate(comp), np.concatenate(blocks)
    gaps, epis = np.concatenate(gaps), np.concatenate(epis)
    start, end = words[:, 0, ev["program_start"]], words[:, 0, ev["program_end"]]
    span = (end - start)[ran]
    if np.unique(blocks).size > 1:
        slope, intercept = np.polyfit(blocks.astype(np.float64), comp.astype(np.float64), 1)
    else:  # one block count: no slope to fit
        slope, intercept = float("nan"), float(comp.mean())
    out = dict(programs=int(ran.sum()), tiles=int(n_per.sum()), blocks=int(blocks.sum() // 2),
               span_cycles=float(np.median(span)), block_cycles=float(slope), tile_cycles=float(intercept),
               gap_cycles=float(np.median(gaps)) if gaps.size else 0.0,
               gap_mean_cycles=float(gaps.mean()) if gaps.size else 0.0, epilogue_cycles=float(np.median(epis)),
               idle_share=float(1.0 - busy / (2.0 * span.sum())))
    if (words[ran, 0, ev["plan_published"]] > 0).any():
        lead = [w[:, ev["load_tile"]] - w[:, ev["plan_published"]] for w in per]
        out["plan_lead_cycles"] = float(np.median(np.concatenate(lead)))
    # consumer 0's epilogue, split: blocks done -> the error record back -> its rows of O issued -> its lse stored
    for key, a, b in (("err_cycles", "done", "err_back"), ("rows_cycles", "err_back", "out_issued"),
                      ("lse_cycles", "out_issued", "stored")):
        out[key] = float(np.median(np.concatenate([w[:, ev[b]] - w[:, ev[a]] for w in per])))
    # the kernel on the global clock (ns, comparable between SMs): the first entry to the last exit, the programs'
    # entries' spread, the call check, the partitions' time, and after the last join
    entry, checked, joined, leave = (words[ran, 0, ev[k]] for k in ("entry_ns", "checked_ns", "joined_ns", "exit_ns"))
    out.update(kernel_us=float(leave.max() - entry.min()) / 1e3, entry_spread_us=float(entry.max() - entry.min()) / 1e3,
               check_us=float(np.median(checked - entry)) / 1e3, partitions_us=float(np.median(joined - checked)) / 1e3,
               tail_us=float(leave.max() - joined.max()) / 1e3,
               clock_mhz=float(np.median(span / (joined - entry))) * 1e3,  # (span: start and end, beside them)
               # how unevenly the programs end: their joins from the first entry, the last over the mean
               join_spread_us=float(joined.max() - joined.min()) / 1e3,
               join_over_mean=float((joined.max() - entry.min()) / (joined - entry.min()).mean()))
    arrays = dict(compute=comp, blocks=blocks, gaps=gaps)
    return out, arrays


def run(args) -> int:
    os.environ[TIMELINE_ENV] = "1"
    import torch

    import torch_bridge
    from benchmarks import harness
    from ring_core.kernels import gluon_fwd as gk
    from ring_core.runtime import heap as heap_mod

    if gk.TIMELINE_ENV != TIMELINE_ENV or not gk._TIMELINE.value:
        raise RuntimeError("ring_core.kernels.gluon_fwd was imported without its timeline")
    torch_bridge.initialize()
    if torch.distributed.get_world_size() != 1:
        raise SystemExit("the timeline is for world size 1")
    dev = torch.device("cuda", torch.cuda.current_device())
    h = heap_mod.get()
    P = torch.cuda.get_device_properties(dev).multi_processor_count
    n_words = P * gk.TIMELINE_TILES * gk.TIMELINE_EVENTS
    off = h.layout.recv_off - h.base_off
    region = h.workspace[off:off + 8 * n_words].view(torch.int64).view(P, gk.TIMELINE_TILES, gk.TIMELINE_EVENTS)
    ev = dict(gk.TIMELINE_EVENT)
    S, H, D = args.seq, 32, 128
    rng = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn((1, S, H, D), generator=rng).to(dev, torch.bfloat16) for _ in range(3))
    rows, raw = [], {}
    for rep in range(args.repeats):
        for timing in ("stream", "call"):
            for name, kw in CASES.items():
                case = harness.Case(1, H, H, D, S, True, "bfloat16", **kw)
                ids = harness.segment_ids(case, 1)
                seg = None if ids is None else torch.from_numpy(np.asarray(ids)).to(dev, torch.int32)

                def call():
                    return torch_bridge.ring_attention(q, k, v, backend="fused", is_causal=True, layout=case.layout,
                                                       window_size=case.window_size, segment_ids=seg)

                for _ in range(2):  # compile, plan, warm
                    call()
                torch.cuda.synchronize()
                region.fill_(-1)
                n = args.iters if timing == "stream" else 1
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                for _ in range(n):
                    region.fill_(-1)  # (on the stream: each call's words are its own)
                    call()
                e1.record()
                torch.cuda.synchronize()
                words = region.cpu().numpy()  # the last call's
                figures, arrays = summarize(words, ev)
                row = dict(case=name, timing=timing, repeat=rep, ms=e0.elapsed_time(e1) / n, **figures)
                rows.append(row)
                for key, a in arrays.items():
                    raw[f"{name}|{timing}|{rep}|{key}"] = a
                if rep == 0:  # the words themselves, for what the summary leaves out
                    raw[f"{name}|{timing}|{rep}|words"] = words[:, :int((words[:, :, ev["tile"]] >= 0).sum(1).max())]
                print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                      flush=True)
    torch_bridge.check_errors()
    os.makedirs(args.out, exist_ok=True)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    stem = os.path.join(args.out, "timeline")
    with open(stem + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    np.savez_compressed(stem + ".npz", **raw)
    return 0


def plot(npz: str, png: str) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = np.load(npz)
    names = sorted({k.split("|")[0] for k in data.files}, key=list(CASES).index)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for name in names:
        comp = data[f"{name}|stream|0|compute"]
        blocks = data[f"{name}|stream|0|blocks"]
        ax1.scatter(blocks, comp / 1e3, s=3, alpha=0.4, label=name)
        gaps = data[f"{name}|stream|0|gaps"]
        ax2.hist(gaps / 1e3, bins=80, histtype="step", label=name, range=(0, np.quantile(gaps, 0.99) / 1e3))
    ax1.set_xlabel("blocks in the tile")
    ax1.set_ylabel("a consumer's Q landed -> blocks done (k cycles)")
    ax2.set_xlabel("a consumer's rows stored -> next tile's Q landed (k cycles)")
    ax2.set_ylabel("tiles")
    for ax in (ax1, ax2):
        ax.legend()
    fig.suptitle("Gluon forward timeline, W=1, bf16 D128 H32 16k causal (calls back to back, first repeat)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    return 0


def summarize_saved(npz: str, out_csv: str | None = None) -> int:
    """The figures of every ``CASE|TIMING|REPEAT|words`` array in a run's ``timeline.npz`` (``summarize``, with the
    kernel's timeline capacity: the saved words are cut to the tiles run), printed and, with ``out_csv``, written."""
    from ring_core.kernels import gluon_fwd as gk

    data = np.load(npz)
    rows = []
    for key in data.files:
        if not key.endswith("|words"):
            continue
        name, timing, rep, _ = key.split("|")
        try:
            figures, _ = summarize(data[key], dict(gk.TIMELINE_EVENT), capacity=gk.TIMELINE_TILES)
        except RuntimeError as e:
            raise SystemExit(f"{key}: {e}") from None
        rows.append(dict(case=name, timing=timing, repeat=int(rep), **figures))
        print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in rows[-1].items()),
              flush=True)
    if not rows:
        raise SystemExit(f"{npz} holds no timeline words (keys CASE|TIMING|REPEAT|words)")
    if out_csv:
        keys = list(dict.fromkeys(k for r in rows for k in r))
        with open(out_csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.timeline", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".", help="directory for timeline.csv and timeline.npz (GPU run)")
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5, help="calls back to back in the stream timing")
    ap.add_argument("--plot", metavar="NPZ", help="draw the figure of a run's timeline.npz (no GPU) ...")
    ap.add_argument("--png", help="... into this file")
    ap.add_argument("--summarize", metavar="NPZ", help="the figures of a run's saved words (no GPU) ...")
    ap.add_argument("--csv", help="... also written to this CSV")
    args = ap.parse_args(argv)
    if args.summarize:
        return summarize_saved(args.summarize, args.csv)
    if args.plot:
        return plot(args.plot, args.png or os.path.splitext(args.plot)[0] + ".png")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
