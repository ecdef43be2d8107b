"""Mamba-2's decode rows on CPU (ssm_cpu.cpp): each row from its in_proj output to the gated norm's output, its
convolution ring and SSM state updated in place in the KV pool, with the arithmetic the native decode stack
runs (mamba_row.h)."""

from __future__ import annotations

import ctypes

import torch

from .native import F32, I32, I64, P, Native, bind, dtype_code, int64_vector, require, threads


class SsmOps(Native):
    def __init__(self, lib: ctypes.CDLL) -> None:
        super().__init__(lib)
        self._decode = bind(lib, "conveyor_mamba_decode", I32, I32, P, I64, I64, P, I64, I64, P, I64, P, I64, I64,
                            I64, I64, I64, I64, I64, P, P, P, P, P, P, F32, P, I32)

    @staticmethod
    def rows_fit(half_bytes: int, state: int) -> bool:
        """Whether a pool whose slot halves are `half_bytes` long holds whole state rows of `state` fp32 values in
        each (as the kernels and the decode stack read them)."""
        return half_bytes % (4 * state) == 0

    @staticmethod
    def fits(kv_cache: torch.Tensor, state: int) -> bool:
        """Whether the kernel takes this pool: a contiguous CPU tensor whose slot halves hold whole state rows."""
        half = kv_cache[0, 0].numel() * kv_cache.element_size()
        return kv_cache.device.type == "cpu" and kv_cache.is_contiguous() and SsmOps.rows_fit(half, state)

    def decode(self, proj: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor, positions: torch.Tensor,
               page: int, shape: tuple[int, int, int, int, int], weights: tuple[torch.Tensor, ...],
               eps: float) -> torch.Tensor:
        """The rows' gated-norm outputs `[rows, inner]` in proj's dtype. proj `[rows, in_width]` (in_proj's
        output); tables `[rows, width]` and positions `[rows]` the rows' blocks and positions; shape (heads, P,
        N, groups, kernel); weights (taps `[kernel, conv_dim]`, conv bias or an empty tensor, A, D, dt_bias,
        norm) fp32 and contiguous."""
        code = dtype_code(proj, "proj")
        require(kv_cache.dtype == proj.dtype and self.fits(kv_cache, shape[2]), "the pool does not fit the kernel")
        require(proj.dim() == 2 and proj.stride(1) == 1, "proj must be rows")
        for w in weights:
            require(w.dtype == torch.float32 and w.is_contiguous(), "the layer's weights must be contiguous fp32")
        heads, p, n, groups, kernel = shape
        taps, bias, a, d, dt_bias, norm = weights
        conv_dim = taps.shape[1]
        require(proj.shape[1] == heads * p + conv_dim + heads, "proj's width does not fit the layer")
        rows = proj.shape[0]
        out = torch.empty(rows, heads * p, dtype=proj.dtype)
        kv_row = kv_cache[0, 0].numel()
        self.check(self._decode(code, proj.data_ptr(), proj.stride(0), rows, kv_cache.data_ptr(), kv_cache.shape[1],
                                kv_row, int64_vector(tables, "tables"), tables.shape[1],
                                int64_vector(positions, "positions"), page, heads, p, n, groups, kernel, conv_dim,
                                taps.data_ptr(), bias.data_ptr() if bias.numel() else None, a.data_ptr(),
                                d.data_ptr(), dt_bias.data_ptr(), norm.data_ptr(), eps, out.data_ptr(), threads()))
        return out
