"""MXFP4 weights (how gpt-oss ships its experts) kept as they are: 4.25 bits a weight, for the kernels' MXFP4 tiles.

An MXFP4 checkpoint (`quantization_config.quant_method == "mxfp4"`) stores a matrix as `*_blocks`
(uint8, two e2m1 values a byte: value 2j in the low nibble of byte j, 2j + 1 in the high one) and
`*_scales` (one e8m0 exponent e per 32 values: the block's values are e2m1 * 2^(e - 127)), rows
being output features as in `nn.Linear` (transformers' `convert_moe_packed_tensors` is the reference).
A GGUF file stores the same values as llama.cpp's MXFP4 (type 39): per block of 32, the exponent byte,
then 16 bytes whose low nibbles are values 0-15 and high nibbles values 16-31. That is the layout a
`QuantizedTensor` of type MXFP4 holds (`to_ggml` reorders a checkpoint's blocks into it; a GGUF file's rows
are taken as they are).

The kernels multiply every e2m1 code by 2 (an integer in {0, 1, 2, 3, 4, 6, 8, 12}, signed: ggml's
kvalues_mxfp4) and the block by the fp16 scale 2^(e - 128), exact wherever that power of two is one fp16
holds (2^-24 to 2^15, subnormals included). A block whose exponent fits no fp16 (and is not all zeros, where
the scale does not matter) is refused by `ggml_tensor`; the loader then keeps that matrix dense
(`dequantize_mxfp4`), saying so.
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


def to_ggml(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`[rows, groups, 16]` checkpoint blocks and `[rows, groups]` scales as llama.cpp's MXFP4 rows
    `[rows, 17 * groups]`: the exponent, then values 0-15 in the low nibbles and 16-31 in the high ones."""
    _check(blocks, scales)
    codes = _values(blocks)  # [rows, groups, 32] in value order
    packed = (codes[..., :BLOCK // 2] | (codes[..., BLOCK // 2:] << 4)).to(torch.uint8)
    return torch.cat((scales.unsqueeze(-1), packed), dim=-1).reshape(scales.shape[0], -1).contiguous()


def ggml_tensor(data: torch.Tensor, cols: int) -> QuantizedTensor:
    """llama.cpp's MXFP4 rows `[rows, 17 * cols / 32]` (uint8) as a `QuantizedTensor`; ValueError naming the
    first block whose scale fits no fp16."""
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, 1 + BLOCK // 2)
    exponent = blocks[..., 0].to(torch.int32) - E8M0_BIAS - 1
    used = (blocks[..., 1:] & 0x77).ne(0).any(dim=-1)  # a nonzero magnitude in either nibble (bit 3: the sign)
    bad = used & ((exponent < FP16_POWERS[0]) | (exponent > FP16_POWERS[1]))
    if bad.any():
        row, group = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{int(bad.sum())} MXFP4 blocks have scales outside fp16's powers of two "
                         f"(2^{FP16_POWERS[0]} to 2^{FP16_POWERS[1]}), first: row {row}, block {group}, e8m0 "
                         f"{int(blocks[row, group, 0])}")
    return QuantizedTensor(data.contiguous(), GGMLType.MXFP4, (rows, cols))


def mxfp4_tensor(blocks: torch.Tensor, scales: torch.Tensor) -> QuantizedTensor:
    """A checkpoint's `[rows, groups, 16]` blocks and `[rows, groups]` scales as an MXFP4 `QuantizedTensor`."""
    return ggml_tensor(to_ggml(blocks, scales), scales.shape[1] * BLOCK)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The `[rows, 32 * groups]` values (exact in fp32), as transformers' `convert_moe_packed_tensors`
    computes them (before its transpose)."""
    _check(blocks, scales)
    values = torch.tensor(FP4_VALUES)[_values(blocks)]
    out = torch.ldexp(values, (scales.to(torch.int32) - E8M0_BIAS).unsqueeze(-1).float())
    return out.reshape(scales.shape[0], -1).to(dtype)
