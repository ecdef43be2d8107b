"""Matmuls over weights in the kernels' 16-row tiles (matmul_cpu.cpp, quant_gemm.cpp, quant_tiles.cpp):
GGUF's Q4_0, Q4_1, Q8_0, the K-quants Q2_K to Q6_K, IQ4_NL and IQ4_XS blocks, our per-channel int8 (I8), dense
bf16 and fp32; the LM head fused with greedy sampling; repacking and dequantizing; and the whole-layer kernels built on them
(layer_ops.py)."""

from __future__ import annotations

import ctypes

import torch

from . import host_memory
from .layer_ops import DecodeStack, MoeBlock
from .native import I32, I64, P, Native, bind, dtype_code, int64_vector, pointer, require, threads

I8 = 1000  # quant.h's per-channel int8 type id
TILE_ROWS = 16


class MatmulOps(Native):
    def __init__(self, lib: ctypes.CDLL) -> None:
        super().__init__(lib)
        self._matmul = bind(lib, "conveyor_quant_matmul", I32, I32, P, I64, I64, I64, P, I64, P, P, I32, P, I64, I64,
                            I32)
        self._argmax = bind(lib, "conveyor_quant_argmax", I32, I32, P, I64, I64, I64, P, I64, P, I64, P, I32)
        self._repack = bind(lib, "conveyor_repack_tiles", I32, P, I64, I64, I64, P, I32)
        self._rows = bind(lib, "conveyor_dequantize_rows", I32, P, I64, P, P, I64, I64, I64, I32, P, I32)
        self._read = bind(lib, "conveyor_read_rows", I32, I32, I64, I64, P, I64, I64, P)
        self._matrix = bind(lib, "conveyor_dequantize_matrix", I32, P, I64, P, I64, I64, I32, P, I32)
        self._row_bytes = bind(lib, "conveyor_row_bytes", I64, I64, I64)
        self._tile_bytes = bind(lib, "conveyor_tile_bytes", I64, I64, I64)
        self._isa = bind(lib, "conveyor_isa", ctypes.c_char_p)
        self._pairs = bind(lib, "conveyor_bf16_pair_products", I32)
        self._tile_sizes: dict[tuple[int, int], int] = {}  # (type, K) -> tile bytes, asked once

    def DecodeStack(self, *args: float) -> DecodeStack:  # noqa: N802 (a constructor, as the class it returns)
        return DecodeStack(self.lib, *args)

    def MoeBlock(self, hidden: int, intermediate: int, alpha: float = 1.0,  # noqa: N802
                 limit: float = 0.0) -> MoeBlock:
        return MoeBlock(self.lib, hidden, intermediate, alpha, limit)

    def row_bytes(self, qtype: int, k: int) -> int:
        """Bytes of one row of k elements in GGUF's layout (I8: k)."""
        return self._row_bytes(qtype, k)

    def tile_bytes(self, qtype: int, k: int) -> int:
        """Bytes of one 16-row tile of k elements in the kernels' layout."""
        return self._tile_bytes(qtype, k)

    def isa(self) -> str:
        """The instruction set the kernels were compiled for (e.g. "avx512-vnni+avx512-bf16")."""
        return self._isa().decode()

    def bf16_pair_products(self) -> bool:
        """Whether dense bf16 tiles multiply bf16 inputs two products an instruction (vdpbf16ps, where it runs
        at the FMA's rate: AMD's avx512_bf16) instead of widening the weights for fp32 FMAs."""
        return bool(self._pairs())

    def _tiles(self, weight: torch.Tensor, qtype: int, k: int, n: int) -> int:
        """Checks that `weight` holds n rows of k elements of `qtype` as tiles; its number of tiles."""
        tile = self._tile_sizes.get((qtype, k))
        if tile is None:
            tile = self._tile_sizes[qtype, k] = self._tile_bytes(qtype, k)
        require(tile > 0, f"no kernel takes weight type {qtype}")
        tiles = -(-n // TILE_ROWS)
        require(weight.dtype == torch.uint8 and weight.is_contiguous() and weight.dim() == 2
                and tuple(weight.shape) == (tiles, tile), f"weight must be tiled contiguous uint8 [{tiles}, {tile}]")
        return tiles

    def _scales(self, qtype: int, row_scales: torch.Tensor, tiles: int) -> int | None:
        if qtype != I8:
            return None
        require(row_scales.dtype == torch.float32 and row_scales.is_contiguous()
                and row_scales.numel() >= tiles * TILE_ROWS, "I8 needs fp32 row scales for whole tiles")
        return row_scales.data_ptr()

    def quant_matmul(self, x: torch.Tensor, weight: torch.Tensor, qtype: int, row_scales: torch.Tensor,
                     bias: torch.Tensor | None, out: torch.Tensor) -> None:
        """out [M, N] (fp32 or bf16, contiguous rows: a column slice of a wider output is fine) = x [M, K]
        (fp32 or bf16, contiguous rows) @ W.T (+ bias [N]), for a tiled W [ceil(N/16), tile_bytes]."""
        require(x.dim() == 2 and x.stride(1) == 1, "x must be [M, K] with contiguous rows")
        x_code = dtype_code(x, "x")
        m, k = x.shape
        n = out.shape[-1]
        require(out.dim() == 2 and out.shape[0] == m and out.stride(1) == 1,
                f"out must be [{m}, {n}] with contiguous rows")
        out_code = dtype_code(out, "out")
        tiles = self._tiles(weight, qtype, k, n)
        scales = self._scales(qtype, row_scales, tiles)
        b = None if bias is None else bias.float().contiguous()
        self.check(self._matmul(x_code, x.data_ptr(), m, k, x.stride(0), weight.data_ptr(), qtype, scales, pointer(b),
                                out_code, out.data_ptr(), n, out.stride(0), threads()))

    def quant_argmax(self, x: torch.Tensor, weight: torch.Tensor, qtype: int, row_scales: torch.Tensor,
                     n: int) -> torch.Tensor:
        """argmax_n (x @ W.T)[m, n] per row m (int64 [M]), without writing the logits: the LM head fused with
        greedy sampling. Ties go to the lowest index, as torch.argmax."""
        require(x.dim() == 2 and x.stride(1) == 1, "x must be [M, K] with contiguous rows")
        x_code = dtype_code(x, "x")
        m, k = x.shape
        tiles = self._tiles(weight, qtype, k, n)
        scales = self._scales(qtype, row_scales, tiles)
        out = torch.empty(m, dtype=torch.int64)
        self.check(self._argmax(x_code, x.data_ptr(), m, k, x.stride(0), weight.data_ptr(), qtype, scales, n,
                                out.data_ptr(), threads()))
        return out

    def repack_tiles(self, rows: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
        """GGUF rows [N, row_bytes] (I8: int8 rows as uint8) -> the tiled layout [ceil(N/16), tile_bytes]."""
        row = self._row_bytes(qtype, k)
        require(row > 0, f"no kernel takes weight type {qtype}")
        require(rows.dtype == torch.uint8 and rows.is_contiguous() and rows.dim() == 2 and rows.shape[1] == row,
                f"rows must be contiguous uint8 [N, {row}]")
        n = rows.shape[0]
        out = host_memory.empty((-(-n // TILE_ROWS), self._tile_bytes(qtype, k)), torch.uint8)  # streamed each step
        self.check(self._repack(rows.data_ptr(), qtype, n, k, out.data_ptr(), threads()))
        return out

    def dequantize_rows(self, weight: torch.Tensor, qtype: int, row_scales: torch.Tensor, ids: torch.Tensor,
                        num_rows: int, out: torch.Tensor) -> None:
        """Rows `ids` of a tiled matrix of `num_rows` rows into out [len(ids), K] (fp32 or bf16, contiguous)."""
        require(weight.dtype == torch.uint8 and weight.is_contiguous(), "weight must be contiguous uint8")
        require(out.dim() == 2 and out.is_contiguous() and out.shape[0] == ids.numel(), "out must be [len(ids), K]")
        out_code = dtype_code(out, "out")
        k = out.shape[1]
        tiles = self._tiles(weight, qtype, k, num_rows)
        ids = ids.to(torch.int64).contiguous()
        self.check(self._rows(weight.data_ptr(), qtype, self._scales(qtype, row_scales, tiles), int64_vector(ids, "ids"),
                              ids.numel(), num_rows, k, out_code, out.data_ptr(), threads()))

    def read_rows(self, fd: int, offset: int, ids: torch.Tensor, num_rows: int, out: torch.Tensor) -> None:
        """Rows `ids` of a table of `num_rows` rows of `out.shape[1]` bytes at byte `offset` of the open file
        `fd`, read into out [len(ids), row bytes] (uint8, contiguous)."""
        require(out.dtype == torch.uint8 and out.dim() == 2 and out.is_contiguous() and out.shape[0] == ids.numel(),
                "out must be contiguous uint8 [len(ids), row bytes]")
        ids = ids.to(torch.int64).contiguous()
        self.check(self._read(fd, offset, out.shape[1], int64_vector(ids, "ids"), ids.numel(), num_rows,
                              out.data_ptr()))

    def dequantize_matrix(self, weight: torch.Tensor, qtype: int, row_scales: torch.Tensor, out: torch.Tensor) -> None:
        """A whole tiled matrix into out [N, K] (fp32 or bf16, contiguous)."""
        require(out.dim() == 2 and out.is_contiguous(), "out must be a contiguous [N, K]")
        out_code = dtype_code(out, "out")
        n, k = out.shape
        tiles = self._tiles(weight, qtype, k, n)
        self.check(self._matrix(weight.data_ptr(), qtype, self._scales(qtype, row_scales, tiles), n, k, out_code,
                                out.data_ptr(), threads()))
