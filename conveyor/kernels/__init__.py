"""Optional native kernels, compiled on first use with torch's C++ extension builder.

The CPU paged decode-attention kernel is built once per machine (cached by torch under
`~/.cache/torch_extensions`, or `$TORCH_EXTENSIONS_DIR`) and used for fp32 on CPU. If it cannot be
built (no compiler), the pure PyTorch attention is used instead.
"""

from __future__ import annotations

import logging
from functools import cache
from pathlib import Path
from types import ModuleType

logger = logging.getLogger("conveyor")


@cache
def cpu_paged_attention() -> ModuleType | None:
    """The compiled extension, or None when the build fails."""
    from torch.utils.cpp_extension import load

    source = Path(__file__).with_name("paged_attention_cpu.cpp")
    try:
        return load(name="conveyor_paged_attention_cpu", sources=[str(source)],
                    extra_cflags=["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp"], extra_ldflags=["-fopenmp"],
                    verbose=False)
    except Exception as exc:  # no compiler, no headers: the PyTorch path still works
        logger.warning("CPU attention kernel unavailable, using PyTorch attention: %s", exc)
        return None
