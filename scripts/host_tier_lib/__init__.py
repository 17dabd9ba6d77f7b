"""Parts of `scripts/bench_host_tier.py`: the multi-turn workload and the worker it drives."""
