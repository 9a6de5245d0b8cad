"""How many K/V chunks the fused forward sends with packed documents (issue 20), counted on the CPU by the kernels'
rule (ring_core.protocol.steps.push_unit): a chunk goes from rank s to rank r iff causal masking lets some query of r see
its first row and the [min, max] of its ids meets that of a half of r's shard (zigzag: the layout's two chunks).
The benchmark's packed case (benchmarks.harness.packed_documents: 512-8192-token documents, bf16 D128 H32 is
irrelevant here), seq_local 16k, causal zigzag, 128-row chunks (the forward's default for D128), per (batch, kv
head); the same for every kv head.

    python -m benchmarks.packed_chunks            # prints one line per world size
"""
import numpy as np

from benchmarks import harness
from ring_core import layout as lay
from ring_core.masks import segment_ids_from_cu_seqlens


def chunks_sent(world: int, seq_local: int = 16384, chunk_rows: int = 128) -> tuple:
    """(chunks positions allow, chunks the ids let travel too), summed over every (sender, receiver) pair."""
    case = harness.Case(batch=1, heads=32, kv_heads=32, head_dim=128, seq_local=seq_local, causal=True,
                        dtype="bfloat16", mask="packed")
    s_g = case.seq_global(world)
    ids = segment_ids_from_cu_seqlens(harness.packed_documents(case, world), s_g)[0]
    perm = lay.layout_permutation(s_g, world, case.layout)
    local = [ids[perm[r * seq_local:(r + 1) * seq_local]] for r in range(world)]
    pos = [lay.global_positions(np, r, world, seq_local, case.layout) for r in range(world)]
    span = lambda a: (a.min(), a.max())  # noqa: E731 (no padding in these documents)
    by_pos = by_ids = 0
    for dst in range(world):
        halves = [span(local[dst][:seq_local // 2]), span(local[dst][seq_local // 2:])]
        for d in range(1, world):
            src = (dst - d) % world
            for c in range(seq_local // chunk_rows):
                if pos[src][c * chunk_rows] > pos[dst].max():
                    continue
                by_pos += 1
                lo, hi = span(local[src][c * chunk_rows:(c + 1) * chunk_rows])
                by_ids += any(lo <= h_hi and hi >= h_lo for h_lo, h_hi in halves)
    return by_pos, by_ids


if __name__ == "__main__":
    for w in (2, 4, 8):
        p, i = chunks_sent(w)
        print(f"W={w}: chunks by position {p}, by ids too {i} ({i / p:.1%})")
