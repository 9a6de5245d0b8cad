python -m benchmarks.scaling_model --tag H200-IB400_2026-12-06
