# One H100 80GB HBM3 (the GPU machine lent on 2026-12-06; an H200 was asked for), from the repository root, carrying
# .gpu and .tcache (the Triton cache filled on a CPU: tools/gpu_variants.py, python -m ring_core.runtime.build --warm).
source .gpu/prelude.sh
python tools/gpu_session.py --nproc 1 --out OUT/w1 warm:60 checks-gluon-bwd-d64:260     # exit 0
python tools/gpu_session.py --nproc 2 --out OUT/w2 checks-gluon-bwd-d64:120             # exit 0
python tools/gpu_session.py --nproc 1 --out OUT/w1 warm:60 checks-padded:220 bench-d64-bwd:150   # exit 0
python tools/gpu_session.py --nproc 1 --out OUT/host probe-host-path:150                 # exit 0
python tools/gpu_session.py --nproc 1 --out OUT/shapes bench-shapes:300                  # exit 0
# Files: gpu_checks_gluon_bwd_d64_W{1,2}_1xH100_2026-12-06.json (the first two lines; the head_dim-64 Gluon
# backward in both orders, before its deterministic order gave way to the tl split), attention_d64_bwd_1xH100_2026-12-06.csv
# and gpu_checks_padded_W1_1xH100_2026-12-06.json (the third), host_path_4k_1xH100_2026-12-06.csv / .png (the
# fourth), attention_w1_shapes_1xH100_2026-12-06.csv / .png (the fifth, on the tree as committed).
python tools/gpu_session.py --nproc 1 --out OUT/tune tune-bwd-d256:240                    # exit 0
python tools/gpu_session.py --nproc 2 --out OUT/w2 checks-padded:200                      # exit 0
# Files: tune_backward_d256_1xH100_2026-12-06.csv (the first of these two), gpu_checks_padded_W2_1xH100_2026-12-06.json
# (the second: 2 ranks sharing the GPU).
# After the portable backward's tiles above head_dim 128 changed:
python tools/gpu_session.py --nproc 1 --out OUT/bwd checks-bwd:120                         # exit 0
python -m jax_ring.launch --nproc-per-node 1 -m benchmarks.attention --methods torch_fused,torch_cudnn_1gpu \
    --pass fwd+bwd --warmup 3 --iters 10 --head-dim 256,192 --seq 16k --causal yes --csv OUT/d256.csv   # exit 0
# Files: gpu_checks_bwd_W1_1xH100_2026-12-06.json (replacing the morning's one-rank file), attention_w1_d256_1xH100_2026-12-06.csv
# The backward section at 1 and 2 ranks (its cases now include head_dim 160 fp16 on the portable backward's tiles above
# 128), the fault checks and the soak at 2 ranks sharing the GPU, the 4-rank rings:
python tools/gpu_session.py --nproc 1 --out OUT/w1 checks-bwd:90                         # exit 0
python tools/gpu_session.py --nproc 2 --out OUT/w2 checks-bwd:110 faults:150 soak:210    # exit 0
python tools/gpu_session.py --nproc 4 --out OUT/w4 rings:200                             # exit 0
# Files: gpu_checks_bwd_W{1,2}_1xH100_2026-12-06.json, gpu_faults_W2_1xH100_2026-12-06.json,
# gpu_soak_W2_1xH100_2026-12-06.json (8,600 calls a rank before --max-seconds), gpu_rings_W4_1xH100_2026-12-06.json.
# The head_dim-64 backward's query rows a step, 64 against 128 (a tree with configs.GLUON_BWD_Q_ROWS 128 run from its
# own folder, TREE, with the same cache), same warm machine, first run repeated last:
python tools/gpu_session.py --nproc 1 --out OUT/x warm:30; export TRITON_CACHE_DIR=$PWD/.cache/triton  # cache unpacked
M="-m benchmarks.attention --methods torch_fused,torch_cudnn_1gpu --head-dim 64 --seq 16k --causal both --pass fwd+bwd --warmup 3 --iters 10"
python -m jax_ring.launch --nproc-per-node 1 $M --csv OUT/base.csv                       # exit 0
(cd TREE && python -m jax_ring.launch --nproc-per-node 1 $M --csv OUT/q128.csv)          # exit 0
python -m jax_ring.launch --nproc-per-node 1 $M --csv OUT/base2.csv                      # exit 0
# Files: attention_d64_bwd_q64_1xH100_2026-12-06.csv (base; base2 read 0.92 / 0.87), attention_d64_bwd_q128_...csv.
# After configs.GLUON_BWD_Q_ROWS became {64: 128, 128: 64} (the head_dim-128 kernels' PTX unchanged:
# tools/ptx_same.py over the checks-gluon-bwd-rest variants, 36 of 36 identical):
python tools/gpu_session.py --nproc 1 --out OUT/w1 warm:40 checks-gluon-bwd-d64:150 bench-d64-bwd:150   # exit 0
python tools/gpu_session.py --nproc 2 --out OUT/w2 checks-gluon-bwd-d64:150                             # exit 0
python -m jax_ring.launch --nproc-per-node 2 tests/gpu/gpu_soak.py --calls 10000 --seed 2152 --deadline 300 \
    --max-seconds 230 --out OUT/soak                                                                    # exit 0
