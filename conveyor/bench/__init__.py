"""Conveyor's benchmark suite: `python -m conveyor.bench throughput WORKLOAD.json [--compare hf]`.

Modules: `workloads` (workload files and synthetic workloads), `throughput` (offline throughput
and greedy-output comparison), `hf_baselines` (transformers' generate_batch and static generate),
`cli` (argparse entry point, `main(argv)`). Importing this package does not import torch.
"""

from .cli import main

__all__ = ["main"]
