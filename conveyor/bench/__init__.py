"""Conveyor's benchmark suite: `python -m conveyor.bench throughput WORKLOAD.json [--compare hf]`.

Modules: `workloads` (workload files and synthetic workloads), `throughput` (offline throughput
and greedy-output comparison), `hf_baselines` (transformers' generate_batch and static generate),
`commands` (argparse entry point, `main(argv)`). Importing this package does not import torch.
"""

from .commands import main

__all__ = ["main"]
