"""The native CPU attention kernels against a PyTorch reference at the shapes their code paths split on.

Decode (`attention_cpu.h`): contexts of thousands of tokens (K/V rows pulled into L2 a chunk at a time),
threads splitting the (request, kv head) pairs, lengths that end mid-block, head dims that are and are not a whole number of vector pairs (rows read in
place or copied, zero-padded), 1 to 8 query heads per kv head (score chunks of 3), soft-capping.
Prefill (`prefill_attention_cpu.cpp`): chunks of up to 512 queries over thousands of context keys, odd
lengths on both sides of key-block and query-tile edges, several chunks in one call, sliding windows,
soft-capping; on AMX CPUs, the same on the tiles (`prefill_amx.h`)."""

from __future__ import annotations

import math
import os

import pytest
import torch

from conveyor.cache.kv_format import quantize_kv
from conveyor.kernels import cpu_flags, cpu_paged_attention
from conveyor.layers.attention import AttentionMetadata, CpuPagedAttention

from tests.attention_utils import (BF16_TOL, decode_every_position, prefill_in_chunks, reference_decode, run_prefill,
                                   run_reference, sequence_case)

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


@pytest.mark.parametrize(("lens", "kv_heads", "dtype", "int8"), [
    ([2100], 3, torch.bfloat16, False),         # one long request: its kv heads split 2 + 1 across two threads
    ([2100], 3, torch.bfloat16, True),          # the same over int8 rows
    ([700, 90, 1300], 2, torch.float32, False),  # three requests on two threads: the middle one split between them
])
def test_decode_threads_split_requests_by_kv_head_with_the_same_bits(lens: list[int], kv_heads: int,
                                                                     dtype: torch.dtype, int8: bool) -> None:
    q, kv, meta = decode_case(lens, 4 * kv_heads, kv_heads, 64, dtype)
    cache = quantize_kv(kv) if int8 else kv
    outs = []
    saved = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(CpuPagedAttention(cpu_paged_attention())._decode(q, cache, meta, 0.125, None))
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(outs[0], outs[1])
    if not int8:
        torch.testing.assert_close(outs[1].float(), reference_decode(q, kv, meta, 0.125),
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


@pytest.mark.skipif("amx_bf16" not in cpu_flags() or bool(os.environ.get("CONVEYOR_MARCH")),
                    reason="the AMX tiles need an AMX CPU and a build for it")
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "chunks", "window", "softcap"), [
    (9, 3, 64, [(257, 1000), (1, 3000), (33, 63), (64, 0)], 0, 0.0),  # block and tile edges, one-tile chunks
    (6, 2, 33, [(40, 50)], 20, 3.0),        # odd head dim (the tiles' 32 padded with zeros), window, cap
    (24, 2, 16, [(9, 300)], 0, 0.0),        # 12 query heads per kv head, a head dim below a tile's row
    (8, 2, 128, [(300, 2100)], 1024, 0.0),  # a window inside the context
    (8, 4, 256, [(100, 1200)], 0, 50.0),    # Gemma 2's head dim and cap
])
def test_prefill_on_amx_tiles_matches_reference(heads: int, kv_heads: int, dim: int, chunks: list[tuple[int, int]],
                                                window: int, softcap: float) -> None:
    out, expected = run_prefill(heads, kv_heads, dim, chunks, window, softcap, torch.bfloat16, amx=True)
    torch.testing.assert_close(out, expected, **BF16_TOL)
    vector, _ = run_prefill(heads, kv_heads, dim, chunks, window, softcap, torch.bfloat16)
    assert not torch.equal(out, vector)  # the tiles ran: their sums are not the vector path's bits
    # the weights enter in two bf16 parts: as close to the reference as the vector path's fp32 weights
    assert (out - expected).abs().max() <= 1.25 * (vector - expected).abs().max()


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "window", "softcap", "dtype", "page"), [
    (9, 3, 64, 0, 0.0, torch.bfloat16, 16),    # the built-in model's heads
    (9, 3, 64, 0, 0.0, torch.float32, 16),
    (8, 1, 128, 0, 0.0, torch.bfloat16, 16),   # 8 query heads on one kv head
    (4, 4, 80, 0, 30.0, torch.bfloat16, 8),    # one query head per kv head, soft-capped, D not a power of two
    (6, 2, 33, 40, 0.0, torch.float32, 4),     # odd head dim, a window shorter than a key block
    (6, 2, 33, 40, 0.0, torch.bfloat16, 4),    # the same over bf16 keys: a last pair with one entry
    (12, 2, 16, 100, 5.0, torch.bfloat16, 16),  # a window across key blocks, capped
    (2, 1, 256, 0, 50.0, torch.float32, 16),   # Gemma 2's head dim and cap
])
def test_a_query_gets_the_same_bits_in_any_chunk_and_in_decode(heads: int, kv_heads: int, dim: int, window: int,
                                                               softcap: float, dtype: torch.dtype, page: int) -> None:
    """Batch invariance of the attention kernels: keys in blocks at absolute positions, the same arithmetic per
    query (attention_blocks.h), so a position's output is bitwise the same whether it is decoded, prefilled in one
    chunk or in chunks of any size, alone or in one call with other chunks."""
    length = 300
    q, k, v, kv, table, slots = sequence_case(length, heads, kv_heads, dim, dtype, page, seed=dim + heads + window)
    scale = dim ** -0.5
    decoded = decode_every_position(q, k, v, table, page, window, scale, softcap)
    whole = prefill_in_chunks(q, k, v, kv, slots, [length], window, scale, softcap, together=False)
    torch.testing.assert_close(whole.double(), run_reference(q, k, v, window, scale, softcap),
                               **(FP32_TOL if dtype == torch.float32 else BF16_TOL))
    assert torch.equal(decoded, whole)
    for chunk_lens, together in (([64] * 4 + [44], False), ([7, 100, 1, 128, 64], True), ([1] * 5 + [295], False)):
        assert torch.equal(prefill_in_chunks(q, k, v, kv, slots, chunk_lens, window, scale, softcap, together), whole)


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "window", "dtype", "page"), [
    (8, 2, 64, 0, torch.float32, 16),      # gpt-oss's head dim, full attention
    (8, 2, 64, 100, torch.bfloat16, 16),   # and its sliding layers (a window across key blocks)
    (6, 3, 33, 40, torch.float32, 4),      # odd head dim, a window shorter than a key block
])
def test_attention_sinks_same_bits_in_any_chunk_and_in_decode(heads: int, kv_heads: int, dim: int, window: int,
                                                              dtype: torch.dtype, page: int) -> None:
    """gpt-oss's attention sinks (a logit per query head in the softmax's denominator) enter both kernels'
    online softmax in one place (the row's start), so prefill and decode stay bitwise equal; the outputs
    match an fp64 reference, and differ from attention without sinks."""
    length = 300
    q, k, v, kv, table, slots = sequence_case(length, heads, kv_heads, dim, dtype, page, seed=7 + dim + window)
    sinks = torch.linspace(-2.0, 6.0, heads)  # from negligible to dominating a row's few keys
    scale = dim ** -0.5
    decoded = decode_every_position(q, k, v, table, page, window, scale, 0.0, sinks)
    whole = prefill_in_chunks(q, k, v, kv, slots, [length], window, scale, 0.0, False, sinks)
    torch.testing.assert_close(whole.double(), run_reference(q, k, v, window, scale, 0.0, sinks),
                               **(FP32_TOL if dtype == torch.float32 else BF16_TOL))
    assert torch.equal(decoded, whole)
    for chunk_lens, together in (([64] * 4 + [44], False), ([7, 100, 1, 128, 64], True)):
        assert torch.equal(prefill_in_chunks(q, k, v, kv, slots, chunk_lens, window, scale, 0.0, together, sinks),
                           whole)
    plain = prefill_in_chunks(q, k, v, kv, slots, [length], window, scale, 0.0, False)
    assert (plain - whole).abs().max() > 0.1


