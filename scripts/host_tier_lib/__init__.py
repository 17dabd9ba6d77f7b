"""Parts of `scripts/bench_host_tier.py` (the multi-turn workload and the worker it drives)
and of `scripts/bench_step.py --compare-host-tier` (`step_compare.py`)."""
