"""Attention test helpers: plain PyTorch attention that the native CPU and Triton kernels are checked
against, and random batches laid out as the model runner lays them out."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from conveyor.cache.allocator import table_length
from conveyor.cache.kv_format import dequantize_kv, quantize_kv
from conveyor.engine.model_runner import ModelRunner
from conveyor.kernels import cpu_paged_attention, triton_attention
from conveyor.layers.attention import AttentionMetadata, cache_slots

# bf16 inputs: the kernels compute in fp32 from the same bf16 values, so they differ from an fp32
# reference over those values by the final rounding to bf16 (2^-9 relative) and fp32 summation order.
BF16_TOL = dict(atol=1e-2, rtol=1e-2)

# Without CUDA the Triton kernel runs under its interpreter (tests/conftest.py switches it on); with CUDA the
# compiled kernel is tested instead, in the `cuda`-marked tests.
interpreter_only = pytest.mark.skipif(not triton_attention.INTERPRETED,
                                      reason="CUDA machine: the compiled kernel is tested instead")


def reference_decode(q: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata, scale: float,
                     softcap: float | None = None) -> torch.Tensor:
    """Each request's context gathered contiguously, plain fp32 softmax attention (scores soft-capped if asked)."""
    q, kv = q.float(), kv.float()
    out = []
    group = q.shape[1] // kv.shape[2]
    for b, n in enumerate(meta.decode_context_lens.tolist()):
        slots = cache_slots(meta.decode_block_tables[b], meta.page_size)[:n]
        k = kv[0][slots].repeat_interleave(group, dim=1)  # [n, H, D]
        v = kv[1][slots].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b], k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        weights = torch.softmax(scores, dim=-1)
        out.append(torch.einsum("hn,nhd->hd", weights, v))
    return torch.stack(out)


def reference_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                      spans: list[tuple[int, int, torch.Tensor]], window: int | None, scale: float,
                      softcap: float | None) -> torch.Tensor:
    """Every chunk's keys gathered (context from the cache, its own from the batch), fp64 masked softmax."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // kv.shape[2]
    for start, n, slots in spans:
        n_ctx = len(slots)
        keys = torch.cat([kv[0][slots], k[start:start + n]]).double().repeat_interleave(group, 1)
        values = torch.cat([kv[1][slots], v[start:start + n]]).double().repeat_interleave(group, 1)
        scores = torch.einsum("ihd,jhd->hij", q[start:start + n].double(), keys) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        query = torch.arange(n)[:, None] + n_ctx
        key = torch.arange(n_ctx + n)[None]
        visible = (key <= query) & ((key > query - window) if window else True)
        out[start:start + n] = torch.einsum("hij,jhd->ihd", scores.masked_fill(~visible, float("-inf")).softmax(-1),
                                            values)
    return out


def run_prefill(heads: int, kv_heads: int, dim: int, chunks: list[tuple[int, int]], window: int, softcap: float,
                dtype: torch.dtype, contiguous_k: bool = False, amx: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefill kernel's output and the reference's. Queries, keys and values are views into one fused
    projection (strided rows), as the layer passes them (keys contiguous after a q/k norm); each chunk's
    context sits at random slots of a cache of at least 2048. `amx`: as the kernel's argument."""
    g = torch.Generator().manual_seed(heads * dim + len(chunks))
    total, slots = sum(n for n, _ in chunks), max([2048] + [n_ctx for _, n_ctx in chunks])
    qkv = torch.randn(total, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    q, k, v = (x.view(total, -1, dim) for x in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1))
    if contiguous_k:
        k = k.contiguous()
    kv = torch.randn(2, slots, kv_heads, dim, generator=g).to(dtype)
    spans, rows, offset, start = [], [], 0, 0
    for n, n_ctx in chunks:
        spans.append((start, n, torch.randperm(slots, generator=g)[:n_ctx]))
        rows.append([start, n, offset, n_ctx, n_ctx])
        start, offset = start + n, offset + n_ctx
    out = torch.full_like(q, float("nan"))
    scale = dim ** -0.5
    cpu_paged_attention().paged_prefill_attention(q, k, v, kv, torch.cat([s for *_, s in spans]), torch.tensor(rows),
                                                  window, scale, softcap, out, amx=amx)
    return out.double(), reference_prefill(q, k, v, kv, spans, window, scale, softcap)


