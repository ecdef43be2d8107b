"""Integer weights as other tools pack them (compressed-tensors, GPTQ, AWQ), read back and, where the values fit
one, laid out as a kernel type: `w = (u - zero) * scale` over groups of columns, with unsigned `u`.

- 4-bit, the zero at 8 for every group (symmetric): Q4_0 (`d * (u - 8)`, the same nibbles; d the scale as
  fp16: exact for fp16 and bf16 scales in fp16's range).
- 4-bit, any zeros: Q4_1 (`d * u + m`, m = `-zero * scale` rounded to fp16: at most 1/128 of a step off).
- 8-bit, the zero at 128: per-channel int8 (I8, fp32 row scales: exact) with one scale a row, Q8_0 with groups.
Groups must fall on 32-column blocks (a multiple of 32 columns, or one a row).
"""

from __future__ import annotations

import numpy as np
import torch

from .tensors import I8, GGMLType, QuantizedTensor


def unpack_int32(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """`[rows, words]` int32 holding `bits`-bit values densely from bit 0 up (little-endian words) -> the first
    `count` unsigned values of each row, `[rows, count]` int16."""
    rows = words.shape[0]
    data = words.contiguous().view(torch.uint8).reshape(rows, -1)
    if bits == 4:
        values = torch.stack((data & 0xF, data >> 4), dim=-1).reshape(rows, -1)
    elif bits == 8:
        values = data
    else:
        unpacked = np.unpackbits(data.numpy(), axis=1, bitorder="little")[:, :count * bits]
        places = 1 << np.arange(bits, dtype=np.int32)
        values = torch.from_numpy((unpacked.reshape(rows, count, bits) * places).sum(-1))
    return values[:, :count].to(torch.int16)


def kernel_weight(u: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int,
                  group_size: int) -> QuantizedTensor | None:
    """`u` `[rows, cols]` unsigned values with `scale` and `zero` `[rows, cols / group_size]` (zero None: the
    midpoint, `2 ** (bits - 1)`) as the kernel type that holds them (module docstring); None where none does."""
    rows, cols = u.shape
    groups = scale.shape[1]
    if bits not in (4, 8) or cols % 32 or group_size % 32 or cols % group_size or groups != cols // group_size:
        return None
    mid = 1 << (bits - 1)
    symmetric = zero is None or bool((zero == mid).all())
    if bits == 8 and not symmetric:
        return None
    if bits == 8 and groups == 1:
        values = (u - mid).to(torch.int8)
        return QuantizedTensor(values.view(torch.uint8), I8, (rows, cols), scale.float().reshape(rows).contiguous())
    per_block = cols // groups // 32
    d = scale.repeat_interleave(per_block, 1).half().unsqueeze(-1).view(torch.uint8)
    if bits == 8:  # Q8_0: an fp16 scale, then 32 int8 values
        values = (u - mid).to(torch.int8).view(torch.uint8).reshape(rows, cols // 32, 32)
        blocks = torch.cat([d, values], dim=-1)
        return QuantizedTensor(blocks.reshape(rows, -1).contiguous(), GGMLType.Q8_0, (rows, cols))
    b = u.to(torch.uint8).reshape(rows, cols // 32, 32)
    nibbles = b[..., :16] | (b[..., 16:] << 4)  # byte j: element j (low nibble) and j + 16 (high nibble)
    if symmetric:  # Q4_0: d * (u - 8)
        blocks = torch.cat([d, nibbles], dim=-1)
        return QuantizedTensor(blocks.reshape(rows, -1).contiguous(), GGMLType.Q4_0, (rows, cols))
    m = (-zero.float() * scale.float()).repeat_interleave(per_block, 1).half().unsqueeze(-1).view(torch.uint8)
    blocks = torch.cat([d, m, nibbles], dim=-1)
    return QuantizedTensor(blocks.reshape(rows, -1).contiguous(), GGMLType.Q4_1, (rows, cols))
