"""Paged attention in Triton: one kernel launch per layer over the whole flattened ragged batch.

Every sequence of the pass, a decode row or a prefill chunk, is `q_len` queries at batch rows
`[q_start, q_start + q_len)` and positions `[pos, pos + q_len)`. Its keys are its cached context,
positions `[max(0, pos - window + 1), pos)` read from the pages in place through its block-table row
(a sliding window's ring: position `p` at ring index `p % window`), then its own new keys, taken
from the batch: the kernel runs before the pass writes the cache, since a ring may reuse the
context's slots for the chunk's own tokens. One loop walks both kinds of key; masks are computed
from positions (causal, window), never stored. A program is one (query tile, kv head): the tile's
rows are `TQ` queries (16 in a pass with prefill chunks, else 1) x the kv head's `G` query heads
(padded to a power of two, and to the 16 rows `tl.dot` needs), so each K/V block loaded serves all
of them (GQA). Scores, the online softmax and the output sums are fp32; `tl.dot` multiplies fp32 inputs in IEEE fp32 (no
TF32: fp32 is the exact path), bf16/fp16 inputs (and the softmax weights, rounded to them) with fp32
accumulation.

Under Triton's interpreter (`TRITON_INTERPRET=1` set before this module is imported) the same
kernel runs on CPU tensors, with numpy, slowly: that is how it is tested without a GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # the kernel below was built for the interpreter
BLOCK_N = 64  # keys per step of the inner loop
PREFILL_QUERIES = 16  # queries per tile when the pass has prefill chunks (else 1: decode rows)
NO_WINDOW = 1 << 30  # the ring length of full attention: positions map to themselves


@dataclass
class RaggedBatch:
    """Per-pass index tensors on the device, built once for all the layers of a layer group.

    seqs: [3, S] int32 rows q_start, q_len, pos; block_tables: [S, width] int32 (padded with chunk 0);
    tiles: [2, num_tiles] int32 rows sequence, first query of the tile."""

    seqs: torch.Tensor
    block_tables: torch.Tensor
    tiles: torch.Tensor
    queries_per_tile: int
    page_size: int
    window: int | None


def ragged_batch(decode_positions: torch.Tensor | None, decode_block_tables: torch.Tensor | None,
                 prefills: list[tuple[int, int, int, torch.Tensor]], page_size: int, window: int | None,
                 device: torch.device) -> RaggedBatch:
    """Decode rows first (`decode_positions [nd]`, `decode_block_tables [nd, w]`, rows `0..nd-1`), then
    `prefills`, each `(q_start, q_len, pos, block_table)`. Host work is O(prefill chunks): the
    decode part stays in device tensors."""
    nd = 0 if decode_positions is None else decode_positions.numel()
    tq = PREFILL_QUERIES if prefills else 1
    width = max([decode_block_tables.shape[1] if nd else 1] + [t.numel() for *_, t in prefills])
    tables = torch.zeros(nd + len(prefills), width, dtype=torch.int32, device=device)
    seq_parts, tile_parts = [], []
    if nd:
        tables[:nd, :decode_block_tables.shape[1]] = decode_block_tables
        rows = torch.arange(nd, dtype=torch.int32, device=device)
        seq_parts.append(torch.stack((rows, torch.ones_like(rows), decode_positions.to(torch.int32))))
        tile_parts.append(torch.stack((rows, torch.zeros_like(rows))))
    if prefills:
        host_seqs, host_tiles = [], []
        for i, (q_start, q_len, pos, table) in enumerate(prefills):
            tables[nd + i, :table.numel()] = table
            host_seqs.append((q_start, q_len, pos))
            host_tiles.extend((nd + i, q0) for q0 in range(0, q_len, tq))
        seq_parts.append(host_to_device(list(zip(*host_seqs)), device))
        tile_parts.append(host_to_device(list(zip(*host_tiles)), device))
    return RaggedBatch(torch.cat(seq_parts, 1).contiguous(), tables, torch.cat(tile_parts, 1).contiguous(), tq,
                       page_size, window)


def host_to_device(rows: list[tuple[int, ...]], device: torch.device) -> torch.Tensor:
    """An int32 host table on `device`; on CUDA through pinned memory, so the copy does not wait for the
    device (one from pageable memory does)."""
    cuda = device.type == "cuda"
    return torch.tensor(rows, dtype=torch.int32, pin_memory=cuda).to(device, non_blocking=cuda)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, batch: RaggedBatch,
                    scale: float, softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D] (any row and head strides); kv_cache: [2, slots, Hkv, D] with
    unit last stride, of k's dtype or fp8 (widened as loaded); `sinks`: gpt-oss's attention-sink logits, fp32 [H] (None: none). Reads the cache,
    does not write it. Returns [T, H, D]."""
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    num_heads, dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    gp = triton.next_power_of_2(group)
    out = torch.empty_like(q)
    if sinks is not None and (sinks.shape != (num_heads,) or sinks.device != q.device):
        raise ValueError(f"sinks must be one logit per query head ({num_heads}) on {q.device}, got "
                         f"{tuple(sinks.shape)} on {sinks.device}")
    _paged_attention_kernel[(batch.tiles.shape[1], num_kv_heads)](
        q, k, v, kv_cache, out, q if sinks is None else sinks.float().contiguous(), batch.tiles, batch.seqs, batch.block_tables,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), batch.block_tables.stride(0),
        batch.tiles.shape[1], batch.seqs.shape[1], scale, softcap or 1.0, batch.window or NO_WINDOW,
        batch.page_size, dim, G=group, GP=gp, TQ=batch.queries_per_tile, BLOCK_M=max(16, batch.queries_per_tile * gp),
        BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_N=BLOCK_N, SOFTCAP=softcap is not None,
        SINKS=sinks is not None, DOT_FP32=INTERPRETED and q.dtype == torch.bfloat16)
    return out


