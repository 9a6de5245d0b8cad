#!/usr/bin/env bash
# A/B of two trees' fused kernels at world size 1 in one device call, on one GPU, one after the other (issue 16:
# is forward+backward's gap to ../shared/gpu/README.md's table, measured on b768330, in the code or in the
# machine? Sessions 2 and 3 measured 388-416 TFLOP/s against its 420-431 on other H200s, while both trees compile
# to the same registers, wgmma count and spills: benchmarks/results/ptxas_spills_2026-12-01.txt).
#
# Here (CPU):  mkdir -p .ab && git archive b768330 ring_core jax_ring torch_bridge benchmarks \
#                  ':!benchmarks/results' -o .ab/old.tar      # .ab is git-ignored; carry it with .gpu
# GPU machine: source .gpu/prelude.sh; bash benchmarks/ab_trees.sh .ab/old.tar $OUT
# Each tree runs torch_fused and torch SDPA cuDNN (the yardstick of each run), bf16 D128 H32 16k/32k, causal and
# not, fwd and fwd+bwd: the current tree, the old one, then the current one again (drift shows as a difference
# between the two current runs).
set -euo pipefail
old_tar=$(realpath "${1:?tarball of the old tree (git archive ...)}")
out=$(realpath "${2:?output folder}")
old=$(mktemp -d)
tar -xf "$old_tar" -C "$old"
run() {  # $1: label, $2: the folder to run in (its packages are the ones imported)
  (cd "$2" && PYTHONPATH="$2" timeout 200 python -m jax_ring.launch --nproc-per-node 1 -m benchmarks.attention \
    --methods torch_fused,torch_cudnn_1gpu --seq 16k,32k --pass fwd,fwd+bwd --warmup 2 --iters 5 \
    --csv "$out/ab_trees_$1.csv" > "$out/ab_trees_$1.log" 2>&1) || echo "$1: exit $?"
  echo "== $1"; grep -E "^(==|  torch_(fused|cudnn))" "$out/ab_trees_$1.log" || true
}
run current_1 "$PWD"
run old "$old"
run current_2 "$PWD"
