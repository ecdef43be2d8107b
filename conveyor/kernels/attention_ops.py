"""Paged attention on CPU (paged_attention_cpu.cpp, prefill_attention_cpu.cpp, attention_cpu.h): the
tensors checked here, the arithmetic there. A cache is of the queries' dtype, or bytes: int8 head rows
followed by their fp32 scales (kv_cache_dtype "int8", cache/kv_format.py)."""

from __future__ import annotations

import ctypes

import torch

from .native import F32, I32, I64, INT8_ROWS, P, Native, bind, dtype_code, int64_vector, require, threads


def _kv_code(kv: torch.Tensor, q: torch.Tensor, head_dim: int, name: str) -> int:
    """runtime.h's code for a cache (or new K/V) of q's dtype, or of int8 rows (uint8, D + 4 bytes a head)."""
    if kv.dtype == torch.uint8:
        require(kv.shape[-1] == head_dim + 4, f"{name}: int8 rows of {head_dim} values and a 4-byte scale expected, "
                f"got rows of {kv.shape[-1]} bytes")
        return INT8_ROWS
    require(kv.dtype == q.dtype and kv.dtype in (torch.float32, torch.bfloat16),
            f"{name} must be fp32 or bf16 of the queries' dtype, or int8 rows (uint8)")
    return dtype_code(kv, name)


def _check_heads(t: torch.Tensor, name: str) -> None:
    require(t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2],
            f"{name} must be [tokens, heads, dim] with contiguous heads")


def _sinks(sinks: torch.Tensor | None, heads: int) -> int | None:
    """The attention sinks' logits as the kernels take them: fp32 [heads] (None: none)."""
    if sinks is None:
        return None
    require(sinks.device.type == "cpu" and sinks.dtype == torch.float32 and sinks.is_contiguous() and sinks.dim() == 1
            and sinks.numel() == heads, "sinks must be a contiguous fp32 CPU tensor of one logit per query head "
            f"({heads}), got {list(sinks.shape)}")
    return sinks.data_ptr()


