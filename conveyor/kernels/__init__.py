"""Optional native kernels, compiled on first use with torch's C++ extension builder.

Built once per machine (cached by torch under `~/.cache/torch_extensions`, or
`$TORCH_EXTENSIONS_DIR`, ~40 s each the first time) and used for fp32 on CPU: the paged
decode-attention kernel, and the fused elementwise ops of the decoder layer (RMSNorm, RoPE,
SiLU * up). If one cannot be built (no compiler), the PyTorch code runs instead.
`CONVEYOR_NATIVE_KERNELS=0` turns both off.
"""

from __future__ import annotations

import logging
import os
from functools import cache
from pathlib import Path
from types import ModuleType

logger = logging.getLogger("conveyor")


def native_kernels_enabled() -> bool:
    return os.environ.get("CONVEYOR_NATIVE_KERNELS") != "0"


def _build(name: str, source: str, *cflags: str) -> ModuleType | None:
    from torch.utils.cpp_extension import load

    try:
        return load(name=name, sources=[str(Path(__file__).with_name(source))],
                    extra_cflags=["-O3", "-march=native", *cflags, "-fopenmp"], extra_ldflags=["-fopenmp"],
                    verbose=False)
    except Exception as exc:  # no compiler, no headers: the PyTorch path still works
        logger.warning("native kernel %s unavailable, using PyTorch instead: %s", name, exc)
        return None


@cache
def cpu_paged_attention() -> ModuleType | None:
    """The paged decode-attention extension, or None when the build fails."""
    return _build("conveyor_paged_attention_cpu", "paged_attention_cpu.cpp", "-ffp-contract=fast")


@cache
def cpu_fused_ops() -> ModuleType | None:
    """The fused elementwise ops (`rms_norm`, `rope_`, `silu_mul`), or None when the build fails. No
    contraction into fused multiply-adds, so each op rounds like the PyTorch ops it replaces."""
    return _build("conveyor_fused_cpu", "fused_cpu.cpp", "-ffp-contract=off")
