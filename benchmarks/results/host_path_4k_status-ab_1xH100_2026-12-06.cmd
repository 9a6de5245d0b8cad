# one H100, one warm machine: the tree before the status-check change (BEFORE, 5df8916) and after it, in turn
# (runs before 1, after 1, before 2, after 2; after 2's files did not come back from the machine)
(cd BEFORE && python -m jax_ring.launch --nproc-per-node 1 -m benchmarks.host_path --out OUT/base1 --seq 4k --calls 40)
python -m jax_ring.launch --nproc-per-node 1 -m benchmarks.host_path --out OUT/new1 --seq 4k --calls 40
(cd BEFORE && python -m jax_ring.launch --nproc-per-node 1 -m benchmarks.host_path --out OUT/base2 --seq 4k --calls 40)
# File: host_path_4k_status-ab_1xH100_2026-12-06.csv (the rows of base1, new1, base2; columns tree and run added)
