"""MXFP4 weights (how gpt-oss ships its experts) as GGUF Q8_0 blocks, losslessly, without a float detour.

An MXFP4 checkpoint (`quantization_config.quant_method == "mxfp4"`) stores a matrix as `*_blocks`
(uint8, two e2m1 values a byte: value 2j in the low nibble of byte j, 2j + 1 in the high one) and
`*_scales` (one e8m0 exponent e per 32 values: the block's values are e2m1 * 2^(e - 127)), rows
being output features as in `nn.Linear` (transformers' `convert_moe_packed_tensors` is the reference).

Every e2m1 value times 2 is an integer in {0, 1, 2, 3, 4, 6, 8, 12} (signed), so a block is exactly a
Q8_0 block: int8 values 2 * e2m1 and the fp16 scale 2^(e - 128), exact wherever that power of two is
one fp16 holds (2^-24 to 2^15, subnormals included). The Q8_0 kernels then run it as it is: 8.5 bits a
weight against MXFP4's 4.25, half of bf16's 16. A block whose exponent fits no fp16 (and is not all
zeros, where the scale does not matter) is refused by `mxfp4_to_q8_0`; the loader then keeps that
matrix dense (`dequantize_mxfp4`), saying so.

A GGUF file's MXFP4 (llama.cpp's type 39, as its converter writes gpt-oss) stores a block as 17 bytes: the
e8m0 exponent, then 16 bytes whose low nibbles are values 0-15 and high nibbles values 16-31 (`from_ggml`
reorders them into the checkpoints' layout).
"""

from __future__ import annotations

from typing import Any

import torch

from .tensors import GGMLType, QuantizedTensor

# e2m1 by its 4 bits (sign, 2 exponent bits, 1 mantissa bit): transformers' FP4_VALUES.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_BIAS = 127
FP16_POWERS = (-24, 15)  # the powers of two an fp16 holds exactly (subnormal 2^-24 to 2^15)
BLOCK = 32  # values per scale


def is_mxfp4(quantization_config: Any) -> bool:
    """Whether a config's `quantization_config` (a dict as config.json has it, or transformers' object) says MXFP4."""
    q = quantization_config
    method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
    return str(method).lower() == "mxfp4"


def _values(blocks: torch.Tensor) -> torch.Tensor:
    """The 4-bit codes of `[rows, groups, 16]` packed bytes as `[rows, groups, 32]`, in value order."""
    return torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(*blocks.shape[:-1], BLOCK).long()


def _check(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() != 3 or blocks.shape[-1] != BLOCK // 2 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(f"MXFP4 blocks must be [rows, groups, {BLOCK // 2}] with scales [rows, groups], got "
                         f"{list(blocks.shape)} and {list(scales.shape)}")


def mxfp4_to_q8_0(blocks: torch.Tensor, scales: torch.Tensor) -> QuantizedTensor:
    """`[rows, groups, 16]` blocks and `[rows, groups]` scales as a Q8_0 `[rows, 32 * groups]` tensor with
    the same values; ValueError naming the first block whose scale fits no fp16."""
    _check(blocks, scales)
    rows, groups = scales.shape
    q = torch.tensor([2 * v for v in FP4_VALUES], dtype=torch.int8)[_values(blocks)]
    exponent = scales.to(torch.int32) - E8M0_BIAS - 1
    used = q.ne(0).any(dim=-1)
    bad = used & ((exponent < FP16_POWERS[0]) | (exponent > FP16_POWERS[1]) | (scales == 255))
    if bad.any():
        row, group = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{int(bad.sum())} MXFP4 blocks have scales outside fp16's powers of two "
                         f"(2^{FP16_POWERS[0]} to 2^{FP16_POWERS[1]}), first: row {row}, block {group}, e8m0 "
                         f"{int(scales[row, group])}")
    d = torch.where(used, torch.exp2(exponent.float()), 0.0).half()  # exact: a power of two in range
    data = torch.cat((d.unsqueeze(-1).view(torch.uint8), q.view(torch.uint8)), dim=-1)  # [rows, groups, 34]
    return QuantizedTensor(data.reshape(rows, -1).contiguous(), GGMLType.Q8_0, (rows, groups * BLOCK))


def from_ggml(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A GGUF MXFP4 matrix `[rows, 17 * groups]` (uint8) as the checkpoints' `[rows, groups, 16]` blocks and
    `[rows, groups]` scales."""
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, 1 + BLOCK // 2)
    scales, packed = blocks[..., 0].contiguous(), blocks[..., 1:]
    codes = torch.cat((packed & 0x0F, packed >> 4), dim=-1)  # [rows, groups, 32] in value order
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous(), scales


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The `[rows, 32 * groups]` values (exact in fp32), as transformers' `convert_moe_packed_tensors`
    computes them (before its transpose)."""
    _check(blocks, scales)
    values = torch.tensor(FP4_VALUES)[_values(blocks)]
    out = torch.ldexp(values, (scales.to(torch.int32) - E8M0_BIAS).unsqueeze(-1).float())
    return out.reshape(scales.shape[0], -1).to(dtype)
