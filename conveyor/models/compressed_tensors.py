"""compressed-tensors checkpoints (`quantization_config.quant_method` "compressed-tensors": what llm-compressor
writes and vLLM serves, e.g. RedHatAI's `*-quantized.w4a16`, `*-quantized.w8a8` and `*-FP8-dynamic` releases).

Each quantized linear stores its weight as integers (`weight_packed`: 4- or 8-bit values packed densely into
int32 words, `pack-quantized`; or `weight` in int8, `int-quantized` / `naive-quantized`) or as fp8
(`float-quantized`), with `weight_scale` per tensor, output row, group of columns or block, an optional
`weight_zero_point` (asymmetric) and `weight_g_idx` (activation ordering: each column's group). The weight is
`(q - zero_point) * scale`, computed in the scale's dtype as compressed-tensors decompresses it.

Where the kernels take the values as they are, they are kept (`keep`, the file's own format): symmetric
4-bit in groups of a multiple of 32 (or per row) as Q4_0 blocks (the same unsigned nibbles; the scale as
fp16, exact for bf16 and fp16 scales in fp16's range), asymmetric 4-bit as Q4_1 (its minimum
`-(8 + zero_point) * scale` rounded to fp16: at most 1/128 of a step), symmetric 8-bit per row as our I8
(fp32 row scales: exact) and in groups of 32 as Q8_0. Everything else (fp8, activation ordering, blocks,
other widths), and every weight on the exact path, is dequantized. Activation quantization (`input_*`, the
"A8" of W8A8) is not applied: activations are quantized by the kernels' own scheme, or not at all.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..layers.quantization.tensors import I8, GGMLType, QuantizedTensor

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
    """`pack-quantized` int32 words (values densely packed from bit 0 up, stored with an offset of
    `2 ** (num_bits - 1)`) back to the signed values, `[rows, cols]` int16."""
    rows = packed.shape[0]
    data = packed.contiguous().view(torch.uint8).reshape(rows, -1)  # (little-endian words)
    if num_bits == 4:
        values = torch.stack((data & 0xF, data >> 4), dim=-1).reshape(rows, -1)
    elif num_bits == 8:
        values = data
    else:
        bits = np.unpackbits(data.numpy(), axis=1, bitorder="little")[:, :cols * num_bits]
        weights = (1 << np.arange(num_bits, dtype=np.int32))
        values = torch.from_numpy((bits.reshape(rows, cols, num_bits) * weights).sum(-1).astype(np.int16))
    return values[:, :cols].to(torch.int16) - (1 << (num_bits - 1))


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


def _blocks(scale: torch.Tensor, args: WeightArgs, rows: int, cols: int) -> torch.Tensor | None:
    """Per 32-column block, its fp16 scale `[rows, cols / 32]`; None where the groups do not fall on blocks."""
    if cols % 32:
        return None
    if args.strategy == "channel" or scale.numel() == 1:
        groups = 1
    elif args.strategy == "group" and args.group_size and args.group_size % 32 == 0:
        groups = -(-cols // args.group_size)
    else:
        return None
    per_block = scale.reshape(rows, -1) if scale.numel() > 1 else scale.reshape(1, 1).expand(rows, 1)
    if per_block.shape[1] != groups:
        return None
    return per_block.repeat_interleave(cols // 32 // groups, 1).half()


def _kept(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, args: WeightArgs) -> QuantizedTensor | None:
    """The weight in a kernel type as stored (module docstring), None where no kernel type holds it."""
    rows, cols = q.shape
    if args.num_bits == 8 and args.symmetric and (args.strategy == "channel" or scale.numel() == 1):
        row_scales = scale.float().reshape(-1).expand(rows).contiguous()
        return QuantizedTensor(q.to(torch.int8).view(torch.uint8), I8, (rows, cols), row_scales)
    d = _blocks(scale, args, rows, cols)
    if d is None or args.num_bits not in (4, 8) or not args.symmetric and args.num_bits == 8:
        return None
    if args.num_bits == 8:  # Q8_0: an fp16 scale, then 32 int8 values
        values = q.to(torch.int8).view(torch.uint8).reshape(rows, cols // 32, 32)
        blocks = torch.cat([d.unsqueeze(-1).view(torch.uint8), values], dim=-1)
        return QuantizedTensor(blocks.reshape(rows, -1).contiguous(), GGMLType.Q8_0, (rows, cols))
    u = (q + 8).to(torch.uint8).reshape(rows, cols // 32, 32)
    nibbles = u[..., :16] | (u[..., 16:] << 4)  # byte j: element j (low nibble) and j + 16 (high nibble)
    if args.symmetric:  # Q4_0: d * (u - 8)
        blocks = torch.cat([d.unsqueeze(-1).view(torch.uint8), nibbles], dim=-1)
        return QuantizedTensor(blocks.reshape(rows, -1).contiguous(), GGMLType.Q4_0, (rows, cols))
    zp = zero.reshape(rows, -1).repeat_interleave(cols // 32 // zero.reshape(rows, -1).shape[1], 1)
    m = (-(8 + zp.float()) * scale.reshape(rows, -1).float().repeat_interleave(
        cols // 32 // scale.reshape(rows, -1).shape[1], 1)).half()
    blocks = torch.cat([d.unsqueeze(-1).view(torch.uint8), m.unsqueeze(-1).view(torch.uint8), nibbles], dim=-1)
    return QuantizedTensor(blocks.reshape(rows, -1).contiguous(), GGMLType.Q4_1, (rows, cols))


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
