"""GPTQ and AWQ checkpoints (`quantization_config.quant_method` "gptq" or "awq", as AutoGPTQ / GPTQModel and
AutoAWQ write them: Qwen's `*-GPTQ-Int4` and `*-AWQ` releases, hugging-quants' `*-AWQ-INT4`), 4- or 8-bit.

- GPTQ: `qweight` int32 `[in / (32 / bits), out]`, values packed along the input dimension from bit 0 up;
  `qzeros` int32 `[groups, out / (32 / bits)]` packed along the output dimension, each zero stored minus one
  (`checkpoint_format` "gptq"; "gptq_v2" stores them as they are); `scales` `[groups, out]`; `g_idx` each
  input column's group (with `desc_act` the columns are grouped in another order).
- AWQ ("gemm" layout, 4-bit): `qweight` int32 `[in, out / 8]` and `qzeros` `[groups, out / 8]`, packed along
  the output dimension in the order 0 2 4 6 1 3 5 7; `scales` `[groups, out]`.

The weight is `(q - zero) * scale` of the column's group, computed in the scales' dtype (fp16) as their
kernels do. Kept where a kernel type holds the values (`packing.kernel_weight`: symmetric GPTQ as Q4_0, AWQ
and asymmetric GPTQ as Q4_1, 8-bit as int8 or Q8_0), with the columns in their groups' order; else (with
`desc_act`, other widths, and on the exact path) dequantized.
"""

from __future__ import annotations

from typing import Any

import torch

from ..layers.quantization.packing import kernel_weight, unpack_int32
from ..layers.quantization.tensors import QuantizedTensor

METHODS = ("gptq", "awq")
_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
_AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # output column j of 8 is nibble _AWQ_ORDER[j] of its word


def quant_method(quantization_config: Any) -> str | None:
    """"gptq" or "awq" for such a checkpoint's config, else None."""
    q = quantization_config
    method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
    method = str(method).lower()
    return method if method in METHODS else None


def _settings(method: str, config: dict) -> tuple[int, int, bool]:
    """(bits, group size or -1, zeros stored minus one); ValueError naming what is not supported."""
    bits = int(config.get("bits", config.get("w_bit", 4)))
    group = int(config.get("group_size", config.get("q_group_size", -1)))
    if bits not in (4, 8) or method == "awq" and bits != 4:
        raise ValueError(f"{method} with {bits}-bit weights is not supported (supported: 4 and 8 for gptq, 4 for awq)")
    if method == "awq":
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"awq version {version!r} is not supported (supported: gemm)")
        return bits, group, False
    fmt = str(config.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"gptq checkpoint_format {fmt!r} is not supported (supported: gptq, gptq_v2)")
    return bits, group, fmt == "gptq"


def _read(method: str, tensors: dict[str, torch.Tensor], bits: int, minus_one: bool
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A linear's unsigned values `[out, in]`, zeros and scales `[out, groups]`, and `g_idx` (None for AWQ)."""
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    out = scales.shape[1]
    if method == "awq":
        order = torch.arange(out).reshape(-1, 8)[:, list(_AWQ_ORDER)].reshape(-1)
        values = unpack_int32(qweight, bits, out)[:, order].t()
        zeros = unpack_int32(qzeros, bits, out)[:, order].t()
        return values, zeros, scales.t(), None
    per_word = 32 // bits
    values = unpack_int32(qweight.t(), bits, qweight.shape[0] * per_word)
    zeros = unpack_int32(qzeros, bits, out).t() + int(minus_one)
    return values, zeros, scales.t(), tensors.get("g_idx")


def _groups(g_idx: torch.Tensor | None, cols: int, group: int) -> torch.Tensor:
    """Each input column's group."""
    if g_idx is not None:
        return g_idx.long()
    size = cols if group <= 0 else group
    return torch.arange(cols) // size


def decompress(state_dict: dict[str, torch.Tensor], method: str, config: dict, dtype: torch.dtype,
               keep: bool) -> dict[str, torch.Tensor | QuantizedTensor]:
    """The checkpoint's tensors by the model's names: each quantized linear's `<module>.weight`, kept in a kernel
    type where `keep` allows and one holds it, else dequantized to `dtype`; other floats cast to `dtype`."""
    bits, group, minus_one = _settings(method, config)
    modules = {name.removesuffix(".qweight") for name in state_dict if name.endswith(".qweight")}
    out: dict[str, torch.Tensor | QuantizedTensor] = {}
    for module in sorted(modules):
        tensors = {s: state_dict[f"{module}.{s}"] for s in _SUFFIXES if f"{module}.{s}" in state_dict}
        missing = [s for s in _SUFFIXES[:3] if s not in tensors]
        if missing:
            raise ValueError(f"the {method} linear {module} has no {', '.join(missing)}")
        values, zeros, scales, g_idx = _read(method, tensors, bits, minus_one)
        cols = values.shape[1]
        groups = _groups(g_idx, cols, group)
        size = cols if group <= 0 else group
        in_order = bool((groups == torch.arange(cols) // size).all())
        kept = kernel_weight(values, scales, zeros, bits, size) if keep and in_order else None
        if kept is None:
            w = (values - zeros[:, groups]).to(scales.dtype) * scales[:, groups]
            out[f"{module}.weight"] = w.to(dtype)
        else:
            out[f"{module}.weight"] = kept
    for name, value in state_dict.items():
        module, _, suffix = name.rpartition(".")
        if module in modules and suffix in _SUFFIXES:
            continue
        out[name] = value.to(dtype) if value.is_floating_point() else value
    return out
