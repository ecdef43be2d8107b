"""Quantized weight matrices: GGUF's own block formats kept as they are, our int8 and int4, and dense
bf16 matrices in the same tiles (`bf16_rows`).

A `QuantizedTensor` is a `[rows, cols]` matrix stored as `rows` byte rows in one block layout:
GGUF's Q4_0, Q4_1, Q8_0, the K-quants Q2_K to Q6_K, IQ4_NL, IQ4_XS and MXFP4 (ggml's layouts, the
file's bytes unchanged, so a GGUF model takes its file size in memory), or I8, per-channel int8 (int8 rows, one fp32 scale per row).
`quantize_int8` and `quantize_int4` make them from float weights: "int8" is I8; "int4" is Q4_1
(groups of 32 weights with an fp16 scale and minimum each: 5 bits per weight), so both run through
the same kernels as GGUF files. Rows are whole blocks: only row operations (select, concatenate,
permute) are defined, which is all that loading and fusing q/k/v and gate/up need.

For the kernels, every tensor is repacked once (`tiled`) into 16-row tiles: the same bits (the
super-blocks' scales unpacked to bytes), interleaved so one vector instruction serves 16 output rows
(see `kernels/quant_layout.h`). Without the native kernels they stay GGUF rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import torch

GGMLType = gguf.GGMLQuantizationType
I8 = 1000  # our per-channel int8 (not a GGUF type); the kernels' id for it
BF16 = 1001  # dense bf16 rows, tiled for the kernels like the quantized types (not quantized)
F32 = 1002  # dense fp32 rows, likewise (a mixture-of-experts model's fp32 experts, `layers.moe`)
DENSE_BYTES = {I8: 1, BF16: 2, F32: 4}  # bytes a value of our own types (no blocks: a row is its values)

# Types the native kernels take, with their block size (weights per block).
KERNEL_TYPES: dict[int, int] = {GGMLType.Q4_0: 32, GGMLType.Q4_1: 32, GGMLType.Q8_0: 32, GGMLType.Q2_K: 256,
                                GGMLType.Q3_K: 256, GGMLType.Q4_K: 256, GGMLType.Q5_K: 256, GGMLType.Q6_K: 256,
                                GGMLType.IQ4_NL: 32, GGMLType.IQ4_XS: 256, GGMLType.MXFP4: 32, I8: 32, BF16: 1, F32: 1}
TILE_ROWS = 16  # rows of a tile of the kernels' layout
# Float types GGUF files use for tensors that are not quantized.
FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)


def type_name(qtype: int) -> str:
    return {I8: "I8", BF16: "BF16", F32: "F32"}.get(qtype) or GGMLType(qtype).name


@dataclass(frozen=True)
class FileRegion:
    """Where a tensor's rows lie in a file, unchanged (a GGUF file's tensor): its path and the byte offset
    of its first row."""

    path: str
    offset: int


@dataclass
class QuantizedTensor:
    """`shape = (rows, cols)` weights as `data` uint8 in the layout of `qtype`: GGUF's rows
    `[rows, row_bytes]` (`layout="rows"`), or 16-row tiles `[ceil(rows / 16), tile_bytes]`
    (`layout="tiles"`); `row_scales` fp32 for I8 (None otherwise), padded to whole tiles when tiled;
    `source` where the rows are in a file when `data` is a view of that file's bytes (rows can be read
    from it again)."""

    data: torch.Tensor
    qtype: int
    shape: tuple[int, int]
    row_scales: torch.Tensor | None = None
    layout: str = "rows"
    source: FileRegion | None = None

    def __post_init__(self) -> None:
        rows, cols = self.shape
        if self.qtype not in KERNEL_TYPES:
            raise ValueError(f"no kernel takes {type_name(self.qtype)} tensors")
        if cols % KERNEL_TYPES[self.qtype]:
            raise ValueError(f"{type_name(self.qtype)} rows hold multiples of {KERNEL_TYPES[self.qtype]} weights, "
                             f"got {cols}")
        if self.layout == "rows":
            expected = (rows, row_bytes(self.qtype, cols))
        else:
            expected = (-(-rows // TILE_ROWS), self.data.shape[1] if self.data.dim() == 2 else -1)
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != expected:
            raise ValueError(f"{type_name(self.qtype)} data for {self.shape} ({self.layout}) must be uint8 "
                             f"{list(expected)}, got {self.data.dtype} {list(self.data.shape)}")
        self.data = self.data.contiguous()

    @property
    def nbytes(self) -> int:
        return self.data.numel() + (0 if self.row_scales is None else self.row_scales.numel() * 4)

    @property
    def type_name(self) -> str:
        return type_name(self.qtype)

    def index_rows(self, index: torch.Tensor | np.ndarray) -> QuantizedTensor:
        """The rows `index` (a row permutation or selection), still quantized (GGUF row layout)."""
        self._need_rows("index_rows")
        index = torch.as_tensor(index, dtype=torch.long)
        scales = None if self.row_scales is None else self.row_scales[index]
        return QuantizedTensor(self.data[index], self.qtype, (len(index), self.shape[1]), scales)

    def tiled(self, ops: object) -> QuantizedTensor:
        """The 16-row tiled form the kernels (`ops`: kernels.cpu_matmul_ops()) take."""
        if self.layout == "tiles":
            return self
        scales = None
        if self.row_scales is not None:
            scales = torch.zeros(-(-self.shape[0] // TILE_ROWS) * TILE_ROWS)
            scales[:self.shape[0]] = self.row_scales
        return QuantizedTensor(ops.repack_tiles(self.data, int(self.qtype), self.shape[1]), self.qtype, self.shape,
                               scales, "tiles")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float matrix. GGUF rows through gguf's own `dequantize` (what transformers' GGUF loader
        uses, so the exact path keeps its parity with it); tiles through the native kernels."""
        if self.layout == "tiles":
            from ...kernels import cpu_matmul_ops

            out = torch.empty(self.shape, dtype=dtype)
            cpu_matmul_ops().dequantize_rows(self.data, int(self.qtype), self.row_scales_or_empty(),
                                             torch.arange(self.shape[0]), self.shape[0], out)
            return out
        if self.qtype in (BF16, F32):
            w = self.data.view(torch.bfloat16 if self.qtype == BF16 else torch.float32)
        elif self.qtype == I8:
            w = self.data.view(torch.int8).float() * self.row_scales.float().unsqueeze(1)
        else:
            w = torch.from_numpy(gguf.quants.dequantize(self.data.cpu().numpy(), GGMLType(self.qtype)))
        return w.reshape(self.shape).to(device=self.data.device, dtype=dtype)

    def row_scales_or_empty(self) -> torch.Tensor:
        return torch.empty(0) if self.row_scales is None else self.row_scales

    def _need_rows(self, what: str) -> None:
        if self.layout != "rows":
            raise ValueError(f"{what} needs the GGUF row layout, this tensor is tiled")


