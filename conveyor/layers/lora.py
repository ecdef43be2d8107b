"""LoRA-aware linear layers for multi-LoRA batches (docs/design/lora.md).

A `LoRALinear` wraps a block's linear of any weight format (plain, packed, bf16 tiles, int8/int4/GGUF
`QuantLinear`): the base matmul runs once over every row of the batch, then each adapter's low-rank
delta `(x @ A.T) @ B.T` runs over its own rows and is added to theirs, so rows without an adapter are
exactly the base model's. Rows are grouped by adapter as the mixture-of-experts layer groups them by
expert (`layers.moe`): the step's `LoRABatch` holds the rows that have an adapter sorted by slot (one
stable sort per step, shared by every layer) and each slot's count on the host. On CPU one native call
per layer computes every adapter's delta (`kernels/lora_cpu.cpp`), on CUDA two Triton launches
(`kernels/triton_lora.py`); above `NATIVE_MAX_ROWS` grouped rows (prefill), and on other devices, a gather,
small matmuls per adapter in the batch and one `index_add_`; nothing loops over rows.

Adapters live in `max_loras` slots of stacked weights: `lora_a[slot]` is A transposed, `[in, blocks *
rank]`, and `lora_b[slot]` is `[rank, out]`, the scaling folded into B (both laid out so the kernel's
inner loops run over contiguous columns). A fused projection (q/k/v, gate/up) has one
block of A per slice, and `slice_block[slot, slice]` says which block a slice's output columns read
(-1: none): an adapter of the unfused model (PEFT's `q_proj`, `k_proj`, `v_proj`) gives each slice its
own block; an adapter of a fused checkpoint (Phi-3's `qkv_proj`) has one A, in block 0, read by every
slice. Ranks below `max_rank` are zeros, which add nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..kernels import cpu_lora_ops

# Grouped rows up to which the native (or on CUDA the Triton) kernel runs; above, the PyTorch path's matmuls,
# which win on prefill chunks (native kernel: 1.4 against 3.1 ms at 1,024 rows, 0.89 against 0.78 ms at 256; 0.69 against 0.10 ms at 8;
# a q/k/v projection of the built-in model, 4 adapters of rank 16, bf16, one thread, CPU time).
NATIVE_MAX_ROWS = 256


@dataclass
class LoRABatch:
    """A step's rows that run with an adapter: `order` their row indices grouped by slot (batch order
    within a slot), `slots` each grouped row's slot, `groups` (slot, start, end) slices of `order` (also as
    an int64 `[n, 3]` tensor)."""

    order: torch.Tensor
    slots: torch.Tensor
    groups: list[tuple[int, int, int]]
    group_table: torch.Tensor

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
        return cls(order, row_slots.index_select(0, order), groups, torch.tensor(groups, dtype=torch.long))


@dataclass(frozen=True)
class SlotPart:
    """One adapter matrix pair of a `LoRALinear`: its block, its first output row, A `[r, in]`, B `[rows, r]`
    (PEFT's layout) and the scaling B is multiplied by."""

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
        self.max_rank, self.state = max_rank, state
        self.slice_rows = torch.tensor([0, *torch.tensor(slices).cumsum(0).tolist()], dtype=torch.long)
        self.lora_a = torch.zeros(max_loras, in_features, len(slices) * max_rank, dtype=dtype, device=device)
        self.lora_b = torch.zeros(max_loras, max_rank, self.out_features, dtype=dtype, device=device)
        self.slice_block = torch.full((max_loras, len(slices)), -1, dtype=torch.long, device=device)
        self.col_slice = torch.repeat_interleave(torch.arange(len(slices)), torch.tensor(slices)).to(device)
        self.blocks: list[list[int]] = self.slice_block.tolist()  # (the host copy the PyTorch path reads)
        cpu = torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16)
        self.ops = cpu_lora_ops() if cpu else None
        self.grouped_kernel = torch.device(device).type == "cuda"  # kernels/triton_lora.py

    def slice_range(self, index: int) -> tuple[int, int]:
        """The output rows of slice `index`."""
        return int(self.slice_rows[index]), int(self.slice_rows[index + 1])

    def set_slot(self, slot: int, parts: list[SlotPart]) -> None:
        """Fill slot `slot` with an adapter's parts (B scaled, both in the slot's dtype): a part over one
        slice's rows is read by that slice, one over all rows by every slice; the rest of the slot is zeroed."""
        self.clear_slot(slot)
        for part in parts:
            lo, (rows, rank) = part.block * self.max_rank, part.b.shape
            self.lora_a[slot, :, lo:lo + rank].copy_(part.a.t())
            self.lora_b[slot, :rank, part.row:part.row + rows].copy_(part.b.t().float() * part.scale)
            for s in range(len(self.blocks[slot])):
                start, end = self.slice_range(s)
                if part.row <= start and end <= part.row + rows:
                    self.blocks[slot][s] = part.block
        self.slice_block[slot] = torch.tensor(self.blocks[slot], device=self.slice_block.device)

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.slice_block[slot].fill_(-1)
        self.blocks[slot] = [-1] * len(self.blocks[slot])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.state.batch
        if batch is None:
            return y
        if (self.ops is not None and batch.order.numel() <= NATIVE_MAX_ROWS and x.dtype == y.dtype == self.lora_a.dtype
                and y.is_contiguous()):
            self.ops.add_delta_(y, x.contiguous(), batch.order, batch.group_table, self.lora_a, self.lora_b,
                                self.slice_rows, self.slice_block)
            return y
        if self.grouped_kernel and batch.order.numel() <= NATIVE_MAX_ROWS and x.dtype == y.dtype == self.lora_a.dtype:
            from ..kernels.triton_lora import add_lora_delta_  # (Triton is imported on CUDA only)
            return add_lora_delta_(y, x.contiguous(), batch.order, batch.slots, self.lora_a, self.lora_b,
                                   self.col_slice, self.slice_block)
        return self.add_delta(y, x, batch)

    def add_delta(self, y: torch.Tensor, x: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
        """The PyTorch path: the grouped rows gathered, per slot the shrink then each slice's expand, the
        deltas added to their rows."""
        rows = x.index_select(0, batch.order)
        delta = torch.zeros(rows.shape[0], self.out_features, dtype=rows.dtype, device=rows.device)
        r = self.max_rank
        for slot, start, end in batch.groups:
            t = torch.mm(rows[start:end], self.lora_a[slot])
            for s, block in enumerate(self.blocks[slot]):
                if block >= 0:
                    lo, hi = self.slice_range(s)
                    delta[start:end, lo:hi] = torch.mm(t[:, block * r:(block + 1) * r], self.lora_b[slot, :, lo:hi])
        return y.index_add_(0, batch.order, delta.to(y.dtype))

    def extra_repr(self) -> str:
        return f"slices={self.slice_rows.diff().tolist()}, max_loras={self.lora_a.shape[0]}, max_rank={self.max_rank}"
