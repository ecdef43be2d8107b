"""The compute-peak loops (conveyor/kernels/peak_cpu.cpp) and the path each linear is set against
(tools/roofline/peaks.py): a path is measured only where this CPU has its instructions, and the rates are
real (positive, and more threads do not give less than half the one-thread rate)."""

from __future__ import annotations

import pytest
import torch

from conveyor.kernels import cpu_flags, cpu_matmul_ops, cpu_peak_ops
from conveyor.layers.quantization.linear import BF16_KERNEL_MAX_ROWS, QuantMatmul
from conveyor.layers.quantization.tensors import bf16_rows, quantize_int4, quantize_int8
from tools.roofline.peaks import linear_path, measure_peaks

# The CPU flags each path's instructions need (all of them).
NEEDS = {"fp32-fma": {"avx2", "fma"}, "int8-i16": {"avx2"}, "int8-i32": {"avx2"},
         "bf16-avx512": {"avx512f", "avx512_bf16"}, "amx-bf16": {"amx_tile", "amx_bf16"},
         "amx-int8": {"amx_tile", "amx_int8"}}


@pytest.fixture(scope="module")
def peaks():
    ops = cpu_peak_ops()
    if ops is None:
        pytest.skip("native kernels unavailable")
    return ops


def test_paths_need_their_flags(peaks) -> None:
    kinds = peaks.peak_kinds()
    flags = cpu_flags()
    for kind in kinds:
        if kind == "int8-vnni":
            assert "avx512_vnni" in flags or "avx_vnni" in flags
        else:
            assert NEEDS[kind] <= flags, kind
    if {"avx2", "fma"} <= flags:
        assert {"fp32-fma", "int8-i16", "int8-i32"} <= set(kinds)
    if not flags & {"avx512_vnni", "avx_vnni"}:
        assert "int8-vnni" not in kinds


def test_rates_are_measured(peaks) -> None:
    for kind in peaks.peak_kinds():
        one = peaks.peak_gops(kind, 1)
        two = peaks.peak_gops(kind, 2)
        assert one > 1.0 and two > 0.5 * one, (kind, one, two)
    with pytest.raises(RuntimeError, match="no peak loop for path 'sparse-magic'"):
        peaks.peak_gops("sparse-magic", 1)
    with pytest.raises(RuntimeError, match="threads must be >= 1"):
        peaks.peak_gops(peaks.peak_kinds()[0], 0)
    measured = measure_peaks({"fp32-fma", "not-a-path"}, threads=1)
    assert measured["not-a-path"] is None and (measured["fp32-fma"] or 0) > 1.0


def test_linear_paths() -> None:
    if cpu_matmul_ops() is None:
        pytest.skip("native kernels unavailable")
    isa = cpu_matmul_ops().isa()
    w = torch.randn(48, 64)
    four, eight = QuantMatmul([quantize_int4(w)]), QuantMatmul([quantize_int8(w)])
    vnni = "vnni" in isa
    assert linear_path(four, 64, torch.float32) == (f"Q4_1: int8 kernel ({isa})", "int8-vnni" if vnni else "int8-i16")
    assert linear_path(eight, 1, torch.float32) == (f"I8: int8 kernel ({isa})", "int8-vnni" if vnni else "int8-i32")
    four.bf16_max_rows = BF16_KERNEL_MAX_ROWS  # the AMX CPUs' split (`bf16_kernel_max_rows`), on any CPU
    label, kind = linear_path(four, BF16_KERNEL_MAX_ROWS + 1, torch.bfloat16)
    assert label == "Q4_1: dequantize + bfloat16 matmul"
    flags = cpu_flags()
    assert kind == ("amx-bf16" if "amx_bf16" in flags else "bf16-avx512" if "avx512_bf16" in flags else "fp32-fma")
    assert linear_path(torch.nn.Linear(64, 48), 64, torch.float32) == ("float32 dense (oneDNN/MKL)", "fp32-fma")
    dense = QuantMatmul([bf16_rows(w)])
    fma = (f"BF16: bf16 tiles, fp32 FMA kernel ({isa})", "fp32-fma")
    pairs = (f"BF16: bf16 tiles, vdpbf16ps kernel ({isa})", "bf16-avx512")
    assert linear_path(dense, 32, torch.bfloat16) == (pairs if cpu_matmul_ops().bf16_pair_products() else fma)
    assert linear_path(dense, 32, torch.float32) == fma  # fp32 inputs are not rounded to bf16 pairs
