"""A short causal convolution over the flattened ragged batch, its state kept in the KV pool
(LFM2's conv layers; docs/design/sliding-window.md "Convolution layers").

Each output is a depthwise convolution of the token's input and its request's `L - 1` previous
inputs (zeros before the first). Those previous inputs are the layer's state: a ring of `L` rows per
request, kept in pool pages as a sliding layer's ring is (position `p` at ring index `p % L`), so the
allocator, preemption, the swap pool and "every block returns" treat it as any other page. A row of
`hidden` values takes `r` consecutive slots, each slot's K and V halves in turn
(`state_slots_per_row`); its ring is `L * r` slots. The pass reads every cached row it needs before
it writes: a prefill chunk's writes can land on the ring slots its own context is read from.
The convolution is one multiply-add per tap over each token's window, in the order oneDNN's depthwise
convolution (transformers' `F.conv1d`) takes them: its results bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..cache.allocator import AttentionTypeAllocator
from ..cache.transfer import to_device
from ..sched.output import ScheduledChunk
from .attention import AttentionMetadata, PrefillSpan, decode_block_tables


def state_slots_per_row(hidden: int, num_kv_heads: int, head_dim: int) -> int:
    """Pool slots one state row of `hidden` values takes: a slot holds a K and a V row of
    `num_kv_heads * head_dim` values each."""
    return -(-hidden // (2 * num_kv_heads * head_dim))


@dataclass
class ConvIndex:
    """Per pass and layer group, what every conv layer of the group reads and writes (`conv_index`)."""

    read_slots: torch.Tensor  # [M, r] pool slots of the cached rows the pass reads
    window: torch.Tensor  # [tokens * L] each token's inputs, oldest first, as rows of cat(cached, new, zero)
    write_slots: torch.Tensor  # [W, r] pool slots of the rows kept for later steps
    write_rows: torch.Tensor  # [W] their rows in the batch


def ring_metadata(allocator: AttentionTypeAllocator, group: int, decodes: list[ScheduledChunk],
                  prefills: list[ScheduledChunk], decode_pos: torch.Tensor, page_size: int) -> AttentionMetadata:
    """The model runner's metadata for a conv group: each row's ring (decode block tables, prefill spans'
    tables and starts) and positions; no slots, context or masks, which its layers do not read."""
    dev, rows = decode_pos.device, len(decode_pos)
    meta = AttentionMetadata(slot_mapping=torch.empty(0), page_size=page_size, num_decodes=rows,
                             window=allocator.window, decode_positions=decode_pos)
    if decodes:
        meta.decode_block_tables = decode_block_tables(allocator, group, decodes, dev)
        meta.decode_context_lens = torch.ones(rows, dtype=torch.long, device=dev)
    q_start = rows
    empty = torch.empty(0, dtype=torch.long, device=dev)
    for c in prefills:
        table = to_device(allocator.block_table(c.request.request_id, group), torch.long, dev)
        meta.prefills.append(PrefillSpan(q_start=q_start, q_len=c.num_tokens, ctx_slots=empty, mask=None,
                                         start=c.request.num_computed_tokens, block_table=table))
        q_start += c.num_tokens
    meta.slot_mapping = torch.zeros(q_start, dtype=torch.long, device=dev)  # (unused: the padded buffers copy it)
    return meta


def run_slots(tables: torch.Tensor, j: torch.Tensor, page: int) -> torch.Tensor:
    """Pool slots of indices `j [n, m]` into each row's run of blocks `tables [n, blocks]`."""
    return tables.gather(1, j // page) * page + j % page


def _ring_slots(tables: torch.Tensor, ring: torch.Tensor, r: int, page: int) -> torch.Tensor:
    """`[n, r]` pool slots of ring index `ring [n]` in the ring whose blocks are `tables [n, blocks]`."""
    return run_slots(tables, ring.unsqueeze(1) * r + torch.arange(r, device=ring.device), page)


def conv_index(meta: AttentionMetadata, num_tokens: int, kernel: int, r: int) -> ConvIndex:
    """The pass's reads and writes for a conv group: decode rows read their previous `kernel - 1`
    positions from the ring; a prefill chunk reads the ring's rows before its start and takes the rest
    from the batch; each request keeps its last `kernel - 1` rows. O(tokens) index work, once a group."""
    page, dev, back = meta.page_size, meta.slot_mapping.device, kernel - 1
    reads: list[torch.Tensor] = []
    windows: list[torch.Tensor] = []
    writes: list[torch.Tensor] = []
    write_rows: list[torch.Tensor] = []
    offsets = torch.arange(-back, 1, device=dev)  # a window's positions relative to its token
    nd, m = meta.num_decodes, 0
    if nd:
        tables, pos = meta.decode_block_tables, meta.decode_positions
        prev = pos.unsqueeze(1) + offsets[:-1]  # [nd, back]
        reads.append(_ring_slots(tables.repeat_interleave(back, 0), (prev.clamp(min=0) % kernel).flatten(), r, page))
        rows = torch.arange(nd * back, device=dev).view(nd, back)
        own = torch.arange(nd, device=dev).unsqueeze(1)
        windows.append(torch.cat([torch.where(prev >= 0, rows, -1), -own - 2], 1))
        writes.append(_ring_slots(tables, pos % kernel, r, page))
        write_rows.append(own.squeeze(1))
        m = nd * back
    for span in meta.prefills:
        start, n, q0 = span.start, span.q_len, span.q_start
        table = span.block_table.unsqueeze(0)
        n_ctx = min(start, back)
        ctx_pos = torch.arange(start - n_ctx, start, device=dev)
        reads.append(_ring_slots(table.expand(n_ctx, -1), ctx_pos % kernel, r, page))
        q = start + torch.arange(n, device=dev).unsqueeze(1) + offsets  # [n, kernel] positions
        cached = m + q - (start - n_ctx)  # rows among the cached ones
        windows.append(torch.where(q >= start, -(q0 + q - start) - 2, torch.where(q >= 0, cached, -1)))
        m += n_ctx
        kept = torch.arange(max(start, start + n - back), start + n, device=dev)
        writes.append(_ring_slots(table.expand(len(kept), -1), kept % kernel, r, page))
        write_rows.append(q0 + kept - start)
    # Rows of cat(cached [m], new [num_tokens], zero [1]): -1 is the zero row, -2 - i the batch's row i.
    window = torch.cat(windows).flatten() if windows else torch.empty(0, dtype=torch.long, device=dev)
    window = torch.where(window == -1, m + num_tokens, torch.where(window <= -2, m - 2 - window, window))
    empty = torch.empty(0, r, dtype=torch.long, device=dev)
    return ConvIndex(torch.cat(reads) if reads else empty, window,
                     torch.cat(writes) if writes else empty, torch.cat(write_rows) if write_rows
                     else torch.empty(0, dtype=torch.long, device=dev))


def _slot_rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """The pool tensor `[2, slots, kv_heads, D]` as `[2, slots, kv_heads * D]` (a view)."""
    return kv_cache.view(2, kv_cache.shape[1], -1)


def read_rows(kv_cache: torch.Tensor, slots: torch.Tensor, hidden: int) -> torch.Tensor:
    """The state rows `[M, hidden]` stored at `slots [M, r]`."""
    m, r = slots.shape
    pool = _slot_rows(kv_cache)
    parts = pool.index_select(1, slots.flatten())  # [2, M * r, width]
    return parts.view(2, m, r, pool.shape[-1]).permute(1, 2, 0, 3).reshape(m, 2 * r * pool.shape[-1])[:, :hidden]


def write_rows(kv_cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Store `rows [W, hidden]` at `slots [W, r]` (the inverse of `read_rows`)."""
    w, r = slots.shape
    pool = _slot_rows(kv_cache)
    width = pool.shape[-1]
    values = F.pad(rows, (0, 2 * r * width - rows.shape[1])).view(w, r, 2, width).permute(2, 0, 1, 3)
    pool.index_copy_(1, slots.flatten(), values.reshape(2, w * r, width).to(pool.dtype))


def short_conv(x: torch.Tensor, weight: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
               bias: torch.Tensor | None = None, index: ConvIndex | None = None) -> torch.Tensor:
    """The causal depthwise convolution `weight [hidden, 1, L]` (and `bias`) of every token's input
    `x [tokens, hidden]` with its request's previous inputs (from the pool); stores the inputs the next
    steps need. `index`: the pass's ring reads and writes where the caller has them (a Mamba layer's)."""
    t, hidden = x.shape
    kernel = weight.shape[-1]
    if index is None:
        index = meta.state
    if index is None:  # (the group's first conv layer of the pass; the others share it)
        r = state_slots_per_row(hidden, kv_cache.shape[2], kv_cache.shape[3])
        index = meta.state = conv_index(meta, t, kernel, r)
    cached = read_rows(kv_cache, index.read_slots, hidden).to(x.dtype)
    rows = torch.cat([cached, x, x.new_zeros(1, hidden)])
    window = rows.index_select(0, index.window).view(t, kernel, hidden)
    if index.write_rows.numel():
        write_rows(kv_cache, index.write_slots, x.index_select(0, index.write_rows))
    # One fp32 multiply-add a tap, oldest first, from the bias: oneDNN's depthwise convolution (transformers'
    # `F.conv1d`) bit for bit in fp32 and bf16, at a fraction of its cost on a few rows.
    taps = weight.view(hidden, kernel).t().float()
    first = window[:, 0].float()
    out = first * taps[0] if bias is None else torch.addcmul(bias.float(), first, taps[0])
    for k in range(1, kernel):
        out = torch.addcmul(out, window[:, k].float(), taps[k])
    return out.to(x.dtype)
