"""What this CPU can run: its feature flags, read once, for picking kernels and for naming the
instruction set beside every figure."""

from __future__ import annotations

from functools import cache
from pathlib import Path

# CPU flags that change what -march=native compiles; read from /proc/cpuinfo where there is one.
VECTOR_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
                "avx512_bf16", "amx_bf16", "amx_int8", "avx512_fp16")


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo); empty where they cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def vector_flags() -> list[str]:
    """The vector-instruction flags of this CPU that matter to the kernels, for logs and figures."""
    return [f for f in VECTOR_FLAGS if f in cpu_flags()]
