"""Attention over the paged KV cache for one flattened ragged batch (selective batching).

The model runs every token-wise operation on all of the batch's tokens at once; only attention
needs to know which tokens belong to which request. `AttentionMetadata` carries that: where each
new token's K/V goes (`slot_mapping`), and which cache slots each query may read. Decode rows
(one query each) are attended together; prefill chunks, few per step, one call each (all in one
kernel call natively). Sliding windows need nothing here: the runner's metadata (ring slots, masks,
context lengths, the window) encodes them.
`AttentionBackend` is the interface: `TorchPagedAttention` is pure PyTorch (CPU and CUDA),
`CpuPagedAttention` reads K/V straight from the pages with native kernels (fp32 and bf16 on CPU), and
`TritonPagedAttention` does so in one Triton kernel for the whole batch (CUDA; CPU under Triton's
interpreter). `make_attention_backend` picks one (`ContinuousBatchingConfig.attention_backend`).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..cache.kv_format import as_bytes, decode_kv, encode_kv, int8_key_query, is_encoded, write_kv
from ..cache.transfer import to_device
from ..errors import ConfigError, install_command
from ..kernels import cpu_flags, cpu_paged_attention, native_kernels_enabled

if TYPE_CHECKING:
    from ..cache.allocator import AttentionTypeAllocator
    from ..sched.output import ScheduledChunk


def cache_slots(block_tables: torch.Tensor, page_size: int) -> torch.Tensor:
    """Cache slot of every position covered by a block table: `[..., blocks] -> [..., blocks * page_size]`."""
    offsets = torch.arange(page_size, device=block_tables.device)
    return (block_tables.unsqueeze(-1) * page_size + offsets).flatten(-2)


@dataclass
class PrefillSpan:
    """One request's prefill chunk: queries `[q_start, q_start + q_len)` of the batch, which attend to
    the cached context `ctx_slots` (positions before the chunk, in order) and to the chunk itself."""

    q_start: int
    q_len: int
    ctx_slots: torch.Tensor  # [n_ctx] cache slots of the earlier positions this chunk may see
    mask: torch.Tensor | None  # [q_len, n_ctx + q_len] bool, True = attend; None = plain causal
    start: int = 0  # position of the chunk's first token
    block_table: torch.Tensor | None = None  # [blocks] the request's block table in this group


@dataclass
class AttentionMetadata:
    """Index tensors shared by every layer of one layer group in one forward pass. Decode rows first.

    For a sliding-window group the slots are those of the request's ring and `decode_context_lens`
    is at most the window: the ring then holds exactly the window, in ring order."""

    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V is written
    page_size: int
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] int64, padded with chunk 0
    decode_context_lens: torch.Tensor | None = None  # [num_decodes] int64 slots to read, the new token's included
    decode_positions: torch.Tensor | None = None  # [num_decodes] int64 position of each decode's new token
    decode_kv_slots: torch.Tensor | None = None  # [num_decodes, max_context] (padding reads slot 0)
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_context] bool, True = attend
    decode_shared_rows: bool = False  # some request has several decode rows (speculation): its K/V first
    prefills: list[PrefillSpan] = field(default_factory=list)
    window: int | None = None  # the group's sliding window (None: full attention)
    prefill_ctx_slots: torch.Tensor | None = None  # every chunk's ctx_slots, concatenated (native backend)
    # [chunks, 5] int64: q_start, q_len, offset in prefill_ctx_slots, n_ctx, start (native backend)
    prefill_chunks: torch.Tensor | None = None
    ragged: object | None = None  # the Triton backend's per-pass index tensors (`triton_attention.RaggedBatch`)
    state: object | None = None  # a conv group's per-pass indices (`short_conv.ConvIndex`), made by its first layer


def decode_block_tables(allocator: AttentionTypeAllocator, group: int, decodes: Sequence[ScheduledChunk],
                        device: torch.device) -> torch.Tensor:
    """`[rows, width]` int64: each decode row's block table in layer group `group` (a request's once per row it
    has), padded to the widest with chunk 0, the chunk the pool reserves for padding."""
    tables = [t for c in decodes for t in [allocator.block_table(c.request.request_id, group)] * c.num_tokens]
    width = max(len(t) for t in tables)
    return to_device([t + [0] * (width - len(t)) for t in tables], torch.long, device)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
           scale: float, softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`q [B, H, n, D]` over `k, v [B, Hkv, L, D]`. SDPA, or (with logit soft-capping or attention sinks,
    which SDPA lacks) the eager sequence transformers uses: scores, `tanh(s / cap) * cap`, mask, then
    Gemma 2's fp32 softmax, or gpt-oss's: each head's sink logit `sinks [H]` appended to its rows, the
    max subtracted, softmax, the sink's column dropped."""
    gqa = q.shape[1] != k.shape[1]
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=gqa)
    if gqa:
        k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
    scores = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        n, length = q.shape[2], k.shape[2]
        mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(length - n)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v
    logits = torch.cat((scores, sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)), dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    return torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(v.dtype) @ v