def test_attention_sinks_of_the_wrong_shape_are_an_error() -> None:
    q, kv, meta = decode_case([5], 4, 2, 16, torch.float32)
    with pytest.raises(RuntimeError, match=r"one logit per query head \(4\)"):
        cpu_paged_attention().paged_decode_attention(q, kv, meta.decode_block_tables, meta.decode_context_lens, None, 0,
                                                     meta.page_size, 0.25, 0.0, torch.zeros(3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_write_kv_puts_each_row_at_its_slot(dtype: torch.dtype) -> None:
    """The batch's K/V rows (views of a fused qkv output, tokens a row apart) land where index_copy_ puts them;
    a slot outside the cache is an error naming it."""
    g = torch.Generator().manual_seed(3)
    kv_heads, dim, tokens = 3, 64 + (4 if dtype == torch.uint8 else 0), 300
    qkv = torch.randn(tokens, 5 * kv_heads * dim, generator=g)
    qkv = (qkv * 50).to(torch.uint8) if dtype == torch.uint8 else qkv.to(dtype)
    k = qkv[:, 3 * kv_heads * dim:4 * kv_heads * dim].view(tokens, kv_heads, dim)
    v = qkv[:, 4 * kv_heads * dim:].view(tokens, kv_heads, dim)
    cache = torch.zeros(2, 1000, kv_heads, dim, dtype=dtype)
    slots = torch.randperm(1000, generator=g)[:tokens]
    expected = cache.clone()
    expected[0].index_copy_(0, slots, k)
    expected[1].index_copy_(0, slots, v)
    ops = cpu_paged_attention()
    ops.write_kv(cache, slots, k, v)
    assert torch.equal(cache, expected)
    ops.write_kv(cache, slots[:0], k[:0], v[:0])  # no rows: nothing written
    assert torch.equal(cache, expected)
    slots[7] = 1000
    with pytest.raises(RuntimeError, match="slot 1000 of token 7 outside the cache's 1000"):
        ops.write_kv(cache, slots, k, v)