class PagedAttentionOps(Native):
    """Decode and prefill attention read from the KV cache's pages in place (fp32 or bf16)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        super().__init__(lib)
        self._decode = bind(lib, "conveyor_paged_decode_attention", I32, I32, I32, P, P, I64, P, I64, P, P, I64, I64,
                            I64, I64, I64, I64, F32, F32, P, P, I32)
        self._prefill = bind(lib, "conveyor_paged_prefill_attention", I32, I32, I32, P, P, P, I64, I64, I64, P, I64, P,
                             P, I64, I64, I64, I64, I64, F32, F32, P, P, I32, I32)
        self._quantize = bind(lib, "conveyor_quantize_kv", I32, I32, P, I64, I64, P, I32)
        self._write = bind(lib, "conveyor_write_kv", I32, P, I64, P, I64, P, I64, I64, I64, P, P, I32)
        self._width = bind(lib, "conveyor_prefill_vector_width", I64)

    def paged_decode_attention(self, q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                               context_lens: torch.Tensor, positions: torch.Tensor | None, window: int,
                               page_size: int, scale: float, softcap: float,
                               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """out [B, H, D] for queries q [B, H, D] over the cache [2, slots, Hkv, D] (q's dtype, or int8 rows):
        per row its block table (int64 [B, width]), context length (int64 [B]) and, with a sliding `window`
        (its tables are rings of `window` slots), its position. `softcap` > 0 caps the scores as Gemma 2 does."""
        require(q.is_contiguous() and kv_cache.is_contiguous() and block_tables.is_contiguous()
                and context_lens.is_contiguous(), "contiguous inputs only")
        B, H, D = q.shape
        code, kv_code = dtype_code(q, "q"), _kv_code(kv_cache, q, D, "the KV cache")
        require(window <= 0 or (positions is not None and positions.numel() == B),
                "a sliding window needs every row's position (int64 [B])")
        out = torch.empty_like(q)
        self.check(self._decode(
            code, kv_code, q.data_ptr(), kv_cache.data_ptr(), kv_cache.shape[1],
            int64_vector(block_tables, "block_tables"), block_tables.shape[1],
            int64_vector(context_lens, "context_lens"),
            int64_vector(positions, "positions") if window > 0 and positions is not None else None,
            B, H, kv_cache.shape[2], D, window, page_size, scale, softcap, _sinks(sinks, H), out.data_ptr(), threads()))
        return out

    def paged_prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                                ctx_slots: torch.Tensor, chunks: torch.Tensor, window: int, scale: float,
                                softcap: float, out: torch.Tensor, sinks: torch.Tensor | None = None,
                                amx: bool = False) -> None:
        """Every prefill chunk's attention into out [T, H, D] (contiguous): queries q [T, H, D], the batch's
        new k, v [T, Hkv, D] (heads contiguous; for an int8 cache, int8 rows as `quantize_kv` makes them),
        each chunk's context slots (int64, all chunks') and per chunk {q_start, q_len, offset into
        ctx_slots, n_ctx, start} (int64 [C, 5]). `amx`: bf16 over a bf16 cache takes the AMX tiles where the CPU
        has them (faster; not the decode kernel's bits, kernels/prefill_amx.h). Call it before the pass writes
        the new K/V into the cache."""
        require(all(t.device.type == "cpu" for t in (q, k, v, out, kv_cache)), "CPU tensors only")
        require(out.dtype == q.dtype, "out must have the queries' dtype")
        _check_heads(q, "q")
        _check_heads(k, "k")
        _check_heads(v, "v")
        require(out.is_contiguous() and out.shape == q.shape, "out must be contiguous, shaped like q")
        require(kv_cache.is_contiguous() and chunks.dim() == 2 and chunks.shape[1] == 5,
                "ctx_slots [n] and chunks [C, 5]: contiguous int64")
        H, D, Hkv = q.shape[1], q.shape[2], kv_cache.shape[2]
        kv_code = _kv_code(kv_cache, q, D, "the KV cache")
        require(_kv_code(k, q, D, "k") == kv_code and _kv_code(v, q, D, "v") == kv_code,
                "k and v must be stored as the cache is")
        require(k.shape[1] == Hkv, "head counts or sizes disagree")
        self.check(self._prefill(
            dtype_code(q, "q"), kv_code, q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0), k.stride(0), v.stride(0),
            kv_cache.data_ptr(), kv_cache.shape[1], int64_vector(ctx_slots, "ctx_slots"), int64_vector(chunks, "chunks"),
            chunks.shape[0], H, Hkv, D, window, scale, softcap, _sinks(sinks, H), out.data_ptr(), int(amx), threads()))

    def write_kv(self, kv_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """kv_cache[0][slots] = k and kv_cache[1][slots] = v: the batch's new rows [T, Hkv, D] (or int8 rows [T,
        Hkv, D + 4]; heads contiguous, tokens any stride apart) into the cache [2, slots, Hkv, D] of their dtype."""
        require(kv_cache.is_contiguous() and k.dtype == v.dtype == kv_cache.dtype, "k, v and the cache: one dtype")
        require(k.shape == v.shape and k.shape[1:] == kv_cache.shape[2:] and slots.shape == (k.shape[0],),
                f"k and v must be [tokens, {', '.join(map(str, kv_cache.shape[2:]))}] with a slot each")
        _check_heads(k, "k")
        _check_heads(v, "v")
        size = k.element_size()
        row_bytes = k.shape[1] * k.shape[2] * size
        self.check(self._write(k.data_ptr(), k.stride(0) * size, v.data_ptr(), v.stride(0) * size,
                               int64_vector(slots, "slots"), k.shape[0], row_bytes, kv_cache.shape[1],
                               kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), threads()))

    def quantize_kv(self, x: torch.Tensor) -> torch.Tensor:
        """Rows x [..., D] (fp32 or bf16) as int8 head rows with their scales, uint8 [..., D + 4]: what an int8
        cache holds (bit for bit cache/kv_format.py's `quantize_kv`)."""
        code = dtype_code(x, "x")
        x = x.contiguous()
        d = x.shape[-1]
        out = torch.empty((*x.shape[:-1], d + 4), dtype=torch.uint8)
        self.check(self._quantize(code, x.data_ptr(), x.numel() // d, d, out.data_ptr(), threads()))
        return out

    def prefill_vector_width(self) -> int:
        """Floats per vector register in the prefill kernel (16: AVX-512, else 8)."""
        return self._width()
