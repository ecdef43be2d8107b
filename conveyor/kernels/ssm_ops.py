"""Mamba-2's decode step on CPU (ssm_cpu.cpp): the decode rows' SSM states updated in place in the KV pool,
and their outputs; `layers.mamba2.Mamba2Mixer` has the PyTorch path that computes the same states."""

from __future__ import annotations

import ctypes

import torch

from .native import I32, I64, P, Native, bind, int64_vector, require, threads


class SsmOps(Native):
    def __init__(self, lib: ctypes.CDLL) -> None:
        super().__init__(lib)
        self._decode = bind(lib, "conveyor_ssm_decode", I32, P, I64, I64, P, I64, I64, I64, I64, I64, I64,
                            P, P, P, P, P, P, P, P, I32)

    @staticmethod
    def fits(kv_cache: torch.Tensor, state: int) -> bool:
        """Whether a state row of `state` values lies within one half of a slot of this pool (and the pool is
        a contiguous CPU tensor, as the kernel reads it)."""
        half = kv_cache[0, 0].numel() * kv_cache.element_size()
        return kv_cache.device.type == "cpu" and kv_cache.is_contiguous() and half % (4 * state) == 0

    def decode_(self, kv_cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, dt: torch.Tensor,
                decay: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor,
                started: torch.Tensor) -> torch.Tensor:
        """The rows' outputs `[rows, heads, P]`, their states (at `slots [rows, s]` of the layer's pool
        `kv_cache`) updated in place: x `[rows, heads, P]`, dt and decay `[rows, heads]`, b and c `[rows, groups,
        N]`, d `[heads]`, started `[rows]` bool (False: the state starts from zeros)."""
        rows, heads, p = x.shape
        groups, n = b.shape[1], b.shape[2]
        tensors = {"x": x, "dt": dt, "decay": decay, "b": b, "c": c, "d": d}
        for name, t in tensors.items():
            require(t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu",
                    f"{name} must be a contiguous fp32 CPU tensor")
        require(dt.shape == decay.shape == (rows, heads) and c.shape == b.shape == (rows, groups, n)
                and d.shape == (heads,) and started.shape == (rows,) and slots.shape[0] == rows,
                "the rows' shapes do not agree")
        require(self.fits(kv_cache, n), f"a state row of {n} values does not lie within a slot's half of this pool")
        started = started.to(torch.uint8).contiguous()
        half = kv_cache[0, 0].numel() * kv_cache.element_size()
        y = torch.empty_like(x)
        self.check(self._decode(kv_cache.data_ptr(), kv_cache[0].numel() * kv_cache.element_size(), half,
                                int64_vector(slots, "slots"), slots.shape[1], rows, heads, p, n, groups,
                                x.data_ptr(), dt.data_ptr(), decay.data_ptr(), b.data_ptr(), c.data_ptr(),
                                d.data_ptr(), started.data_ptr(), y.data_ptr(), threads()))
        return y
