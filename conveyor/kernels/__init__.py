"""Optional native CPU kernels: paged attention (decode and prefill), the decoder layer's fused
elementwise ops (RMSNorm, RoPE, SiLU * up), the weight-streaming matmuls over quantized, int8, bf16
and fp32 tiles, the native decode stack, grouped experts and LoRA deltas, Mamba-2's decode rows, and the
sampler.

They are plain C++ behind a C ABI, called through ctypes, compiled once per compiler and CPU into one
shared library that every environment on the machine shares (build.py; `conveyor build-kernels`,
run by scripts/setup.sh, builds it ahead of the first start). Each accessor below returns the
wrapper of one group of kernels, or None where they cannot run (no compiler, a failed build, or
`CONVEYOR_NATIVE_KERNELS=0`): the PyTorch code runs instead. The compute-peak loops of the roofline
diagnostics are a library of their own, built at their first use.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import cache

from .attention_ops import PagedAttentionOps
from .build import KERNELS, PEAKS, Library
from .cpu import cpu_flags, vector_flags
from .fused_ops import FusedOps
from .lora_ops import LoRAOps
from .matmul_ops import MatmulOps
from .native import Native, load, native_kernels_enabled
from .peak_ops import PeakOps
from .sampling_ops import SamplingOps
from .ssm_ops import SsmOps

__all__ = ["cpu_flags", "vector_flags", "native_kernels_enabled", "cpu_paged_attention", "cpu_fused_ops",
           "cpu_matmul_ops", "cpu_sampling_ops", "cpu_lora_ops", "cpu_ssm_ops", "cpu_peak_ops", "build_all"]


def _wrapper(library: Library, kind: Callable[..., Native]) -> Callable[[], Native | None]:
    @cache
    def accessor() -> Native | None:
        if not native_kernels_enabled():
            return None
        lib = load(library)
        return None if lib is None else kind(lib)

    return accessor


cpu_paged_attention: Callable[[], PagedAttentionOps | None] = _wrapper(KERNELS, PagedAttentionOps)  # type: ignore
cpu_fused_ops: Callable[[], FusedOps | None] = _wrapper(KERNELS, FusedOps)  # type: ignore
cpu_matmul_ops: Callable[[], MatmulOps | None] = _wrapper(KERNELS, MatmulOps)  # type: ignore
cpu_sampling_ops: Callable[[], SamplingOps | None] = _wrapper(KERNELS, SamplingOps)  # type: ignore
cpu_lora_ops: Callable[[], LoRAOps | None] = _wrapper(KERNELS, LoRAOps)  # type: ignore
cpu_ssm_ops: Callable[[], SsmOps | None] = _wrapper(KERNELS, SsmOps)  # type: ignore
cpu_peak_ops: Callable[[], PeakOps | None] = _wrapper(PEAKS, PeakOps)  # type: ignore


def build_all(peaks: bool = False) -> dict[str, float | None]:
    """Build (or find in the cache) the kernels the engine runs, and with `peaks` the benchmarks' peak
    loops: per library, the seconds it took, or None where it cannot be built."""
    results: dict[str, float | None] = {}
    for library in (KERNELS, PEAKS) if peaks else (KERNELS,):
        started = time.monotonic()
        results[library.name] = time.monotonic() - started if load(library) is not None else None
    return results
