"""The compute peak each linear is measured against: which instruction path a call takes, and that
path's rate on this machine (conveyor/kernels/peak_cpu.cpp, a loop of only its dot-product instruction on
as many threads as torch uses).

Paths: the quantized kernels take `int8-vnni` where the build has VNNI (AVX512 or AVX-VNNI), else
`int8-i16` for 4-bit tiles (block sums kept in int16, one widening a block) and `int8-i32` for 8-bit
and K-quant weights (every product widened); bf16 dequantize + matmul (oneDNN) takes `amx-bf16`
where the CPU has AMX, `bf16-avx512` with AVX512-BF16, else `fp32-fma`; fp32 dense layers
(oneDNN/MKL) `fp32-fma`. A path this CPU or build lacks has no peak (None): the report says so.
"""

from __future__ import annotations

from typing import Any

import torch

from conveyor.kernels import cpu_flags, cpu_matmul_ops, cpu_peak_ops, native_kernels_enabled
from conveyor.layers.quantization.linear import QuantMatmul
from conveyor.layers.quantization.tensors import GGMLType

FOUR_BIT_TILES = (GGMLType.Q4_0, GGMLType.Q4_1)


def _bf16_matmul_kind() -> str:
    flags = cpu_flags()
    return "amx-bf16" if "amx_bf16" in flags else "bf16-avx512" if "avx512_bf16" in flags else "fp32-fma"


def linear_path(fn: Any, rows: int, dtype: torch.dtype) -> tuple[str, str]:
    """(what runs, peak kind) for a call of the model's linear `fn` (a layer or its kernel) on `rows` rows
    of `dtype`, on CPU."""
    fn = getattr(fn, "kernel", fn)
    if isinstance(fn, QuantMatmul):
        types = "+".join(s.type_name for s in fn.segments)
        if not fn.takes_kernel(rows, dtype):
            return f"{types}: dequantize + {dtype_name(dtype)} matmul", (
                _bf16_matmul_kind() if dtype == torch.bfloat16 else "fp32-fma")
        ops = cpu_matmul_ops()
        isa = ops.isa()
        if all(s.type_name == "BF16" for s in fn.segments):  # dense bf16 tiles: bf16 pairs, or widened for fp32 FMAs
            if dtype == torch.bfloat16 and ops.bf16_pair_products():
                return f"BF16: bf16 tiles, vdpbf16ps kernel ({isa})", "bf16-avx512"
            return f"BF16: bf16 tiles, fp32 FMA kernel ({isa})", "fp32-fma"
        if all(s.type_name == "F32" for s in fn.segments):  # dense fp32 tiles (mixture-of-experts experts)
            return f"F32: fp32 tiles, fp32 FMA kernel ({isa})", "fp32-fma"
        if "vnni" in isa:
            kind = "int8-vnni"
        else:
            kind = "int8-i16" if all(s.qtype in FOUR_BIT_TILES for s in fn.segments) else "int8-i32"
        return f"{types}: int8 kernel ({isa})", kind
    if dtype == torch.bfloat16:
        return "bf16 dense (oneDNN)", _bf16_matmul_kind()
    return f"{dtype_name(dtype)} dense (oneDNN/MKL)", "fp32-fma"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def measure_peaks(kinds: set[str], threads: int | None = None) -> dict[str, float | None]:
    """GOP/s of each path in `kinds` on `threads` threads (default: torch's); None where this build or
    CPU has no such path, or the native kernels are off."""
    ops = cpu_peak_ops() if native_kernels_enabled() else None
    available = set(ops.peak_kinds()) if ops is not None else set()
    threads = threads or torch.get_num_threads()
    return {kind: ops.peak_gops(kind, threads) if kind in available else None for kind in sorted(kinds)}
