"""compressed-tensors checkpoints (`quantization_config.quant_method` "compressed-tensors": what llm-compressor
writes and vLLM serves, e.g. RedHatAI's `*-quantized.w4a16`, `*-quantized.w8a8` and `*-FP8-dynamic` releases).

Each quantized linear stores its weight as integers (`weight_packed`: 4- or 8-bit values packed densely into
int32 words, `pack-quantized`; or `weight` in int8, `int-quantized` / `naive-quantized`) or as fp8
(`float-quantized`), with `weight_scale` per tensor, output row, group of columns or block, an optional
`weight_zero_point` (asymmetric) and `weight_g_idx` (activation ordering: each column's group). The weight is
`(q - zero_point) * scale`, computed in the scale's dtype as compressed-tensors decompresses it.

Where the kernels take the values as they are, they are kept (`keep`, the file's own format): 4-bit in
groups of a multiple of 32 (or per row) as Q4_0 (symmetric) or Q4_1 blocks, symmetric 8-bit per row as our
I8 and in groups as Q8_0 (`layers.quantization.packing`). Everything else (fp8, activation ordering, blocks,
other widths), and every weight on the exact path, is dequantized. Activation quantization (`input_*`, the
"A8" of W8A8) is not applied: activations are quantized by the kernels' own scheme, or not at all.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from ..layers.quantization.packing import kernel_weight, unpack_int32
from ..layers.quantization.tensors import QuantizedTensor

SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
_DROPPED = ("input_scale", "input_zero_point", "output_scale", "k_scale", "v_scale", "q_scale")


def is_compressed_tensors(quantization_config: Any) -> bool:
    q = quantization_config
    method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
    return str(method).lower() == "compressed-tensors"


@dataclass(frozen=True)
class WeightArgs:
    """A config group's weight quantization, as far as loading needs it."""

    format: str
    num_bits: int
    symmetric: bool
    strategy: str  # tensor, channel, group or block
    group_size: int | None
    block: tuple[int, int] | None

    @classmethod
    def from_group(cls, group: dict, default_format: str | None) -> "WeightArgs":
        w = group.get("weights") or {}
        fmt = group.get("format") or default_format
        if fmt not in FORMATS:
            raise ValueError(f"compressed-tensors format {fmt!r} is not supported (supported: {', '.join(FORMATS)})")
        if w.get("type", "int") not in ("int", "float"):
            raise ValueError(f"compressed-tensors weight type {w.get('type')!r} is not supported (supported: int, "
                             "float)")
        block = w.get("block_structure")
        return cls(fmt, int(w.get("num_bits", 8)), bool(w.get("symmetric", True)), str(w.get("strategy", "tensor")),
                   w.get("group_size"), None if block is None else (int(block[0]), int(block[1])))


def _schemes(config: dict) -> list[tuple[list[str], WeightArgs]]:
    if config.get("transform_config"):
        raise ValueError("compressed-tensors transforms (transform_config) are not supported")
    sparsity = config.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise ValueError(f"compressed-tensors sparsity ({sparsity.get('format')!r}) is not supported")
    groups = config.get("config_groups") or {}
    return [(list(g.get("targets") or []), WeightArgs.from_group(g, config.get("format"))) for g in groups.values()]


def _matches(target: str, module: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == "Linear" or module == target or module.endswith("." + target)


def _args_for(module: str, schemes: list[tuple[list[str], WeightArgs]]) -> WeightArgs:
    for targets, args in schemes:
        if any(_matches(t, module) for t in targets):
            return args
    if len(schemes) == 1:
        return schemes[0][1]
    raise ValueError(f"no compressed-tensors config group targets {module}")


def unpack(packed: torch.Tensor, num_bits: int, cols: int) -> torch.Tensor:
    """`pack-quantized` int32 words back to the signed values (stored with an offset of `2 ** (num_bits - 1)`),
    `[rows, cols]` int16."""
    return unpack_int32(packed, num_bits, cols) - (1 << (num_bits - 1))


def _expand(scale: torch.Tensor, args: WeightArgs, shape: tuple[int, int], g_idx: torch.Tensor | None) -> torch.Tensor:
    """A per-tensor, row, group or block scale (or zero point) spread over the weight's `shape`."""
    rows, cols = shape
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(rows, cols)
    if args.strategy == "block" and args.block is not None:
        br, bc = args.block
        return scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    scale = scale.reshape(rows, -1)
    if g_idx is not None:
        return scale[:, g_idx.long()]
    return scale.repeat_interleave(-(-cols // scale.shape[1]), 1)[:, :cols]


def _dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, args: WeightArgs,
                g_idx: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    shape = tuple(q.shape)
    w = q.to(scale.dtype)
    if zero is not None:
        w = w - _expand(zero, args, shape, g_idx).to(scale.dtype)
    return (w * _expand(scale, args, shape, g_idx)).to(dtype)


def _kept(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, args: WeightArgs) -> QuantizedTensor | None:
    """The weight in a kernel type as stored (`packing.kernel_weight`), None where no kernel type holds it."""
    rows, cols = q.shape
    if scale.numel() == 1 or args.strategy == "channel":
        group_size, scale = cols, scale.reshape(-1, 1).expand(rows, 1)
    elif args.strategy == "group" and args.group_size:
        group_size, scale = args.group_size, scale.reshape(rows, -1)
    else:
        return None
    mid = 1 << (args.num_bits - 1)
    zero = None if zero is None else zero.reshape(rows, -1).to(torch.int16) + mid
    return kernel_weight(q.to(torch.int16) + mid, scale, zero, args.num_bits, group_size)  # (int8 q would wrap)


def decompress(state_dict: dict[str, torch.Tensor], config: dict, dtype: torch.dtype,
               keep: bool) -> dict[str, torch.Tensor | QuantizedTensor]:
    """The checkpoint's tensors by the model's names: each quantized weight as `<module>.weight`, kept in a kernel
    type where `keep` allows and one holds it, else dequantized to `dtype`; other floats cast to `dtype`.
    ValueError naming what is not supported."""
    schemes = _schemes(config)
    modules = {name.rsplit(".", 1)[0] for name in state_dict if name.endswith(".weight_scale")}
    out: dict[str, torch.Tensor | QuantizedTensor] = {}
    for module in sorted(modules):
        args = _args_for(module, schemes)
        scale = state_dict[f"{module}.weight_scale"]
        zero = state_dict.get(f"{module}.weight_zero_point")
        g_idx = state_dict.get(f"{module}.weight_g_idx")
        if args.format == "pack-quantized":
            shape = [int(v) for v in state_dict[f"{module}.weight_shape"]]
            q = unpack(state_dict[f"{module}.weight_packed"], args.num_bits, shape[1])
            if zero is not None and not args.symmetric and zero.dtype == torch.int32:  # (packed along rows)
                zero = unpack(zero.t(), args.num_bits, shape[0]).t()
        else:
            q = state_dict[f"{module}.weight"]
        if zero is not None and args.symmetric:
            zero = None  # (all zeros)
        kept = _kept(q, scale, zero, args) if keep and g_idx is None and args.format != "float-quantized" else None
        out[f"{module}.weight"] = kept if kept is not None else _dequantize(q, scale, zero, args, g_idx, dtype)
    for name, value in state_dict.items():
        module, _, suffix = name.rpartition(".")
        if module in modules and (suffix in SUFFIXES or suffix == "weight") or suffix in _DROPPED:
            continue
        out[name] = value.to(dtype) if value.is_floating_point() else value
    return out
