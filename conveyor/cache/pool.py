"""`CachePool`: the fixed pool of KV memory chunks that every allocator draws from (docs/design/kv-cache.md).

The model's layers are split into groups of equal size, each group of one attention type
(`layer_groups`), and a chunk is `page_size` token slots in every layer of a group: K/V live in
one tensor per layer of a group, `[2, num_chunks * page_size, kv_heads, head_dim]`, and layer `j`
of every group uses tensor `j`. So a chunk serves any group, full or sliding, and the memory is
shared between attention types. For a model with one attention type there is one group of all
layers and a block (one page per layer) is exactly one chunk. The slot of token `t` in chunk `c`
is `c * page_size + t`, which lets the model write and gather K/V for a whole ragged batch with
one index tensor. Chunks 0 and 1 are reserved: padding tokens write into them and padded reads
point at them, so no request's data is ever touched by padding. They are zeroed; the rest is left
uninitialised (on CPU the pages, huge ones where the kernel gives them, are only committed as requests
fill them), which is safe because nothing reads a slot before it is written except through padding,
which reads the reserved chunks.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import mmap
import os
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError
from ..kernels import host_memory

NUM_RESERVED_CHUNKS = 2


def layer_groups(layer_types: list[str]) -> list[tuple[str, list[int]]]:
    """Split layers into groups of one attention type and equal size: the largest size that divides
    every type's layer count (as transformers' continuous batching does), in order of first layer.
    E.g. 4 sliding + 2 full layers -> groups of 2: two sliding groups and one full group."""
    by_type: dict[str, list[int]] = {}
    for i, t in enumerate(layer_types):
        by_type.setdefault(t, []).append(i)
    size = math.gcd(*(len(layers) for layers in by_type.values()))
    groups = [(t, layers[k:k + size]) for t, layers in by_type.items() for k in range(0, len(layers), size)]
    return sorted(groups, key=lambda g: g[1][0])


class CachePool:
    """Owns the KV tensors (`num_layers` of them: the layers of one group) and the list of free chunks."""

    def __init__(self, num_chunks: int, page_size: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        if num_chunks <= NUM_RESERVED_CHUNKS:
            raise ValueError(f"the KV pool needs more than {NUM_RESERVED_CHUNKS} chunks, got {num_chunks}")
        self.num_chunks = num_chunks
        self.page_size = page_size
        # On the CPU, on huge pages (`host_memory.empty`): decode at depth reads every position's rows of
        # every layer, a 4 KiB page's worth of positions at a time on small pages, each a TLB miss.
        shape = (2, num_chunks * page_size, num_kv_heads, head_dim)
        self.kv = [host_memory.empty(shape, dtype) if device.type == "cpu" else
                   torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        for layer in self.kv:
            layer[:, :NUM_RESERVED_CHUNKS * page_size].zero_()
        # A stack, the lowest chunk on top at first: the most recently freed chunks are taken first, so a
        # workload reuses the memory it has touched (resident, likely in cache) instead of cycling through
        # the whole pool and faulting in fresh pages all the way.
        self._free: list[int] = list(range(num_chunks - 1, NUM_RESERVED_CHUNKS - 1, -1))

    @staticmethod
    def bytes_per_chunk(page_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * page_size * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()

    @property
    def num_usable(self) -> int:
        return self.num_chunks - NUM_RESERVED_CHUNKS

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """`n` chunks, or None (and nothing taken) if fewer are free."""
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, chunks: list[int]) -> None:
        self._free.extend(reversed(chunks))  # the first of them is taken first

    def copy_slots(self, src: int, dst: int, count: int) -> None:
        """The first `count` token slots of chunk `src` (every layer's K and V rows, an int8 row's scale
        with it) into chunk `dst`'s."""
        a, b = src * self.page_size, dst * self.page_size
        for layer in self.kv:
            layer[:, b:b + count] = layer[:, a:a + count]

    def copy_slot_list(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Token slots `src[i]` into `dst[i]` (slot = chunk * page_size + offset), every layer's K and V rows
        with their scales; no slot is both read and written."""
        if src.numel():
            src, dst = src.to(self.kv[0].device), dst.to(self.kv[0].device)
            for layer in self.kv:
                layer[:, dst] = layer[:, src]

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.kv)

    def resident_bytes(self) -> int:
        """Bytes of the KV tensors in physical memory now. On CPU the tensors are uncommitted until
        written (`torch.empty`), so the pool's share of the process' RSS grows as traffic first
        touches chunks; this counts the resident pages (`mincore`) so that growth is not taken for
        a leak. Elsewhere the memory is committed when allocated: the full size. O(pool pages): call
        it when read, not per step."""
        if self.kv[0].device.type != "cpu":
            return self.nbytes
        # The partial pages at a tensor's ends count whole: clamp to the tensor's size.
        return sum(min(layer.nbytes, resident_pages(layer.data_ptr(), layer.nbytes) * mmap.PAGESIZE)
                   for layer in self.kv)


def resident_pages(address: int, length: int) -> int:
    """Pages of `[address, address + length)` resident in memory (mincore(2); the partial pages at
    both ends count whole)."""
    start = address - address % mmap.PAGESIZE
    pages = -(-(address + length - start) // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    if _libc().mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * mmap.PAGESIZE), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed on the KV pool's memory")
    # numpy, not torch: this runs on the server's event loop, and a torch op over this many bytes would
    # start an OpenMP team on that thread, a second one beside the engine's (see kernels/openmp.py).
    return int(np.count_nonzero(np.frombuffer(vec, dtype=np.uint8) & 1))


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    return libc


def available_memory(device: torch.device) -> int:
    """Bytes free for the pool: the device's free memory on CUDA, available system memory on CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info.get("MemAvailable", info.get("MemFree", 0))


def working_memory_bytes(model: Any, config: Any, dtype: torch.dtype, dense_scores: bool = True) -> int:
    """Memory a full-size pass needs besides the pool, reserved before the pool is sized: activations
    of `max_batch_tokens` tokens (residual, norms, q/k/v with their rotated copies, MLP), logits and
    sampling buffers of `max_requests_per_batch` rows (fp32), the index tensors of every layer group
    (int64 slots over whole contexts), and prefill attention's: with `dense_scores` (an attention
    backend that builds them: `AttentionBackend.dense_scores`) scores and probabilities (fp32, every
    head, queries by up to a whole context) and bool masks as big, else a context's K/V laid out for
    the kernel (its key blocks, 8 bytes a value at most)."""
    c = model.config
    elem = torch.tensor([], dtype=dtype).element_size()
    q, kv = c.num_attention_heads * model.head_dim, model.num_kv_heads * model.head_dim
    tokens, rows = config.max_batch_tokens, config.max_requests_per_batch
    context = config.max_model_len or model.max_model_len
    mlp = getattr(c, "intermediate_size", None) or getattr(c, "hidden_dim", 4 * c.hidden_size)  # (DistilBERT's name)
    activations = tokens * (4 * c.hidden_size + 3 * q + 4 * kv + 3 * mlp) * elem
    logits = 3 * rows * c.vocab_size * 4
    groups = len(layer_groups(model.layer_types))
    if dense_scores:
        attention = 2 * c.num_attention_heads * tokens * context * 4 + groups * tokens * context * (8 + 1)
    else:
        attention = context * 2 * kv * 8
    return activations + logits + groups * rows * context * (8 + 1) + attention


def plan_num_chunks(*, num_blocks: int | None, max_memory_percent: float | None, bytes_per_chunk: int,
                    activation_bytes: int, max_useful_chunks: int, device: torch.device,
                    memory_bytes: int | None = None) -> int:
    """Chunks for the pool (reserved ones included): `num_blocks` when given, else those `memory_bytes` hold
    (`kv_cache_memory_bytes`), else `max_memory_percent` of the memory left after one full-size pass's
    working memory (`working_memory_bytes`); the last two capped at what `max_requests_per_batch` requests
    of the longest length could ever use."""
    if num_blocks is not None:
        return num_blocks + NUM_RESERVED_CHUNKS
    free = available_memory(device) - activation_bytes
    if memory_bytes is not None:
        if memory_bytes > free:
            raise MemoryError(f"a KV cache of {memory_bytes} bytes (kv_cache_memory_bytes) does not fit: {free} bytes "
                              "are free beside the weights and one pass's working memory")
        budget = memory_bytes
    else:
        budget = int(free * (max_memory_percent or (0.9 if device.type == "cuda" else 0.5)))
    fits = budget // bytes_per_chunk
    if fits <= NUM_RESERVED_CHUNKS:
        what = "kv_cache_memory_bytes is too small" if memory_bytes is not None else "not enough free memory"
        raise MemoryError(f"{what} for a KV cache: {budget} bytes budget, {bytes_per_chunk} bytes per chunk")
    return min(fits, max_useful_chunks + NUM_RESERVED_CHUNKS)


def cpu_kv_cache_space() -> int | None:
    """vLLM's CPU setting VLLM_CPU_KVCACHE_SPACE (GiB of KV cache) in bytes; None where unset or 0 (vLLM's
    "size it automatically")."""
    value = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
    try:
        gib = float(value or 0)
    except ValueError:
        raise ConfigError(f"VLLM_CPU_KVCACHE_SPACE must be a number of GiB, got {value!r}") from None
    if gib < 0:
        raise ConfigError(f"VLLM_CPU_KVCACHE_SPACE must be >= 0 GiB, got {value!r}")
    return int(gib * 2**30) or None
