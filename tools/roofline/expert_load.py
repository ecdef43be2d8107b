"""Mixture-of-experts figures for the roofline's `step`: how the batch's rows spread over the experts, and which
linear shapes the experts run at.

A decode step of B rows routes B x k (row, expert) pairs in each sparse layer; each expert multiplies
only its own rows, so the expert matmuls run at about B x k / E rows each, not B. `ExpertLoad` records
every sparse block's per-expert row counts while attached (the blocks hand them over anyway: no extra
host reads), and `summary` gives rows per expert per layer and step (min / median / max over every
expert of every sparse layer of the timed steps) and how many experts had rows. The blocks' share of
the step's time is timed by the step probe (`step.instrument`).
"""

from __future__ import annotations

import statistics
from typing import Any

from conveyor.layers.moe import SparseMoe


def sparse_blocks(model: Any) -> list[SparseMoe]:
    return [m for m in model.modules() if isinstance(m, SparseMoe)]


class ExpertLoad:
    """Per-expert row counts of every sparse block call while attached (`with ExpertLoad(model) as load`)."""

    def __init__(self, model: Any) -> None:
        self.blocks = sparse_blocks(model)
        self.calls: list[list[int]] = []

    def __enter__(self) -> "ExpertLoad":
        for block in self.blocks:
            block.observer = self.calls.append
        return self

    def __exit__(self, *exc: object) -> None:
        for block in self.blocks:
            block.observer = None

    def summary(self) -> dict[str, Any]:
        """Rows per expert per layer call: min / median / max over all experts and calls, the rows routed per
        call, and experts with rows per call (median)."""
        rows = [n for counts in self.calls for n in counts]
        busy = [sum(1 for n in counts if n) for counts in self.calls]
        return {"layer_calls": len(self.calls), "experts": len(self.calls[0]) if self.calls else 0,
                "top_k": self.blocks[0].top_k if self.blocks else 0,
                "routed_rows_per_call": statistics.median(sum(c) for c in self.calls) if self.calls else 0,
                "rows_per_expert": {"min": min(rows), "median": statistics.median(rows), "max": max(rows)}
                if rows else None,
                "busy_experts_median": statistics.median(busy) if busy else 0}


def expert_shapes(model: Any, batch: int) -> list[tuple[str, Any, int, int, int]]:
    """(name, the model's own callable, calls per decode step, rows per call, layers) of the first sparse
    block's expert projections (at the mean rows per expert, B x k / E, with every expert busy) and its
    shared expert's (every row); empty for a dense model."""
    blocks = sparse_blocks(model)
    if not blocks:
        return []
    block, n = blocks[0], len(blocks)
    busy = min(block.num_experts, batch * block.top_k)
    rows = max(1, round(batch * block.top_k / block.num_experts))
    expert = block.experts[0]
    shapes = [(f"experts.gate_up_proj ({rows} rows)", expert.gate_up_proj, n * busy, rows, n),
              (f"experts.down_proj ({rows} rows)", expert.down_proj, n * busy, rows, n)]
    if block.shared_expert is not None:
        shapes += [("shared_expert.gate_up_proj", block.shared_expert.gate_up_proj, n, batch, n),
                   ("shared_expert.down_proj", block.shared_expert.down_proj, n, batch, n)]
    return shapes
