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
