"""The persistent Gluon forward's tile order (ring_core.tiles.persistent_tile), run in Triton's interpreter: every
tile exactly once; ``query_tile``'s order before the tail; in the tail, causal, the query blocks heaviest first
across its kv heads, with at least two tiles a program; non-causal, ``query_tile``'s order throughout."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = textwrap.dedent("""
    import json
    import torch
    import triton
    import triton.language as tl
    from ring_core.tiles import persistent_tile, query_tile

    @triton.jit
    def order(out_ptr, G, n_m, HKV, B, P, CAUSAL: tl.constexpr):
        t = tl.program_id(0)
        b, h, hkv, m = persistent_tile(t, G, n_m, HKV, B, P, CAUSAL)
        qb, qh, qhkv, qm = query_tile(t, G, n_m, HKV, CAUSAL)
        for i, v in enumerate((b, h, hkv, m, qb, qh, qhkv, qm)):
            tl.store(out_ptr + t * 8 + i, v)

    res = {}
    for B, H, HKV, n_m, P, causal in ((1, 4, 4, 8, 6, True), (2, 6, 2, 5, 7, True), (1, 2, 1, 16, 132, True),
                                      (3, 4, 2, 3, 4, True), (2, 4, 4, 8, 6, False)):
        n = B * H * n_m
        out = torch.zeros((n, 8), dtype=torch.int32)
        order[(n,)](out, H // HKV, n_m, HKV, B, P, causal)
        res[f"{B}-{H}-{HKV}-{n_m}-{P}-{causal}"] = out.tolist()
    print(json.dumps(res))
""")


def test_persistent_order_takes_every_tile_once_and_ends_on_the_lightest():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for key, rows in json.loads(r.stdout.strip().splitlines()[-1]).items():
        B, H, HKV, n_m, P, causal = key.split("-")
        B, H, HKV, n_m, P, causal = int(B), int(H), int(HKV), int(n_m), int(P), causal == "True"
        G = H // HKV
        got = [tuple(row[:4]) for row in rows]
        assert sorted((b, h, m) for b, h, _, m in got) == sorted(
            (b, h, m) for b in range(B) for h in range(H) for m in range(n_m)), key  # each tile once
        assert all(hkv == h // G for _, h, hkv, _ in got), key
        if not causal:
            assert got == [tuple(row[4:]) for row in rows], key
            continue
        k = min(B * HKV, -(-2 * P // (G * n_m)))
        first = (B * HKV - k) * G * n_m
        assert got[:first] == [tuple(row[4:]) for row in rows[:first]], key  # query_tile's order before the tail
        tail = got[first:]
        assert len(tail) >= min(2 * P, B * H * n_m), key
        assert [m for *_, m in tail] == sorted((m for *_, m in tail), reverse=True), key  # heaviest first
        assert {(b, hkv) for b, _, hkv, _ in tail} == {divmod(u, HKV) for u in range(B * HKV - k, B * HKV)}, key
