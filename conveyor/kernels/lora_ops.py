"""A LoRA linear's adapter deltas on CPU (lora_cpu.cpp): every adapter of the batch in one call, added to
the base output in place; `layers.lora.LoRALinear` has the PyTorch path that computes the same."""

from __future__ import annotations

import ctypes

import torch

from .native import I32, I64, P, Native, bind, dtype_code, int64_vector, require, threads


class LoRAOps(Native):
    def __init__(self, lib: ctypes.CDLL) -> None:
        super().__init__(lib)
        self._delta = bind(lib, "conveyor_lora_delta", I32, I32, P, I64, I64, P, P, I64, P, P, P, P, I64, I64, I64,
                           P, I64, I64, I32)

    def add_delta_(self, y: torch.Tensor, x: torch.Tensor, order: torch.Tensor, groups: torch.Tensor,
                   a: torch.Tensor, b: torch.Tensor, slice_rows: torch.Tensor, slice_block: torch.Tensor) -> None:
        """`y[order[p]] += B_slot (A_slot x[order[p]])` per group (slot, start, end) of `groups` `[n, 3]`; A
        transposed `[slots, in, blocks * rank]`, B `[slots, rank, out]`, `slice_block` `[slots, slices]` (see
        lora_cpu.cpp)."""
        code = dtype_code(x, "x")
        for name, t in (("y", y), ("a", a), ("b", b)):
            require(t.dtype == x.dtype and t.device.type == "cpu", f"{name} must have x's dtype")
        require(x.dim() == 2 and y.dim() == 2 and x.stride(1) == 1 and y.stride(1) == 1, "x and y must be 2-D rows")
        require(a.is_contiguous() and b.is_contiguous(), "a and b must be contiguous")
        slots, in_features, width = a.shape
        _, rank, out = b.shape
        require(in_features == x.shape[1] and out == y.shape[1] and width % rank == 0 and b.shape[0] == slots,
                f"a {list(a.shape)} and b {list(b.shape)} do not fit x {list(x.shape)} -> y {list(y.shape)}")
        require(groups.dim() == 2 and groups.shape[1] == 3, "groups must be [n, 3]")
        require(slice_block.shape[0] == slots and slice_rows.numel() == slice_block.shape[1] + 1,
                "slice_block must be [slots, slices] and slice_rows [slices + 1]")
        self.check(self._delta(code, x.data_ptr(), x.stride(0), in_features, int64_vector(order, "order"),
                               int64_vector(groups, "groups"), groups.shape[0], a.data_ptr(), b.data_ptr(),
                               int64_vector(slice_rows, "slice_rows"), int64_vector(slice_block, "slice_block"),
                               slice_block.shape[1], rank, width // rank, y.data_ptr(), y.stride(0), out, threads()))
