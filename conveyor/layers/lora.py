"""LoRA-aware linear layers for multi-LoRA batches (docs/design/lora.md).

A `LoRALinear` wraps a block's linear of any weight format (plain, packed, bf16 tiles, int8/int4/GGUF
`QuantLinear`): the base matmul runs once over every row of the batch, then each adapter's low-rank
delta `(x @ A.T) @ B.T` runs over its own rows and is added to theirs, so rows without an adapter are
exactly the base model's. Rows are grouped by adapter as the mixture-of-experts layer groups them by
expert (`layers.moe`): the step's `LoRABatch` holds the rows that have an adapter sorted by slot (one
stable sort per step, shared by every layer) and each slot's count on the host; a layer makes one
gather, two small matmuls per adapter in the batch, and one `index_add_`, nothing per row.

Adapters live in `max_loras` slots of stacked weights: `lora_a[slot]` is `[blocks * rank, in]` and
`lora_b[slot]` is `[out, blocks * rank]`, the scaling folded into B. A fused projection (q/k/v, gate/up)
has one block per slice: an adapter of the unfused model (PEFT's `q_proj`, `k_proj`, `v_proj`) puts
each slice's A in its block and its B in that block's columns over the slice's output rows; an adapter
of a fused checkpoint (Phi-3's `qkv_proj`) uses the first block over all output rows. Unused blocks
and ranks below the slot's are zeros, which add nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class LoRABatch:
    """A step's rows that run with an adapter: `order` their row indices grouped by slot (batch order
    within a slot), `groups` (slot, start, end) slices of `order`."""

    order: torch.Tensor
    groups: list[tuple[int, int, int]]

    @classmethod
    def from_row_slots(cls, row_slots: torch.Tensor, num_slots: int) -> LoRABatch | None:
        """From each row's slot (-1: the base model); None when no row has an adapter. One stable sort
        and one host read of the per-slot counts."""
        counts = torch.bincount(row_slots + 1, minlength=num_slots + 1).tolist()
        if counts[0] == row_slots.numel():
            return None
        order = torch.argsort(row_slots, stable=True)[counts[0]:]
        groups, start = [], 0
        for slot, n in enumerate(counts[1:]):
            if n:
                groups.append((slot, start, start + n))
                start += n
        return cls(order, groups)


@dataclass(frozen=True)
class SlotPart:
    """One adapter matrix pair of a `LoRALinear`: its block, its first output row, A `[r, in]`, B `[rows, r]`
    and the scaling B is multiplied by."""

    block: int
    row: int
    a: torch.Tensor
    b: torch.Tensor
    scale: float


class LoRAState:
    """What every `LoRALinear` of a model reads: the running step's `LoRABatch` (None: no adapter rows, the
    base layers alone run). Set by the model runner around each forward pass."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None


class LoRALinear(nn.Module):
    """`base(x)` plus, for the rows of the step's `LoRABatch`, their adapter's delta. `slices`: the output
    widths of the fused projections (one entry for an unfused linear). The stacked weights are plain
    tensors, not parameters: the model's state_dict and the base layer are unchanged."""

    def __init__(self, base: nn.Module, in_features: int, slices: list[int], max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, state: LoRAState) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features = in_features, sum(slices)
        self.slices, self.max_rank, self.state = list(slices), max_rank, state
        blocks = len(slices) * max_rank
        self.lora_a = torch.zeros(max_loras, blocks, in_features, dtype=dtype, device=device)
        self.lora_b = torch.zeros(max_loras, self.out_features, blocks, dtype=dtype, device=device)

    def slice_rows(self, index: int) -> tuple[int, int]:
        """The output rows of slice `index`."""
        start = sum(self.slices[:index])
        return start, start + self.slices[index]

    def set_slot(self, slot: int, parts: list[SlotPart]) -> None:
        """Fill slot `slot` with an adapter's parts (B scaled, both in the slot's dtype); everything else of
        the slot is zeroed."""
        self.clear_slot(slot)
        for part in parts:
            lo, (rows, rank) = part.block * self.max_rank, part.b.shape
            self.lora_a[slot, lo:lo + rank].copy_(part.a)
            self.lora_b[slot, part.row:part.row + rows, lo:lo + rank].copy_(part.b.float() * part.scale)

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.state.batch
        if batch is None:
            return y
        rows = x.index_select(0, batch.order)
        delta = torch.empty(rows.shape[0], self.out_features, dtype=rows.dtype, device=rows.device)
        for slot, start, end in batch.groups:
            torch.mm(torch.mm(rows[start:end], self.lora_a[slot].t()), self.lora_b[slot].t(), out=delta[start:end])
        return y.index_add_(0, batch.order, delta.to(y.dtype))

    def extra_repr(self) -> str:
        return f"slices={self.slices}, max_loras={self.lora_a.shape[0]}, max_rank={self.max_rank}"
