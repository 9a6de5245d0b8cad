python -m benchmarks.scaling_model --node-size 2 --gpus 8 --ib-gbit 3600 --seq 4k,8k,16k,32k,64k --tag groups2-of-8-NVLink_2026-12-06