def read_kv(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The K (or V) rows `[n, Hkv, D]` of `slots` from one half of the cache, int8 or fp8 rows decoded to
    `dtype`."""
    return decode_kv(as_bytes(cache).index_select(0, slots).view(cache.dtype), dtype)


class AttentionBackend:
    """Writes the new K/V into the cache and attends each query to its request's context."""

    decode_reads_written = False  # decode rows read the pass's new K/V from the cache (written first)
    dense_scores = False  # prefill builds each chunk's whole scores and masks (the pool's sizing reserves them)

    def prepare(self, meta: AttentionMetadata) -> None:
        """Derive any per-pass index tensors the backend needs (once per forward, not per layer)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """`sinks`: gpt-oss's attention sinks, one logit per query head (fp32 [H]) joining every softmax's
        denominator; None: none. Every backend here honours them."""
        raise NotImplementedError


class TorchPagedAttention(AttentionBackend):
    """Pure PyTorch (gather + scaled_dot_product_attention); runs on CPU and CUDA.

    Decode rows gather their requests' K/V into one workspace reused by every layer and every step
    (grown when a batch needs more), so the hot path allocates no large tensors: fresh large
    allocations cost page faults on every call on CPU. A prefill chunk reads its earlier context
    from the cache before the new K/V is written (a sliding ring may reuse those slots for the
    chunk's own tokens) and takes its own K/V straight from the batch.
    """

    decode_reads_written = True
    dense_scores = True

    def __init__(self) -> None:
        self._workspace: torch.Tensor | None = None

    def _gather(self, kv_cache: torch.Tensor, slots: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given cache slots, `[n, Hkv, D]` each, in the workspace (int8 or fp8 rows decoded
        to `dtype`)."""
        if is_encoded(kv_cache.dtype):
            return read_kv(kv_cache[0], slots, dtype), read_kv(kv_cache[1], slots, dtype)
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
                meta: AttentionMetadata, scale: float, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D]; kv_cache: [2, slots, Hkv, D]. Returns [T, H, D]."""
        if kv_cache.dtype == torch.uint8:  # int8 rows: the query the native kernels score with
            q, scale = int8_key_query(q, scale), 1.0
        contexts = [tuple(read_kv(kv_cache[i], span.ctx_slots, q.dtype) for i in (0, 1)) for span in meta.prefills]
        k, v = write_kv(kv_cache, meta.slot_mapping, k, v)  # a chunk sees its own K/V as the cache holds them
        out = torch.empty_like(q)
        if meta.num_decodes:
            out[:meta.num_decodes] = self._decode(q[:meta.num_decodes], kv_cache, meta, scale, softcap, sinks)
        for span, (k_ctx, v_ctx) in zip(meta.prefills, contexts):
            rows = slice(span.q_start, span.q_start + span.q_len)
            keys, values = ((torch.cat((ctx, new[rows])) if ctx.shape[0] else new[rows]).transpose(0, 1).unsqueeze(0)
                            for ctx, new in ((k_ctx, k), (v_ctx, v)))  # [1, Hkv, n_ctx + q_len, D]
            o = attend(q[rows].transpose(0, 1).unsqueeze(0), keys, values, span.mask, span.mask is None, scale,
                       softcap, sinks)
            out[rows] = o.squeeze(0).transpose(0, 1)
        return out

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        nd, slots = q.shape[0], meta.decode_kv_slots
        keys, values = (x.view(nd, slots.shape[1], *x.shape[1:]).transpose(1, 2)  # [B, Hkv, L, D]
                        for x in self._gather(kv_cache, slots.flatten(), q.dtype))
        return attend(q.unsqueeze(2), keys, values, meta.decode_mask, False, scale, softcap, sinks).squeeze(2)


class CpuPagedAttention(AttentionBackend):
    """Native kernels on CPU (fp32 and bf16, over caches of that dtype or of int8 rows) that read K/V
    from the pages in place: decode rows after
    the new K/V is written, prefill chunks before (their context from the cache, a sliding ring's
    included, their own K/V from the batch), so neither gathers, concatenates nor builds masks.

    bf16 prefill stays here on CPUs with AMX too, where PyTorch's SDPA is faster (about 12% of a
    2,000-token prompt's prefill on the built-in model): SDPA's bf16 kernel JIT-compiles a oneDNN
    brgemm per new (query tail, key tail) shape into a per-thread cache that is never emptied
    (`KernelCache` in ATen's CPUBlas.cpp), about 0.2 MiB per shape (300 prompt lengths: +72 MiB), so
    a server's memory grows with every prompt length it sees. Where the CPU has AMX tiles, the kernel's
    bf16 products run on them (`amx`, kernels/prefill_amx.h), unless batch invariance is asked for: the
    tiles' sums are not the decode kernel's bits."""

    decode_reads_written = True

    def __init__(self, kernel: object) -> None:
        self.kernel = kernel
        self.amx = "amx_bf16" in cpu_flags()

    def prepare(self, meta: AttentionMetadata) -> None:
        """The decode kernel takes the block tables as they are; the prefill kernel takes every chunk's
        context slots in one tensor and one row of offsets per chunk."""
        if meta.prefills:
            offsets = [0]
            for span in meta.prefills:
                offsets.append(offsets[-1] + span.ctx_slots.numel())
            meta.prefill_ctx_slots = torch.cat([span.ctx_slots for span in meta.prefills]).to(torch.int64)
            meta.prefill_chunks = torch.tensor([[span.q_start, span.q_len, offset, span.ctx_slots.numel(), span.start]
                                                for span, offset in zip(meta.prefills, offsets)], dtype=torch.int64)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D]; kv_cache: [2, slots, Hkv, D]. Returns [T, H, D]."""
        out = torch.empty(q.shape, dtype=q.dtype)
        if kv_cache.dtype == torch.uint8:  # int8 rows, quantized once: the chunks attend to them as stored
            k, v = self.kernel.quantize_kv(k), self.kernel.quantize_kv(v)
        if meta.prefills:
            self.kernel.paged_prefill_attention(q, k, v, kv_cache, meta.prefill_ctx_slots, meta.prefill_chunks,
                                                meta.window or 0, scale, softcap or 0.0, out, sinks, amx=self.amx)
        self.kernel.write_kv(kv_cache, meta.slot_mapping, k, v)
        if meta.num_decodes:
            out[:meta.num_decodes] = self._decode(q[:meta.num_decodes], kv_cache, meta, scale, softcap, sinks)
        return out

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        return self.kernel.paged_decode_attention(q.contiguous(), kv_cache, meta.decode_block_tables,
                                                  meta.decode_context_lens, meta.decode_positions, meta.window or 0,
                                                  meta.page_size, scale, softcap or 0.0, sinks)


class TritonPagedAttention(AttentionBackend):
    """One Triton kernel per layer over the whole ragged batch, decode rows and prefill chunks together,
    K/V read from the pages in place (`kernels/triton_attention.py`); CUDA, or CPU tensors under
    Triton's interpreter. The kernel reads before the pass's K/V is written, as the native prefill does."""

    def __init__(self) -> None:
        from ..kernels import triton_attention

        self.kernel = triton_attention

    def prepare(self, meta: AttentionMetadata) -> None:
        """Every sequence's batch rows, position and block-table row, and the kernel's tiles."""
        device = meta.slot_mapping.device
        prefills = [(span.q_start, span.q_len, span.start, span.block_table) for span in meta.prefills]
        meta.ragged = self.kernel.ragged_batch(meta.decode_positions if meta.num_decodes else None,
                                               meta.decode_block_tables, prefills, meta.page_size, meta.window,
                                               device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D]; kv_cache: [2, slots, Hkv, D]. Returns [T, H, D]. An fp8 cache's
        rows are widened as the kernel loads them; the pass attends to its own K/V as the cache holds them."""
        stored_k, stored_v = encode_kv(kv_cache.dtype, k), encode_kv(kv_cache.dtype, v)
        out = self.kernel.paged_attention(q, decode_kv(stored_k, k.dtype), decode_kv(stored_v, v.dtype), kv_cache,
                                          meta.ragged, scale, softcap, sinks)
        as_bytes(kv_cache[0]).index_copy_(0, meta.slot_mapping, as_bytes(stored_k))
        as_bytes(kv_cache[1]).index_copy_(0, meta.slot_mapping, as_bytes(stored_v))
        return out


# The values of `ContinuousBatchingConfig.attention_backend` (the config validates against this table).
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")


def make_attention_backend(device: torch.device, dtype: torch.dtype, backend: str = "auto",
                           kv_cache_dtype: str = "auto") -> AttentionBackend:
    """The backend `ContinuousBatchingConfig.attention_backend` names. "auto": Triton on CUDA (when
    it imports), the native CPU kernels for fp32 and bf16 on CPU when they build (unless
    `CONVEYOR_NATIVE_KERNELS=0`), else pure PyTorch (see `CpuPagedAttention` for why bf16 prefill
    does not take SDPA on CPU). A backend that cannot run here raises a `ConfigError` saying what to do."""
    if backend not in ATTENTION_BACKENDS:
        raise ConfigError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
    if backend == "torch":
        return TorchPagedAttention()
    if kv_cache_dtype == "int8" and backend == "triton":
        raise ConfigError("attention_backend='triton' does not read a kv_cache_dtype='int8' cache (CPU's); use "
                          "'auto', 'cpu' or 'torch', or kv_cache_dtype='fp8'")
    if kv_cache_dtype.startswith("fp8") and device.type == "cpu" and backend in ("auto", "cpu"):
        raise ConfigError(f"kv_cache_dtype={kv_cache_dtype!r}: the native CPU kernels read 'int8', the CPU's "
                          "quantized cache (the same bytes a token); fp8 is read by the Triton kernel on CUDA, and "
                          "on CPU only by attention_backend='torch' (slower)")
    if backend == "triton" or (backend == "auto" and device.type == "cuda" and triton_available()):
        return _triton_backend(device, dtype)
    native = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and native_kernels_enabled()
    kernel = cpu_paged_attention() if native else None
    if kernel is not None:
        return CpuPagedAttention(kernel)
    if backend == "cpu":
        if not native:
            raise ConfigError(f"attention_backend='cpu' runs on CPU with float32 or bfloat16 (and without "
                              f"CONVEYOR_NATIVE_KERNELS=0); this engine is {device.type}, {dtype}: use 'auto' or "
                              "'torch'")
        raise ConfigError("attention_backend='cpu': the native CPU attention kernel did not build (see the log: a "
                          "C++ compiler is needed); use 'auto' or 'torch'")
    return TorchPagedAttention()


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _triton_backend(device: torch.device, dtype: torch.dtype) -> TritonPagedAttention:
    if not triton_available():
        raise ConfigError(f"attention_backend='triton' needs triton, which is not installed: "
                          f"{install_command('gpu')}")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ConfigError(f"attention_backend='triton' takes float32, bfloat16 or float16, got {dtype}")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("attention_backend='triton' on CPU runs only under Triton's interpreter: set "
                          "TRITON_INTERPRET=1 in the environment before starting (slow: it is for tests), run on "
                          "a CUDA device, or use attention_backend='auto'")
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"attention_backend='triton' runs on CUDA (or CPU under TRITON_INTERPRET=1), not on "
                          f"{device.type}")
    backend = TritonPagedAttention()
    if (device.type == "cpu") != backend.kernel.INTERPRETED:
        raise ConfigError("attention_backend='triton': TRITON_INTERPRET was "
                          f"{'' if backend.kernel.INTERPRETED else 'not '}set when the kernel was first imported, "
                          f"so it cannot run on {device.type} in this process; set it (CPU) or leave it unset "
                          "(CUDA) before the first engine starts")
    return backend
