"""Loading the native libraries through ctypes, and what every kernel wrapper shares: the C types,
the dtype codes, tensor checks and the error a failed call raises.

ctypes releases the GIL for the length of every call, so the server's event loop runs while a kernel
does. torch is imported before any library is loaded: its OpenMP runtime (torch/lib/libgomp.so.1)
is then the one the kernels bind to, so kernels and PyTorch ops share one team of threads.
"""

from __future__ import annotations

import ctypes
import logging
import os
from functools import cache
from typing import Any

import torch

from .build import Library, build

logger = logging.getLogger("conveyor")

P, I32, I64, F32, F64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_double
DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # runtime.h's DType
INT8_ROWS = 2  # runtime.h's kI8: an int8 KV cache's rows with their scales (cache/kv_format.py)


def native_kernels_enabled() -> bool:
    return os.environ.get("CONVEYOR_NATIVE_KERNELS") != "0"


@cache
def load(library: Library) -> ctypes.CDLL | None:
    """The library, built first if needed; None when it cannot be built or loaded (logged once)."""
    path = build(library)
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        logger.warning("native kernels %s could not be loaded, the PyTorch code runs instead: %s", library.name, exc)
        return None
    lib.conveyor_last_error.restype = ctypes.c_char_p
    lib.conveyor_last_error.argtypes = ()
    return lib


def bind(lib: ctypes.CDLL, name: str, restype: Any, *argtypes: Any) -> Any:
    """The entry point `name` with its C signature declared (ctypes converts and checks each argument)."""
    function = getattr(lib, name)
    function.restype, function.argtypes = restype, argtypes
    return function


class Native:
    """Base of the kernel wrappers: the library, and its last error as a RuntimeError."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    def check(self, status: int) -> None:
        if status:
            raise RuntimeError(self.lib.conveyor_last_error().decode())


def require(condition: bool, message: str) -> None:
    """A tensor check before a call (the C side trusts its pointers): RuntimeError naming what is wrong."""
    if not condition:
        raise RuntimeError(message)


def dtype_code(t: torch.Tensor, name: str) -> int:
    """runtime.h's code for an fp32 or bf16 CPU tensor."""
    code = DTYPES.get(t.dtype)
    require(code is not None and t.device.type == "cpu", f"{name} must be an fp32 or bf16 CPU tensor")
    return code  # type: ignore[return-value]


def pointer(t: torch.Tensor | None) -> int | None:
    """A tensor's data address, or NULL for None and for an empty tensor (an optional input)."""
    return None if t is None or t.numel() == 0 else t.data_ptr()


def int64_vector(t: torch.Tensor, name: str) -> int:
    require(t.dtype == torch.int64 and t.is_contiguous() and t.device.type == "cpu",
            f"{name} must be a contiguous int64 CPU tensor")
    return t.data_ptr()


def threads() -> int:
    """The thread count a call runs on: torch's for the calling thread, as its own ops would use."""
    return torch.get_num_threads()
