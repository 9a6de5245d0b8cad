"""The Gluon kernels' tile tables, the one place they are set: the kernels read them when they compile (so their
binaries' cache keys hold them) and ring_core.plans plans launches with them."""

# The Gluon forward's tiles by head_dim: (query rows per tile, two consumer warpgroups of half as many rows each;
# K/V rows per block; K/V slots in shared memory; rings: 1 when a block's K and V share a slot and its
# barriers, 2 when K and V have rings of their own, FlashAttention-3's separate K and V pipelines).
# D64/D128: 3 shared slots of 128-row blocks (the split consumers need the third, measured on one H200;
# D128 224 KiB of shared memory). D256: Q 64 KiB + 2 slots of 64-row K and V blocks, 64 KiB each = 192 KiB (a
# third slot would make 256), in rings of their own: the pipelined consumers use block j's K beside block j-1's V,
# so with 2 shared slots they hold both at once and block j+1's load waits for block j-1's P V; in rings of their
# own each K is freed once S = Q K^T is done, each V after P V, and the loads run a block ahead, as with 3 shared
# slots. The O accumulator: 64 x 256 float32 per warpgroup (128 registers a thread). FlashAttention-3 takes
# hdim 256 in 128-row tiles and 80-row blocks in 2 stages.
GLUON_TILES = {64: (128, 128, 3, 1), 128: (128, 128, 3, 1), 256: (128, 64, 2, 2)}

# ring_core.kernels.gluon_bwd's tiles: K/V rows per dK/dV task, and query rows per delta or dQ task (512, was 128:
# 6,144 fewer programs at 16k, H=32; measured 0-2 % faster, one H200).
GLUON_BWD_KV_ROWS, GLUON_BWD_ROW_TASK = 128, 512
# Query rows per step of a dK/dV task, by head_dim. At 64, 128 rows: the step's matmuls twice as wide (S^T and dP^T
# 64 x 128 a consumer, dK and dV over 128 queries): 16k causal forward+backward 0.95x cuDNN against 0.87x with 64
# rows, non-causal 0.98x against 0.90x (one H100, 2026-12-06: benchmarks/results/attention_d64_bwd_q128_*.csv),
# though ptxas then spills a few registers in the loop (``python -m benchmarks.spills --kernel bwd --dims 64``). At
# 128, 64 rows: S^T, dP^T, dK and dV take the consumers' registers already.
GLUON_BWD_Q_ROWS = {64: 128, 128: 64}
GLUON_BWD_HEAD_DIMS = (64, 128)
# Its deterministic order (DETERMINISTIC: dQ's adds in ticket order) where it beats the tl split: at head_dim 64 it
# does not (16k causal forward+backward, one H100, 2026-12-06: 0.71x cuDNN against the split's 0.87x with 64 query
# rows a step; 0.83x, the split's, with 128: benchmarks/results/attention_d64_bwd_det-gluon_1xH100_2026-12-06.csv).
GLUON_BWD_DET_HEAD_DIMS = (128,)
