#!/usr/bin/env bash
# A/B of the backward's dQ-task order under causal masking (2026-11-30): the kernel as it is (last query blocks
# first) against a copy of the packages whose dQ tasks run in ascending order; fwd+bwd, torch and JAX, 16k causal.
# On the GPU machine, from the repo root: bash benchmarks/ab_bwd_tile_order.sh OUT_DIR
set -euo pipefail
out=$(realpath "${1:?output folder}")
run() {  # $1: label, $2: the folder to run in (its packages are the ones imported)
  (cd "$2" && timeout 150 python -m jax_ring.launch --nproc-per-node 2 -m benchmarks.attention \
    --methods torch_fused,jax_fused --pass fwd+bwd --seq 16k --causal yes --warmup 2 --iters 5 \
    --csv "$out/ab_bwd_order_$1.csv" > "$out/ab_bwd_order_$1.log" 2>&1) || echo "$1: exit $?"
  echo "== $1"; grep -E "^  (torch|jax)_fused" "$out/ab_bwd_order_$1.log" || true
}
alt=$(mktemp -d)
cp -r ring_core jax_ring torch_bridge benchmarks "$alt/"
python - "$alt/ring_core/kernels/tl_bwd.py" <<'PY'
import sys
p = sys.argv[1]
s = open(p).read()
old = "m_blk = _heavy_first(t % n_m, n_m, CAUSAL)"  # the dQ tasks' order (the forward keeps its own)
assert s.count(old) == 1, "the dQ-task reversal is not where this script expects it"
open(p, "w").write(s.replace(old, "m_blk = _heavy_first(t % n_m, n_m, False)"))
PY
run heavy_first "$PWD"
run ascending "$alt"
