"""Attention test helpers: plain PyTorch attention that the native CPU and Triton kernels are checked
against, and random batches laid out as the model runner lays them out."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conveyor.cache.allocator import table_length
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
                dtype: torch.dtype, contiguous_k: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefill kernel's output and the reference's. Queries, keys and values are views into one fused
    projection (strided rows), as the layer passes them (keys contiguous after a q/k norm); each chunk's
    context sits at random slots of a cache of at least 2048."""
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
                                                  window, scale, softcap, out)
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
