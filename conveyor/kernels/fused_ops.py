"""The Llama decoder layer's fused elementwise ops on CPU (fused_cpu.cpp): RMSNorm (alone or after the
residual add), rotary embedding in place, SiLU(gate) * up, fp32 or bf16, each rounding as the PyTorch
sequence it replaces."""

from __future__ import annotations

import ctypes

import torch

from .native import F32, I32, I64, P, Native, bind, dtype_code, require, threads


def _same_dtype(x: torch.Tensor, other: torch.Tensor, name: str) -> None:
    require(other.dtype == x.dtype and other.device.type == "cpu", f"{name} must have the input's dtype")


class FusedOps(Native):
    def __init__(self, lib: ctypes.CDLL) -> None:
        super().__init__(lib)
        self._rms_norm = bind(lib, "conveyor_rms_norm", I32, I32, P, P, P, I64, I64, F32, P, I32)
        self._rope = bind(lib, "conveyor_rope", I32, I32, P, I64, I64, I64, I64, P, P, I32)
        self._silu_mul = bind(lib, "conveyor_silu_mul", I32, I32, P, I64, I64, P, I32)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * (x * rsqrt(mean(x^2) + eps)) over the last dimension, as transformers' LlamaRMSNorm."""
        return self._norm(x.contiguous(), None, weight, eps)

    def add_rms_norm_(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x += residual in place (rounded as PyTorch's add), then `rms_norm(x, weight, eps)`, in one pass: a
        decoder layer's residual add and the next norm."""
        _same_dtype(x, residual, "residual")
        require(x.is_contiguous() and residual.is_contiguous() and residual.shape == x.shape,
                "x and residual must be contiguous, of one shape")
        return self._norm(x, residual, weight, eps)

    def _norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        code = dtype_code(x, "x")
        _same_dtype(x, weight, "weight")
        n = x.shape[-1]
        require(weight.numel() == n and weight.is_contiguous(), f"weight must be contiguous with {n} elements")
        out = torch.empty_like(x)
        self.check(self._rms_norm(code, x.data_ptr(), None if residual is None else residual.data_ptr(),
                                  weight.data_ptr(), x.numel() // n, n, eps, out.data_ptr(), threads()))
        return out

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """x * cos + rotate_half(x) * sin in place: x [tokens, heads, dim] with contiguous heads (a view into
        the fused qkv output is fine), cos and sin [tokens, dim] of x's dtype."""
        code = dtype_code(x, "x")
        _same_dtype(x, cos, "cos")
        _same_dtype(x, sin, "sin")
        require(x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2],
                "x must be [tokens, heads, dim] with contiguous heads")
        tokens, heads, dim = x.shape
        cos, sin = cos.contiguous(), sin.contiguous()
        require(cos.numel() == tokens * dim and sin.numel() == tokens * dim, "cos and sin must be [tokens, dim]")
        self.check(self._rope(code, x.data_ptr(), tokens, heads, dim, x.stride(0), cos.data_ptr(), sin.data_ptr(),
                              threads()))

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up = [gate | up] along the last dimension (bf16: in fp32, rounded once)."""
        code = dtype_code(gate_up, "gate_up")
        gate_up = gate_up.contiguous()
        width = gate_up.shape[-1]
        require(width % 2 == 0 and width > 0, f"gate_up's last dimension must be [gate | up], got {width}")
        out = torch.empty((*gate_up.shape[:-1], width // 2), dtype=gate_up.dtype)
        self.check(self._silu_mul(code, gate_up.data_ptr(), gate_up.numel() // width, width // 2, out.data_ptr(),
                                  threads()))
        return out
