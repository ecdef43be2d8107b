"""Which dtype and which weight format a model runs in: `dtype` and `quantization`, resolved once.

`dtype="auto"` (the default) is bf16 on CUDA; on CPU bf16 where the CPU has native bf16 dot
products (AVX512-BF16 or AMX-BF16), fp32 elsewhere. `dtype="float32"` asked for explicitly is
the exact path: dense fp32 weights (a GGUF file's quantized tensors dequantized), greedy outputs
identical to transformers' fp32 eager, so it takes no quantization.

`quantization`: "none" (dense weights), "int8" (per-channel int8), "int4" (groups of 32, 4-bit),
"gguf" (a GGUF file's own quantized tensors, kept as they are), "mxfp4" (an MXFP4 checkpoint's
blocks, kept as they are), "compressed-tensors", "gptq", "awq" (such a checkpoint's integer weights, kept
where a kernel takes them). None = the file's own format ("gguf" for a GGUF file with quantized tensors,
"mxfp4", "compressed-tensors", "gptq" or "awq" for such a checkpoint) unless the exact path was asked for,
"none" otherwise. Quantized weights run on CPU only (their kernels are CPU kernels).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..kernels import cpu_flags
from .quantization.mxfp4 import is_mxfp4
from .quantization.registry import canonical_quantization, quantization_method

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# What a checkpoint must be for a format that keeps its stored tensors (`QuantizationMethod.keeps_stored`).
_KEPT_CHECKPOINTS = ("compressed-tensors", "gptq", "awq")  # quant_methods whose integer weights may be kept
_STORED_IN = {"gguf": "a GGUF file", "mxfp4": "an MXFP4 checkpoint (quantization_config.quant_method 'mxfp4')"} | {
    m: f"a {m} checkpoint (quantization_config.quant_method {m!r})" for m in _KEPT_CHECKPOINTS}


@dataclass(frozen=True)
class Precision:
    """The resolved choice. `quantization` None = decided by the file (`resolve_quantization`)."""

    dtype: torch.dtype
    quantization: str | None
    exact: bool  # dtype="float32" asked for explicitly
    reason: str  # why this dtype, for the start-up log line


def cpu_native_bf16() -> list[str]:
    """The CPU flags that give native bf16 dot products (empty: none)."""
    return [f for f in BF16_FLAGS if f in cpu_flags()]


def stored_format(model_path: str | Path | None) -> str | None:
    """The quantized format a checkpoint stores, by its path: "gguf" for a GGUF file (None: the built-in
    model, one), "mxfp4", "compressed-tensors", "gptq" or "awq" for a Hugging Face directory whose config.json
    says so, else None."""
    if model_path is None or Path(model_path).suffix.lower() == ".gguf":
        return "gguf"
    config = Path(model_path) / "config.json"
    try:
        quant = json.loads(config.read_text()).get("quantization_config") if config.is_file() else None
    except (OSError, ValueError):
        return None  # (the loader reports an unreadable config)
    if is_mxfp4(quant):
        return "mxfp4"
    method = str(quant.get("quant_method")).lower() if isinstance(quant, dict) else None
    return method if method in _KEPT_CHECKPOINTS else None


def resolve_precision(dtype: str | torch.dtype, quantization: str | None, device: torch.device,
                      model_path: str | Path | None) -> Precision:
    """Validate `dtype` and `quantization` for this device and model file; ValueError names the choices."""
    quantization = canonical_quantization(quantization)
    method = quantization_method(quantization) if quantization is not None else None
    if isinstance(dtype, str) and dtype != "auto" and dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or 'auto', got {dtype!r}")
    exact = dtype == torch.float32 or (isinstance(dtype, str) and _DTYPES.get(dtype) is torch.float32)
    if exact and method is not None and not method.dense:
        raise ValueError(f"dtype='float32' is the exact path (dense fp32 weights): it takes no quantization "
                         f"(got {quantization!r}); use dtype='auto' or 'bfloat16' with quantization={quantization!r}, "
                         "or quantization='none' with float32")
    if method is not None and device.type not in method.devices:
        where = " and ".join(d.upper() for d in method.devices)
        raise ValueError(f"quantization={quantization!r} runs on {where} only; on {device.type} use "
                         "quantization='none' (or None)")
    stored = stored_format(model_path)
    if method is not None and method.keeps_stored and stored != method.name:
        raise ValueError(f"quantization={quantization!r} needs {_STORED_IN.get(method.name, method.name)}, "
                         f"{model_path} is not one; use 'int8', 'int4' or 'none'")
    if dtype == "auto":
        if device.type == "cuda":
            resolved, reason = torch.bfloat16, "bf16 on CUDA"
        elif cpu_native_bf16():
            resolved, reason = torch.bfloat16, f"bf16: the CPU has {', '.join(cpu_native_bf16())}"
        else:
            resolved, reason = torch.float32, "fp32: the CPU has no native bf16 dot products (avx512_bf16, amx_bf16)"
    else:
        resolved = dtype if isinstance(dtype, torch.dtype) else _DTYPES[dtype]
        reason = f"{str(resolved).removeprefix('torch.')} as asked"
    if device.type == "cpu" and quantization is None and stored is None:
        quantization = "none"
    if exact or device.type != "cpu":
        quantization = "none"
    return Precision(resolved, quantization, exact, reason)


def keeps_stored(quantization: str | None, device: torch.device) -> bool:
    """Whether a checkpoint's quantized tensors are loaded as stored (`quantization` None: the file decides)."""
    return device.type == "cpu" and (quantization is None or quantization_method(quantization).keeps_stored)


def resolve_quantization(precision: Precision, stored: str | None) -> str:
    """The weight format once the file is read (`stored`: `Checkpoint.stored_format`, the format of the
    quantized tensors it holds): None means that format, if any."""
    if precision.quantization is not None:
        if quantization_method(precision.quantization).keeps_stored and stored != precision.quantization:
            raise ValueError(f"quantization={precision.quantization!r} needs quantized tensors, and this file "
                             "has none a kernel takes; use 'int8', 'int4' or 'none'")
        return precision.quantization
    return stored or "none"
