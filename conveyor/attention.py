"""Attention over the paged KV cache for one flattened ragged batch (selective batching).

The model runs every token-wise operation on all of the batch's tokens at once; only attention
needs to know which tokens belong to which request. `AttentionMetadata` carries that: where each
new token's K/V goes (`slot_mapping`), and which cache slots each query may read. Decode rows
(one query each) are attended together; prefill chunks, few per step, one call each.
`AttentionBackend` is the interface: `TorchPagedAttention` is pure PyTorch (CPU and CUDA), and
`CpuPagedAttention` reads decode K/V straight from the pages with a native kernel (fp32 CPU).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


def cache_slots(block_tables: torch.Tensor, page_size: int) -> torch.Tensor:
    """Cache slot of every position covered by a block table: `[..., blocks] -> [..., blocks * page_size]`."""
    offsets = torch.arange(page_size, device=block_tables.device)
    return (block_tables.unsqueeze(-1) * page_size + offsets).flatten(-2)


@dataclass
class PrefillSpan:
    """One request's prefill chunk: queries `[q_start, q_start + q_len)` of the batch."""

    q_start: int
    q_len: int
    kv_slots: torch.Tensor  # [context_len] cache slots of positions 0 .. context_len - 1
    mask: torch.Tensor | None  # [q_len, context_len] bool, None when the chunk starts at position 0


@dataclass
class AttentionMetadata:
    """Index tensors shared by every layer of one forward pass. Decode rows come first."""

    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V is written
    page_size: int
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] int64, padded with chunk 0
    decode_context_lens: torch.Tensor | None = None  # [num_decodes] int64, the new token included
    decode_kv_slots: torch.Tensor | None = None  # [num_decodes, max_context] (padding reads slot 0)
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_context] bool, True = attend
    prefills: list[PrefillSpan] = field(default_factory=list)


class AttentionBackend:
    """Writes the new K/V into the cache and attends each query to its request's context."""

    def prepare(self, meta: AttentionMetadata) -> None:
        """Derive any per-pass index tensors the backend needs (once per forward, not per layer)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        raise NotImplementedError


class TorchPagedAttention(AttentionBackend):
    """Pure PyTorch (gather + scaled_dot_product_attention); runs on CPU and CUDA.

    Each layer gathers its requests' K/V into one workspace reused by every layer and every step
    (grown when a batch needs more), so the hot path allocates no large tensors: fresh large
    allocations cost page faults on every call on CPU.
    """

    def __init__(self) -> None:
        self._workspace: torch.Tensor | None = None

    def _gather(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given cache slots, `[n, Hkv, D]` each, in the workspace."""
        n = slots.numel()
        ws = self._workspace
        if ws is None or ws.shape[1] < n or ws.dtype != kv_cache.dtype or ws.device != kv_cache.device:
            size = max(n, int(1.5 * ws.shape[1])) if ws is not None else n
            ws = self._workspace = torch.empty(2, size, *kv_cache.shape[2:], dtype=kv_cache.dtype,
                                               device=kv_cache.device)
        # index_select, not advanced indexing: on CPU it is an order of magnitude faster.
        k = torch.index_select(kv_cache[0], 0, slots, out=ws[0, :n])
        v = torch.index_select(kv_cache[1], 0, slots, out=ws[1, :n])
        return k, v

    def prepare(self, meta: AttentionMetadata) -> None:
        if meta.num_decodes:
            slots = cache_slots(meta.decode_block_tables, meta.page_size)
            visible = torch.arange(slots.shape[1], device=slots.device) < meta.decode_context_lens.unsqueeze(1)
            meta.decode_kv_slots = slots.masked_fill(~visible, 0)  # padding reads the reserved chunk
            meta.decode_mask = visible[:, None, None, :]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D]; kv_cache: [2, slots, Hkv, D]. Returns [T, H, D]."""
        kv_cache[0].index_copy_(0, meta.slot_mapping, k)
        kv_cache[1].index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        if meta.num_decodes:
            out[:meta.num_decodes] = self._decode(q[:meta.num_decodes], kv_cache, meta, scale)
        self._prefill(q, kv_cache, meta, scale, out)
        return out

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        nd, slots = q.shape[0], meta.decode_kv_slots
        keys, values = (x.view(nd, slots.shape[1], *kv_cache.shape[2:]).transpose(1, 2)  # [B, Hkv, L, D]
                        for x in self._gather(kv_cache, slots.flatten()))
        o = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=meta.decode_mask,
                                           scale=scale, enable_gqa=q.shape[1] != kv_cache.shape[2])
        return o.squeeze(2)

    def _prefill(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                 out: torch.Tensor) -> None:
        gqa = q.shape[1] != kv_cache.shape[2]
        for span in meta.prefills:
            qs = q[span.q_start:span.q_start + span.q_len].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            keys, values = (x.transpose(0, 1).unsqueeze(0) for x in self._gather(kv_cache, span.kv_slots))
            o = F.scaled_dot_product_attention(qs, keys, values, attn_mask=span.mask, is_causal=span.mask is None,
                                               scale=scale, enable_gqa=gqa)
            out[span.q_start:span.q_start + span.q_len] = o.squeeze(0).transpose(0, 1)
        return out


class CpuPagedAttention(TorchPagedAttention):
    """Decode rows through the native kernel, which reads K/V from the pages in place; prefill
    chunks as in `TorchPagedAttention`. fp32 on CPU only."""

    def __init__(self, kernel: object) -> None:
        super().__init__()
        self.kernel = kernel

    def prepare(self, meta: AttentionMetadata) -> None:
        """The kernel takes the block tables as they are: no gather indices to build."""

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        return self.kernel.paged_decode_attention(q.contiguous(), kv_cache, meta.decode_block_tables,
                                                  meta.decode_context_lens, meta.page_size, scale)


def make_attention_backend(device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """The native CPU kernel for fp32 on CPU when it builds (unless `CONVEYOR_NATIVE_KERNELS=0`),
    else pure PyTorch."""
    if device.type == "cpu" and dtype == torch.float32 and os.environ.get("CONVEYOR_NATIVE_KERNELS") != "0":
        from .kernels import cpu_paged_attention

        kernel = cpu_paged_attention()
        if kernel is not None:
            return CpuPagedAttention(kernel)
    return TorchPagedAttention()