def ragged_metadata(specs: list[tuple[int, int]], page_size: int, window: int | None, num_chunks: int,
                    seed: int, device: torch.device) -> AttentionMetadata:
    """The runner's metadata for a batch of `(q_len, pos)` sequences (q_len 1 = decode, listed first),
    each over a random block table of the pool's `num_chunks` chunks (0 is reserved)."""
    g = torch.Generator().manual_seed(seed)
    sizes = [table_length(pos + n, page_size, window) for n, pos in specs]
    ids = (torch.randperm(num_chunks - 1, generator=g)[:sum(sizes)] + 1).tolist()
    tables = {}
    for i, size in enumerate(sizes):
        tables[i], ids = ids[:size], ids[size:]
    allocator = SimpleNamespace(window=window, block_table=lambda rid, group: tables[rid])
    chunks = [SimpleNamespace(num_tokens=n, request=SimpleNamespace(num_computed_tokens=pos, request_id=i))
              for i, (n, pos) in enumerate(specs)]
    decodes, prefills = [c for c in chunks if c.num_tokens == 1], [c for c in chunks if c.num_tokens > 1]
    assert chunks == decodes + prefills, "decodes first, as the runner orders them"
    runner = SimpleNamespace(page_size=page_size, device=device)
    decode_pos = torch.tensor([c.request.num_computed_tokens for c in decodes], device=device)
    return ModelRunner._group_metadata(runner, allocator, 0, decodes, prefills, decode_pos)


