"""Every adapter's LoRA delta of a batch in two Triton launches (the CUDA side of `layers.lora.LoRALinear`;
the CPU has kernels/lora_cpu.cpp).

The rows that run with an adapter come grouped by slot (`order`, and each grouped row's `slots`), so
neighbouring programs read the same adapter's weights from the cache. `shrink`: one program per
(grouped row, tile of A's columns) computes `t = x[row] @ A[slot]` over every block of A (one per fused
slice, `[in, blocks * rank]`), rounded to x's dtype as a matmul in that dtype would. `expand`: one program
per (grouped row, tile of output columns) reads, for each column, its slice's block of `t`
(`slice_block[slot, slice]`, -1: none) and adds `t_block @ B[slot]` (`[rank, out]`, the scaling folded in)
to the row's output in place. Each row appears once in `order`, so no two programs write the same
output. Nothing is read back to the host: the launch sizes are the grouped rows and the layer's widths.

Under Triton's interpreter (`TRITON_INTERPRET=1` set before this module is imported) the kernels run on
CPU tensors: that is how they are tested without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 64  # input features per step of the shrink's loop
BLOCK_W = 32  # columns of A per shrink program
BLOCK_N = 64  # output columns per expand program


@triton.jit
def _shrink(x_ptr, x_stride, order_ptr, slots_ptr, a_ptr, a_slot_stride, t_ptr, K, WIDTH,
            BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr):
    p = tl.program_id(0)
    row = tl.load(order_ptr + p)
    slot = tl.load(slots_ptr + p)
    w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    wmask = w < WIDTH
    acc = tl.zeros([BLOCK_W], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        xv = tl.load(x_ptr + row * x_stride + k, mask=kmask, other=0.0).to(tl.float32)
        av = tl.load(a_ptr + slot * a_slot_stride + k[:, None] * WIDTH + w[None, :],
                     mask=kmask[:, None] & wmask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(xv[:, None] * av, axis=0)
    tl.store(t_ptr + p * WIDTH + w, acc.to(t_ptr.dtype.element_ty), mask=wmask)


@triton.jit
def _expand(t_ptr, order_ptr, slots_ptr, b_ptr, b_slot_stride, col_slice_ptr, slice_block_ptr, num_slices,
            y_ptr, y_stride, N, WIDTH, R, RANK: tl.constexpr, BLOCK_N: tl.constexpr):
    p = tl.program_id(0)
    row = tl.load(order_ptr + p)
    slot = tl.load(slots_ptr + p)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    part = tl.load(col_slice_ptr + n, mask=nmask, other=0)
    block = tl.load(slice_block_ptr + slot * num_slices + part, mask=nmask, other=-1)
    valid = nmask & (block >= 0)
    r = tl.arange(0, RANK)
    both = (r[:, None] < R) & valid[None, :]
    tv = tl.load(t_ptr + p * WIDTH + block[None, :] * R + r[:, None], mask=both, other=0.0).to(tl.float32)
    bv = tl.load(b_ptr + slot * b_slot_stride + r[:, None] * N + n[None, :], mask=both, other=0.0).to(tl.float32)
    delta = tl.sum(tv * bv, axis=0)
    out = y_ptr + row * y_stride + n
    yv = tl.load(out, mask=valid, other=0.0)
    tl.store(out, (yv.to(tl.float32) + delta).to(yv.dtype), mask=valid)


def add_lora_delta_(y: torch.Tensor, x: torch.Tensor, order: torch.Tensor, slots: torch.Tensor, a: torch.Tensor,
                    b: torch.Tensor, col_slice: torch.Tensor, slice_block: torch.Tensor) -> torch.Tensor:
    """`y[order[p]] += B[s] (A[s] x[order[p]])` with `s = slots[p]`, each output column reading its slice's
    block of A (`col_slice [out]`, `slice_block [slots, slices]`); A `[slots, in, blocks * rank]`, B
    `[slots, rank, out]`, contiguous, in x's dtype; x and y rows of unit column stride. Returns y."""
    n = order.numel()
    if n == 0:
        return y
    slot_count, in_features, width = a.shape
    rank, out_features = b.shape[1:]
    if x.stride(1) != 1 or y.stride(1) != 1 or not (a.is_contiguous() and b.is_contiguous()):
        raise ValueError("x and y need unit column strides, a and b must be contiguous")
    if in_features != x.shape[1] or out_features != y.shape[1] or width % rank or b.shape[0] != slot_count:
        raise ValueError(f"a {list(a.shape)} and b {list(b.shape)} do not fit x {list(x.shape)} -> y {list(y.shape)}")
    t = torch.empty(n, width, dtype=x.dtype, device=x.device)
    _shrink[(n, triton.cdiv(width, BLOCK_W))](x, x.stride(0), order, slots, a, a.stride(0), t, in_features, width,
                                              BLOCK_K=BLOCK_K, BLOCK_W=BLOCK_W)
    _expand[(n, triton.cdiv(out_features, BLOCK_N))](t, order, slots, b, b.stride(0), col_slice, slice_block,
                                                     slice_block.shape[1], y, y.stride(0), out_features, width, rank,
                                                     RANK=triton.next_power_of_2(rank), BLOCK_N=BLOCK_N)
    return y
