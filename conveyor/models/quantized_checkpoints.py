"""Checkpoints whose weights another tool quantized (`quantization_config.quant_method` in config.json): which
formats load, and their tensors turned into what the model takes (`convert`).

- "mxfp4" (gpt-oss): read by the model itself (`models.gpt_oss`), its blocks kept or dequantized.
- "fp8": dequantized at load (`fp8_checkpoint`).
- "compressed-tensors", "gptq", "awq": integer weights kept in a kernel type where one holds them, else
  dequantized (`compressed_tensors`, `gptq_awq`); `KEPT` names them.
Any other method is refused at load with what to serve instead.
"""

from __future__ import annotations

from typing import Any

import torch

from ..layers.quantization.mxfp4 import is_mxfp4
from ..layers.quantization.tensors import QuantizedTensor
from . import compressed_tensors, gptq_awq
from .fp8_checkpoint import FP8_DTYPES, block_size, dequantize_fp8, is_fp8

KEPT = ("compressed-tensors", "gptq", "awq")  # formats whose integer weights stay in kernel types
SPLIT_BY_RANKS = ("mxfp4",)  # formats a tensor-parallel rank can read a slice of (the others are converted whole)


def checkpoint_format(quantization_config: Any) -> str | None:
    """The format of a checkpoint's `quantization_config` (None: none); ValueError for one we do not read."""
    q = quantization_config
    if q is None:
        return None
    if is_mxfp4(q):
        return "mxfp4"
    if is_fp8(q):
        return "fp8"
    if compressed_tensors.is_compressed_tensors(q):
        return "compressed-tensors"
    method = gptq_awq.quant_method(q)
    if method is not None:
        return method
    raise ValueError(f"weights quantized with {str(_method(q))!r} (its config's quantization_config), which Conveyor "
                     "does not read: serve the model's unquantized checkpoint (with --quantization int8 or int4 for "
                     "smaller weights), a GGUF file of it, or its fp8, compressed-tensors, GPTQ or AWQ release")


def _method(q: Any) -> Any:
    return q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)


def stored_raw(fmt: str | None, name: str, tensor: torch.Tensor) -> bool:
    """Whether a tensor stays as stored until `convert` (not cast to the compute dtype as it is read)."""
    if fmt == "fp8":
        return tensor.dtype in FP8_DTYPES or "_scale" in name
    return fmt in KEPT


def convert(fmt: str | None, state_dict: dict[str, torch.Tensor], quantization_config: Any, dtype: torch.dtype,
            keep: bool) -> dict[str, torch.Tensor | QuantizedTensor]:
    """The tensors as the model takes them: quantized weights dequantized to `dtype`, or kept in a kernel type
    (`keep`, for the `KEPT` formats); ValueError naming what is missing or not supported."""
    if fmt == "fp8":
        return dequantize_fp8(state_dict, block_size(quantization_config), dtype)
    if fmt == "compressed-tensors":
        return compressed_tensors.decompress(state_dict, dict(quantization_config), dtype, keep)
    if fmt in ("gptq", "awq"):
        return gptq_awq.decompress(state_dict, fmt, dict(quantization_config), dtype, keep)
    return state_dict