# Files: gpu_checks_gluon_bwd_d64_W{1,2}_1xH100_2026-12-06.json, attention_d64_bwd_1xH100_2026-12-06.csv / .png,
# gpu_soak_seed2152_W2_1xH100_2026-12-06.json (seed 2152 draws head_dim 64 fp16 at seq_local 256: the Hopper
# forward and this backward, with gradients; 10,000 calls a rank, 0 wrong).
# JAX beside torch at head_dim 64 (after the cache was unpacked as above):
python -m jax_ring.launch --nproc-per-node 1 -m benchmarks.attention --methods torch_fused,jax_fused,torch_cudnn_1gpu,jax_cudnn_1gpu \
    --head-dim 64 --seq 16k --causal yes --pass fwd,fwd+bwd --warmup 3 --iters 10 --csv OUT/attention_d64_jax.csv   # exit 0
# File: attention_d64_jax_1xH100_2026-12-06.csv
# The Gluon forward's ping-pong, off / on / off (the variants warmed on the CPU with and without the variable):
M="-m benchmarks.attention --methods torch_fused,torch_cudnn_1gpu --head-dim 64,128 --seq 16k --causal both --pass fwd --warmup 3 --iters 10"
python -m jax_ring.launch --nproc-per-node 1 $M --csv OUT/base.csv                                    # exit 0
RING_ATTENTION_GLUON_PINGPONG=1 python -m jax_ring.launch --nproc-per-node 1 $M --csv OUT/pp.csv      # exit 0
python -m jax_ring.launch --nproc-per-node 1 $M --csv OUT/base2.csv                                   # exit 0
# Files: attention_w1_fwd_pingpong-off_1xH100_2026-12-06.csv (base), attention_w1_fwd_pingpong-on_...csv (pp)
# The Gluon backward's deterministic order at head_dim 64 (a tree, TREE, with configs.GLUON_BWD_DET_HEAD_DIMS = (64, 128)):
(cd TREE && python -m jax_ring.launch --nproc-per-node 1 -m benchmarks.attention --methods torch_fused_det,torch_fused,torch_cudnn_1gpu \
    --head-dim 64 --seq 16k --causal yes --pass fwd+bwd --warmup 3 --iters 10 --csv OUT/det.csv)                     # exit 0
(cd TREE && python -m jax_ring.launch --nproc-per-node 1 tests/gpu/gpu_checks.py --sections gluon-bwd,gluon-bwd-masks \
    --gluon-bwd-cases b1,b3,b6,m1,m4 --out OUT/chk)                                                               # exit 0
# File: attention_d64_bwd_det-gluon_1xH100_2026-12-06.csv (the checks passed; the plans were left as they are)
# After the kernels took the keys' segment ids apart from the queries' (KV_IDS), 2 ranks:
python tools/gpu_session.py --nproc 2 --out OUT --budget 420 checks-kv-ids          # exit 0
python tools/gpu_session.py --nproc 2 --out OUT --budget 570 warm checks-masks      # exit 0
# Files: gpu_checks_kv_ids_W2_1xH100_2026-12-06.json, gpu_checks_masks_W2_1xH100_2026-12-06.json
# The two-level ring (2 "nodes" x 2 ranks): gpu_nodes_W4_1xH100_2026-12-06.cmd
