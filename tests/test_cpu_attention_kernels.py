"""The native CPU attention kernels against a PyTorch reference at the shapes their code paths split on.

Decode (`attention_cpu.h`): contexts of thousands of tokens (K/V rows pulled into L2 a chunk at a time),
lengths that end mid-block, head dims that are and are not a whole number of vector pairs (rows read in
place or copied, zero-padded), 1 to 8 query heads per kv head (score chunks of 3), soft-capping.
Prefill (`prefill_attention_cpu.cpp`): chunks of up to 512 queries over thousands of context keys, odd
lengths on both sides of key-block and query-tile edges, several chunks in one call, sliding windows,
soft-capping."""

from __future__ import annotations

import math

import pytest
import torch

from conveyor.kernels import cpu_paged_attention
from conveyor.layers.attention import AttentionMetadata, CpuPagedAttention

from .test_attention import BF16_TOL, reference_decode, run_prefill

FP32_TOL = dict(atol=1e-5, rtol=1e-5)


def decode_case(lens: list[int], heads: int, kv_heads: int, dim: int, dtype: torch.dtype, page: int = 16):
    """Queries, a KV cache and the metadata of one decode row per length, pages at random places."""
    g = torch.Generator().manual_seed(len(lens) * 1000 + dim + heads)
    width = max(math.ceil(n / page) for n in lens)
    pages = len(lens) * width + 2
    kv = torch.randn(2, pages * page, kv_heads, dim, generator=g).to(dtype)
    tables = (torch.randperm(pages - 2, generator=g)[:len(lens) * width] + 2).view(len(lens), width)
    q = torch.randn(len(lens), heads, dim, generator=g).to(dtype)
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), page_size=page, num_decodes=len(lens),
                             decode_block_tables=tables, decode_context_lens=torch.tensor(lens))
    return q, kv, meta


@pytest.mark.parametrize(("lens", "heads", "kv_heads", "dim", "softcap", "dtype"), [
    ([3001, 1, 17, 700], 9, 3, 64, None, torch.bfloat16),   # the built-in model's heads, several L2 chunks
    ([3001, 1, 17, 700], 9, 3, 64, None, torch.float32),
    ([2500, 33], 32, 4, 128, None, torch.bfloat16),          # 8 query heads per kv head: score chunks 3 + 3 + 2
    ([1200, 5], 8, 8, 256, 30.0, torch.bfloat16),           # one query head per kv head, Gemma's head dim and cap
    ([257, 64], 7, 1, 96, None, torch.float32),             # 7 heads on one kv head; 96: three vector pairs
    ([129, 2], 4, 2, 80, 5.0, torch.bfloat16),              # 80, 48: not whole pairs, rows copied and zero-padded
    ([300, 31], 6, 3, 48, None, torch.float32),
    ([40], 2, 1, 512, None, torch.bfloat16),                # the largest head dim the kernel takes (AVX-512)
])
def test_decode_kernel_matches_reference(lens: list[int], heads: int, kv_heads: int, dim: int, softcap: float | None,
                                         dtype: torch.dtype) -> None:
    if dim > 32 * cpu_paged_attention().prefill_vector_width():
        pytest.skip("head dim above this build's limit")
    q, kv, meta = decode_case(lens, heads, kv_heads, dim, dtype)
    scale = dim ** -0.5
    out = CpuPagedAttention(cpu_paged_attention())._decode(q, kv, meta, scale, softcap)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), reference_decode(q, kv, meta, scale, softcap),
                               **(FP32_TOL if dtype == torch.float32 else BF16_TOL))


def test_decode_kernel_names_its_head_dim_limit() -> None:
    q, kv, meta = decode_case([3], 2, 1, 1024, torch.float32)
    with pytest.raises(RuntimeError, match="head dim 1024"):
        CpuPagedAttention(cpu_paged_attention())._decode(q, kv, meta, 1.0, None)


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "chunks", "window", "softcap", "dtype"), [
    (9, 3, 64, [(512, 2500)], 0, 0.0, torch.bfloat16),                   # a full chunk over a long document
    (9, 3, 64, [(512, 2500)], 0, 0.0, torch.float32),
    (9, 3, 64, [(257, 1000), (1, 3000), (33, 63), (64, 0)], 0, 0.0, torch.float32),  # odd lengths, block edges
    (9, 3, 64, [(257, 1000), (1, 3000), (33, 63), (64, 0)], 0, 0.0, torch.bfloat16),
    (8, 2, 128, [(300, 2100)], 1024, 0.0, torch.bfloat16),               # a window inside the context
    (8, 4, 256, [(100, 1200)], 0, 50.0, torch.bfloat16),                 # Gemma 2's head dim and cap
    (4, 4, 64, [(97, 129)], 0, 0.0, torch.float32),                      # one query head per kv head
])
def test_prefill_kernel_matches_reference_on_long_contexts(heads: int, kv_heads: int, dim: int,
                                                           chunks: list[tuple[int, int]], window: int, softcap: float,
                                                           dtype: torch.dtype) -> None:
    out, expected = run_prefill(heads, kv_heads, dim, chunks, window, softcap, dtype)
    torch.testing.assert_close(out, expected, **(FP32_TOL if dtype == torch.float32 else BF16_TOL))