def row_bytes(qtype: int, cols: int) -> int:
    if qtype in DENSE_BYTES:
        return cols * DENSE_BYTES[qtype]
    block, size = gguf.GGML_QUANT_SIZES[GGMLType(qtype)]
    return cols // block * size


def cat_rows(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """Row-wise concatenation of tensors of one type (fused q/k/v, gate/up)."""
    for p in parts:
        p._need_rows("cat_rows")
    kinds = {(p.qtype, p.shape[1]) for p in parts}
    if len(kinds) != 1:
        raise ValueError(f"cannot concatenate {sorted(type_name(t) for t, _ in kinds)} rows into one tensor")
    scales = None if parts[0].row_scales is None else torch.cat([p.row_scales for p in parts])
    return QuantizedTensor(torch.cat([p.data for p in parts]), parts[0].qtype,
                           (sum(p.shape[0] for p in parts), parts[0].shape[1]), scales)


def bf16_rows(weight: torch.Tensor) -> QuantizedTensor:
    """A dense weight as bf16 rows (rounded if it is not bf16), for the kernels' tiles: the same values
    as `weight.bfloat16()`, one copy."""
    w = weight.detach().to(torch.bfloat16).contiguous()
    return QuantizedTensor(w.view(torch.uint8).reshape(w.shape[0], -1), BF16, tuple(w.shape))


def f32_rows(weight: torch.Tensor) -> QuantizedTensor:
    """A dense fp32 weight as F32 rows, for the kernels' tiles: the same values, one copy once tiled."""
    w = weight.detach().float().contiguous()
    return QuantizedTensor(w.view(torch.uint8).reshape(w.shape[0], -1), F32, tuple(w.shape))


def quantize_int8(weight: torch.Tensor) -> QuantizedTensor:
    """Per-channel symmetric int8: one fp32 scale per output row, `round(w / scale)` in [-127, 127]."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp(min=1e-30) / 127.0
    q = torch.round(w / scales.unsqueeze(1)).clamp(-127, 127).to(torch.int8)
    return QuantizedTensor(q.view(torch.uint8), I8, tuple(w.shape), scales)


def quantize_int4(weight: torch.Tensor) -> QuantizedTensor:
    """Group-wise asymmetric 4-bit, groups of 32, in GGUF's Q4_1 layout: per group an fp16 scale
    `d = (max - min) / 15` and minimum `m`, values `q = round((w - m) / d)` in [0, 15], `w ~ d q + m`.
    The scale and minimum are rounded to fp16 first and the values fitted to the rounded ones."""
    rows, cols = weight.shape
    if cols % 32:
        raise ValueError(f"int4 groups are 32 weights: a row of {cols} does not split into them")
    g = weight.detach().float().reshape(rows, cols // 32, 32)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    d = ((hi - lo) / 15.0).half()
    m = lo.half()
    df, mf = d.float().unsqueeze(-1), m.float().unsqueeze(-1)
    q = torch.where(df > 0, torch.round((g - mf) / torch.where(df > 0, df, 1.0)), 0.0).clamp(0, 15).to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)  # byte j: element j (low nibble) and j + 16 (high nibble)
    blocks = torch.cat([d.unsqueeze(-1).view(torch.uint8), m.unsqueeze(-1).view(torch.uint8), packed], dim=-1)
    return QuantizedTensor(blocks.reshape(rows, -1).contiguous(), GGMLType.Q4_1, (rows, cols))
