"""Sampling many rows in one native call (sampling_cpu.cpp): greedy, temperature, top-k, top-p, min-p."""

from __future__ import annotations

import ctypes

import torch

from .native import I32, I64, P, Native, bind, require, threads


class SamplingOps(Native):
    def __init__(self, lib: ctypes.CDLL) -> None:
        super().__init__(lib)
        self._sample = bind(lib, "conveyor_sample_rows", I32, P, I64, I64, I64, P, P, P, I32)

    def sample_rows(self, logits: torch.Tensor, params: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """One token per row of logits [R, V] (fp32, contiguous rows), with per-row parameters [R, 4]
        (temperature (0 = greedy), top_k (0 = off), top_p (1 = off), min_p (0 = off)) and a uniform u [R]
        in [0, 1)."""
        require(logits.dim() == 2 and logits.dtype == torch.float32 and logits.stride(1) == 1
                and logits.device.type == "cpu", "logits must be fp32 [rows, vocab] with contiguous rows")
        rows, vocab = logits.shape
        params = params.to(torch.float64).contiguous()
        u = u.to(torch.float64).contiguous()
        require(params.dim() == 2 and params.shape == (rows, 4) and u.numel() == rows,
                "params [rows, 4] and u [rows] expected")
        out = torch.empty(rows, dtype=torch.int64)
        self.check(self._sample(logits.data_ptr(), rows, vocab, logits.stride(0), params.data_ptr(), u.data_ptr(),
                                out.data_ptr(), threads()))
        return out