def sequence_case(length: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, page: int, seed: int):
    """One sequence's queries, keys and values [length, heads, dim], and a cache holding its K/V at random pages
    (slot of position p: `slots[p]`)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(length, heads, dim, generator=g).to(dtype)
    k, v = (torch.randn(length, kv_heads, dim, generator=g).to(dtype) for _ in range(2))
    pages = math.ceil(length / page) + 3
    table = torch.randperm(pages, generator=g)[:math.ceil(length / page)]
    slots = (table[:, None] * page + torch.arange(page)).flatten()[:length]
    kv = torch.randn(2, pages * page, kv_heads, dim, generator=g).to(dtype)
    kv[0, slots], kv[1, slots] = k, v
    return q, k, v, kv, table, slots


def decode_every_position(q, k, v, table, page: int, window: int, scale: float, softcap: float,
                          sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Each position's attention as a decode row (all rows in one call), over the cache as the engine keeps it: the
    whole sequence's pages, or for a sliding window a ring of `window` slots per row holding its last positions."""
    n, kv_heads, dim = k.shape
    positions = torch.arange(n)
    if not window:
        kv = torch.zeros(2, (int(table.max()) + 1) * page, kv_heads, dim, dtype=k.dtype)
        slots = (table[:, None] * page + torch.arange(page)).flatten()[:n]
        kv[0, slots], kv[1, slots] = k, v
        return cpu_paged_attention().paged_decode_attention(q, kv, table.expand(n, -1).contiguous(), positions + 1,
                                                            positions, 0, page, scale, softcap, sinks)
    ring_pages = math.ceil(window / page)
    kv = torch.zeros(2, n * ring_pages * page, kv_heads, dim, dtype=k.dtype)
    tables = torch.arange(n * ring_pages).view(n, ring_pages)
    for pos in range(n):
        for p in range(max(0, pos - window + 1), pos + 1):
            ring = p % window
            slot = int(tables[pos, ring // page]) * page + ring % page
            kv[0, slot], kv[1, slot] = k[p], v[p]
    return cpu_paged_attention().paged_decode_attention(q, kv, tables, (positions + 1).clamp(max=window), positions,
                                                        window, page, scale, softcap, sinks)


def prefill_in_chunks(q, k, v, kv, slots, chunk_lens: list[int], window: int, scale: float, softcap: float,
                      together: bool, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The sequence prefilled in chunks of `chunk_lens`, each over the positions before it (its window's, with a
    window) read from the cache; `together`: every chunk in one kernel call, as chunks of different requests."""
    kernel = cpu_paged_attention()
    out = torch.full_like(q, float("nan"))
    calls, start = [], 0
    for n in chunk_lens:
        lo = max(0, start - window + 1) if window else 0
        calls.append((start, n, slots[lo:start]))
        start += n
    assert start == q.shape[0]
    groups = [calls] if together else [[c] for c in calls]
    for group in groups:
        rows = torch.cat([torch.arange(s, s + n) for s, n, _ in group])
        chunks, offset, q_start = [], 0, 0
        for s, n, ctx in group:
            chunks.append([q_start, n, offset, len(ctx), s])
            offset, q_start = offset + len(ctx), q_start + n
        o = torch.empty_like(q[rows])
        kernel.paged_prefill_attention(q[rows], k[rows], v[rows], kv, torch.cat([c for *_, c in group]).long(),
                                       torch.tensor(chunks), window, scale, softcap, o, sinks)
        out[rows] = o
    return out


def int8_key_queries(q: torch.Tensor, scale: float) -> torch.Tensor:
    """The queries as the native kernels take them over int8 keys: q * scale (fp32) quantized per head as a K
    row is (cache/kv_format.py), in fp64; with them and scale 1 `run_reference` is exact for those kernels."""
    return dequantize_kv(quantize_kv(q.float() * scale), torch.float64)


def reference_probs(q, k, window: int, scale: float, softcap: float,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """fp64 softmax weights [heads, queries, keys] of one sequence over itself, causal (within the window);
    `sinks`: one more logit per head in each softmax's denominator, with no value (gpt-oss)."""
    keys = k.double().repeat_interleave(q.shape[1] // k.shape[1], 1)
    scores = torch.einsum("ihd,jhd->hij", q.double(), keys) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    i, j = torch.arange(q.shape[0])[:, None], torch.arange(q.shape[0])[None]
    visible = (j <= i) & ((j > i - window) if window else True)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink = sinks.double()[:, None, None].expand(-1, q.shape[0], 1)
        return torch.cat((scores, sink), -1).softmax(-1)[..., :-1]
    return scores.softmax(-1)


def run_reference(q, k, v, window: int, scale: float, softcap: float,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
    """fp64 attention of one sequence over itself, causal (within the window), `reference_probs`' weights."""
    values = v.double().repeat_interleave(q.shape[1] // k.shape[1], 1)
    return torch.einsum("hij,jhd->ihd", reference_probs(q, k, window, scale, softcap, sinks), values)


def int8_value_bound(probs: torch.Tensor, v_int8: torch.Tensor, block: int = 64) -> torch.Tensor:
    """The most the native kernels' value sums over int8 rows may differ from exact attention with the same
    weights (`probs`, [heads, queries, keys], positions from 0): a block of `block` keys' weights w = p * s_v
    are rounded to integers on the scale w_max / 32767 (attention_blocks.h), so key j's weight moves by at
    most half of its block's step, which its |integer values| carry into the output ([queries, heads, dim])."""
    dim = v_int8.shape[-1] - 4
    values = v_int8[..., :dim].view(torch.int8).double().abs()
    scales = v_int8[..., dim:].contiguous().view(torch.float32)[..., 0].double()  # [keys, kv_heads]
    group = probs.shape[0] // v_int8.shape[1]
    weights = probs * scales.T.repeat_interleave(group, 0)[:, None, :]
    keys = weights.shape[-1]
    padded = torch.nn.functional.pad(weights, (0, -keys % block))
    step = padded.unflatten(-1, (-1, block)).amax(-1).repeat_interleave(block, -1)[..., :keys] / 32767
    step = torch.where(probs > 0, step, 0.0)  # a key with no weight rounds to exactly 0
    return 0.5001 * torch.einsum("hij,jhd->ihd", step, values.repeat_interleave(group, 1))
