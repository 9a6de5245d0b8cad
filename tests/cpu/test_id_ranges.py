"""The segment-id ranges a rank publishes for its own programs at world size 1
(ring_core.protocol.steps.id_ranges_ready:
the programs of the call share the chunks' steps, 2048 ids each, taken from a counter; whoever counts the last one
done releases CTL_RANGES), run in Triton's interpreter against numpy.

Several steps per batch (seq_local over 2048), several batches, chunks over 2048 rows (a step per chunk), padding, and
two calls in a row (the second call's words replace the first's once the counters are reset as ``finish_call`` does).
Every program must see the ranges ready, and each word must be what every reader expects: per chunk, the min of its
ids with padding counted as -1, the max of its ids (at least -1), stored as -1 - value (ring_core.protocol.steps's
layout).
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = textwrap.dedent("""
    import json, sys
    import numpy as np
    import torch
    import triton
    import triton.language as tl
    from ring_core.protocol import control, steps as protocol
    from ring_core import testing


    @triton.jit
    def probe(ctl, seg, rng, heap_bases, ok_out, epoch, B, S, n_chunks, CHUNK_ROWS: tl.constexpr):
        ok = protocol.id_ranges_ready(ctl, seg, rng, heap_bases, 0, epoch, 10**9, B, S, n_chunks, 1, CHUNK_ROWS, False,
                                      True)
        tl.store(ok_out + tl.program_id(0), ok)


    out = []
    for B, S, chunk_rows, programs in json.loads(sys.argv[1]):
        n_chunks = -(-S // chunk_rows)
        ctl = torch.zeros(control.CTL_BYTES // 4, dtype=torch.int32)
        rng = torch.full((B * (n_chunks + 2) * 2,), 7, dtype=torch.int32)  # 7: never a word (words are <= 0)
        heap_bases = torch.zeros(1, dtype=torch.int64)  # one rank: a store to itself translates by 0
        bad = []
        for epoch, seed in ((1, 3), (2, 4)):
            seg = torch.from_numpy(testing.random_segment_ids(seed, B, S, max_len=S // 5))
            ok = torch.zeros(programs, dtype=torch.int32)
            probe[(programs,)](ctl, seg, rng, heap_bases, ok, epoch, B, S, n_chunks, CHUNK_ROWS=chunk_rows)
            steps = B * (-(-n_chunks // (2048 // chunk_rows)) if chunk_rows <= 2048 else n_chunks)
            got_ctl = (int(ctl[control.CTL_RANGES]), int(ctl[control.CTL_RANGES_DONE]), int(ctl[control.CTL_ERROR]))
            if ok.tolist() != [1] * programs or got_ctl != (epoch, steps, 0):
                bad.append(f"epoch {epoch}: ok {ok.tolist()}, (CTL_RANGES, CTL_RANGES_DONE, CTL_ERROR) {got_ctl}, "
                           f"{steps} steps")
            words = rng.view(B, n_chunks + 2, 2)
            expected = testing.id_range_words(seg.numpy(), chunk_rows, False)  # (the halves: not written at W = 1)
            for b in range(B):
                want = expected[b, :n_chunks].reshape(-1).tolist()
                have = words[b, :n_chunks].reshape(-1).tolist()
                if have != want:
                    bad.append(f"epoch {epoch} batch {b}: {have[:8]} ... against {want[:8]} ...")
            ctl[control.CTL_SIG_CLAIM] = 0  # the next call's counters, as finish_call leaves them
            ctl[control.CTL_RANGES_DONE] = 0
        out.append(dict(steps=steps, bad=bad))
    print(json.dumps(out))
""")

# (B, S, CHUNK_ROWS, programs): three steps in each of two batches (the last step short), one step a chunk (chunks
# of 4096 rows), and more programs than steps.
CASES = [(2, 5000, 128, 3), (1, 9000, 4096, 2), (1, 300, 64, 4)]


def test_world_one_programs_share_the_id_ranges_and_every_word_is_right():
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", PROBE, json.dumps(CASES)], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert [g["steps"] for g in got] == [6, 3, 1]
    for case, g in zip(CASES, got):
        assert not g["bad"], (case, g["bad"])