@triton.jit
def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, cache_ptr, out_ptr, sinks_ptr, tiles_ptr, seqs_ptr, tables_ptr,
                            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                            stride_ckv, stride_cslot, stride_ch, stride_bt, num_tiles, num_seqs,
                            scale, softcap, ring, page_size, dim,
                            G: tl.constexpr, GP: tl.constexpr, TQ: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr,
                            SINKS: tl.constexpr, DOT_FP32: tl.constexpr):
    """One (tile, kv head). `SINKS`: each row's head's sink logit is its first key, with no value (m
    starts at it, l at 1), as in the CPU kernels. `DOT_FP32`: triton 3.7's interpreter multiplies bf16
    `tl.dot` operands as their raw uint16 bits, so there bf16 operands are widened first (the same
    exact products)."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(tiles_ptr + tile)
    q0 = tl.load(tiles_ptr + num_tiles + tile)
    q_start = tl.load(seqs_ptr + seq)
    q_len = tl.load(seqs_ptr + num_seqs + seq)
    pos = tl.load(seqs_ptr + 2 * num_seqs + seq)

    rows = tl.arange(0, BLOCK_M)
    qi = q0 + rows // GP  # the row's query, within the sequence
    head = kvh * G + rows % GP
    row_ok = (rows % GP < G) & (rows // GP < TQ) & (qi < q_len)
    q_pos = pos + qi
    d = tl.arange(0, BLOCK_D)
    d_ok = d < dim
    q = tl.load(q_ptr + (q_start + qi).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    if SINKS:
        m_i = tl.load(sinks_ptr + head, mask=row_ok, other=float("-inf")).to(tl.float32)
        l_i = tl.where(row_ok, 1.0, 0.0)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    k_cache = cache_ptr + kvh * stride_ch
    v_cache = cache_ptr + stride_ckv + kvh * stride_ch
    # Key positions from the first the tile's first query sees to its last query: the cached context
    # (before `pos`, through the block table) and then the sequence's own keys (from the batch).
    end = pos + tl.minimum(q_len, q0 + TQ)
    for start in range(tl.maximum(0, pos + q0 - ring + 1), end, BLOCK_N):
        key_pos = start + n
        cached = key_pos < pos
        new = (key_pos >= pos) & (key_pos < end)
        r = key_pos % ring
        block = tl.load(tables_ptr + seq * stride_bt + r // page_size, mask=cached, other=0)
        slot = ((block.to(tl.int64) * page_size + r % page_size) * stride_cslot)[:, None] + d[None, :]
        row = (q_start + key_pos - pos).to(tl.int64)[:, None]
        from_cache = cached[:, None] & d_ok[None, :]
        from_batch = new[:, None] & d_ok[None, :]
        # an fp8 cache's rows are widened to the batch's dtype as they load (a no-op for a cache of that dtype)
        k_blk = tl.where(from_cache, tl.load(k_cache + slot, mask=from_cache, other=0.0).to(k_ptr.dtype.element_ty),
                         tl.load(k_ptr + row * stride_kt + kvh * stride_kh + d[None, :], mask=from_batch, other=0.0))
        v_blk = tl.where(from_cache, tl.load(v_cache + slot, mask=from_cache, other=0.0).to(v_ptr.dtype.element_ty),
                         tl.load(v_ptr + row * stride_vt + kvh * stride_vh + d[None, :], mask=from_batch, other=0.0))
        if DOT_FP32:
            k_blk = k_blk.to(tl.float32)
        s = tl.dot(q, tl.trans(k_blk), input_precision="ieee") * scale
        if SOFTCAP:
            s = 2.0 * softcap * tl.sigmoid(2.0 * s / softcap) - softcap  # tanh(s / cap) * cap
        visible = (row_ok[:, None] & (cached | new)[None, :] & (key_pos[None, :] <= q_pos[:, None])
                   & (key_pos[None, :] > q_pos[:, None] - ring))
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet adds nothing
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(v_blk.dtype)
        if DOT_FP32:
            p, v_blk = p.to(tl.float32), v_blk.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v_blk, input_precision="ieee")
        m_i = m_new

    out = acc / tl.where(row_ok, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + qi).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
