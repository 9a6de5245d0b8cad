#!/usr/bin/env bash
# A/B of two (or more) trees' fused kernels at world size 1 (or AB_NPROC ranks) in one device call, on one GPU, one
# after the other.
# First written for issue 16 (is forward+backward's gap to ../shared/gpu/README.md's table, measured on b768330, in
# the code or in the machine? Sessions 2 and 3 measured 388-416 TFLOP/s against its 420-431 on other H200s, while
# both trees compile to the same registers, wgmma count and spills: benchmarks/results/ptxas_spills_2026-12-01.txt);
# since session 21 also for kernel changes whose gain is under the spread between machines (2-3 %): every tree is
# timed on the same GPU in the same call, in rounds.
#
# Here (CPU):  mkdir -p .ab && git archive b768330 ring_core jax_ring torch_bridge benchmarks \
#                  ':!benchmarks/results' -o .ab/old.tar      # .ab is git-ignored; carry it with .gpu
# GPU machine: source .gpu/prelude.sh; bash benchmarks/ab_trees.sh .ab/old.tar $OUT
# Each tree runs torch_fused and torch SDPA cuDNN (the yardstick of each run), bf16 D128 H32 16k/32k, causal and
# not, fwd and fwd+bwd: the current tree, the old one, then the current one again (drift shows as a difference
# between the two current runs).
#
# Several trees: a comma-separated list of tarballs, each labelled by its file name (.ab/late.tar: late). Other
# benchmark arguments: AB_ARGS (benchmarks/attention.py's, --csv aside). Rounds: AB_ROUNDS=R runs, R times, the
# current tree then each other one (labels _1 .. _R where R > 1), then the current tree once more. E.g. issue 20's
# packed forward against dense, three trees, two rounds:
#   AB_ROUNDS=2 AB_ARGS="--methods torch_fused --causal yes --seq 16k --mask none,packed --pass fwd --timing stream
#     --warmup 2 --iters 10" bash benchmarks/ab_trees.sh .ab/publish.tar,.ab/late.tar $OUT
# Ranks: AB_NPROC=N (default 1) runs each tree with N ranks (on one GPU they share it under MPS, as the launcher
# arranges), for changes to the ring protocol.
set -euo pipefail
IFS=, read -r -a tars <<< "${1:?tarball(s) of the other tree(s) (git archive ...), comma-separated}"
mkdir -p "${2:?output folder}"
out=$(realpath "$2")
args=${AB_ARGS:-"--methods torch_fused,torch_cudnn_1gpu --seq 16k,32k --pass fwd,fwd+bwd --warmup 2 --iters 5"}
rounds=${AB_ROUNDS:-1}
nproc=${AB_NPROC:-1}
dirs=()
for t in "${tars[@]}"; do
  d=$(mktemp -d)
  tar -xf "$(realpath "$t")" -C "$d"
  dirs+=("$d")
done
run() {  # $1: label, $2: the folder to run in (its packages are the ones imported)
  # shellcheck disable=SC2086  # (the benchmark's arguments, split on purpose)
  (cd "$2" && PYTHONPATH="$2${PYTHONPATH:+:$PYTHONPATH}" timeout 200 python -m jax_ring.launch --nproc-per-node "$nproc" -m benchmarks.attention \
    $args --csv "$out/ab_trees_$1.csv" > "$out/ab_trees_$1.log" 2>&1) || echo "$1: exit $?"
  echo "== $1"; grep -E "^(==|  torch_(fused|cudnn))" "$out/ab_trees_$1.log" || true
}
for r in $(seq 1 "$rounds"); do
  run "current_$r" "$PWD"
  for i in "${!tars[@]}"; do
    label=$(basename "${tars[$i]}" .tar)
    [ "$rounds" -gt 1 ] && label="${label}_$r"
    run "$label" "${dirs[$i]}"
  done
done
run "current_$((rounds + 1))" "$PWD"
