# One H100 80GB HBM3 (the GPU machine lent on 2026-12-06), from the repository root, carrying .gpu, .tcache, .whl.
source .gpu/prelude.sh; pip install -q --no-index --no-deps --target /tmp/extra .whl/*.whl
python tools/gpu_session.py --nproc 2 --out OUT/w2 warm:60 checks-quick:150 checks-bwd:70   # all three: exit 0
python tools/gpu_session.py --nproc 1 --out OUT/w1 checks-quick:120 checks-bwd:50           # both: exit 0
PYTHONPATH=/tmp/extra:$PYTHONPATH python tools/gpu_session.py --nproc 2 --out OUT/int integrations:330   # exit 0
python tools/gpu_session.py --nproc 1 --out OUT/peers bench-w1-peers:230                   # exit 0
# Files: gpu_checks_W1_1xH100_2026-12-06.log (OUT/w1/session.log: both stages' output),
# gpu_checks_bwd_W{1,2}_1xH100_2026-12-06.json (OUT/w*/gpu_checks.json: the backward stage's summary; the quick
# stage's was replaced by it, which tests/gpu/gpu_checks.py no longer does), integrations_1xH100_2026-12-06.log
# (OUT/int/session.log), attention_w1_peers_1xH100_2026-12-06.csv (OUT/peers/attention_w1_peers.csv).
# Not finished: the HuggingFace example at 4 ranks sharing the GPU (stage integrations with --nproc 4) compiled
# for longer than its 165 s limit, the last device time of the day.
