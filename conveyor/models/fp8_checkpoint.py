"""FP8 checkpoints (`quantization_config.quant_method` "fp8", as Qwen's `*-FP8` releases ship): e4m3 weights with
a scale per block of `weight_block_size` (`*.weight_scale_inv`, transformers' fine-grained FP8) or per tensor or
output row (`*.weight_scale`), dequantized at load, exactly in fp32 and then to the compute dtype, as
transformers does on a CPU. The model then runs them as any dense checkpoint (`--quantization int8` or `int4`
quantize them again). Activation scales (`*.input_scale`) are not read: activations are never fp8 here."""

from __future__ import annotations

from typing import Any

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(quantization_config: Any) -> bool:
    q = quantization_config
    method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
    return str(method).lower() == "fp8"


def block_size(quantization_config: Any) -> tuple[int, int] | None:
    """The config's `weight_block_size` (rows, columns), None where the scales are per tensor or row."""
    q = quantization_config
    size = q.get("weight_block_size") if isinstance(q, dict) else getattr(q, "weight_block_size", None)
    return None if size is None else (int(size[0]), int(size[1]))


def dequantize_fp8(state_dict: dict[str, torch.Tensor], block: tuple[int, int] | None,
                   dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`state_dict` with every fp8 weight times its scales, in `dtype`; the scales dropped. ValueError naming
    an fp8 weight without its scale."""
    out = {}
    for name, value in state_dict.items():
        if name.endswith(("_scale_inv", ".weight_scale", ".input_scale")):
            continue
        if value.dtype not in FP8_DTYPES:
            out[name] = value
            continue
        scale = state_dict.get(name + "_scale_inv")
        if scale is not None:  # (transformers' default block: 128 x 128)
            (rows, cols), (block_rows, block_cols) = value.shape, block or (128, 128)
            scale = scale.float().repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)[:, :cols]
        elif (scale := state_dict.get(name + "_scale")) is None:
            raise ValueError(f"the FP8 weight {name} has no scale (weight_scale_inv with weight_block_size, or "
                             "weight_scale)")
        out[name] = (value.float() * scale.float()).to(dtype)
    return out
