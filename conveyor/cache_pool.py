"""`CachePool`: the fixed pool of KV memory chunks that every allocator draws from (SPEC section 5).

A chunk is `page_size` token slots in every attention layer, so a full-attention block (one page
per layer) is exactly one chunk. K/V live in one tensor per layer, `[2, num_chunks * page_size,
kv_heads, head_dim]`: the slot of token `t` in chunk `c` is `c * page_size + t`, which lets the
model write and gather K/V for a whole ragged batch with one index tensor. Chunks 0 and 1 are
reserved: padding tokens write into them and padded reads point at them, so no request's data is
ever touched by padding. They are zeroed; the rest is left uninitialised (on CPU the pages are
only committed as requests fill them), which is safe because nothing reads a slot before it is
written except through padding, which reads the reserved chunks.
"""

from __future__ import annotations

from collections import deque

import torch

NUM_RESERVED_CHUNKS = 2


class CachePool:
    """Owns the KV tensors and the list of free chunks."""

    def __init__(self, num_chunks: int, page_size: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        if num_chunks <= NUM_RESERVED_CHUNKS:
            raise ValueError(f"the KV pool needs more than {NUM_RESERVED_CHUNKS} chunks, got {num_chunks}")
        self.num_chunks = num_chunks
        self.page_size = page_size
        self.kv = [torch.empty(2, num_chunks * page_size, num_kv_heads, head_dim, dtype=dtype, device=device)
                   for _ in range(num_layers)]
        for layer in self.kv:
            layer[:, :NUM_RESERVED_CHUNKS * page_size].zero_()
        self._free: deque[int] = deque(range(NUM_RESERVED_CHUNKS, num_chunks))

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
        return [self._free.popleft() for _ in range(n)]

    def free(self, chunks: list[int]) -> None:
        self._free.extend(chunks)


def available_memory(device: torch.device) -> int:
    """Bytes free for the pool: the device's free memory on CUDA, available system memory on CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info.get("MemAvailable", info.get("MemFree", 0))


def plan_num_chunks(*, num_blocks: int | None, max_memory_percent: float | None, bytes_per_chunk: int,
                    activation_bytes: int, max_useful_chunks: int, device: torch.device) -> int:
    """Chunks for the pool (reserved ones included): `num_blocks` when given, else `max_memory_percent`
    of the memory left after one full-size pass's activations, capped at what could ever be used."""
    if num_blocks is not None:
        return num_blocks + NUM_RESERVED_CHUNKS
    if max_memory_percent is None:
        max_memory_percent = 0.9 if device.type == "cuda" else 0.5
    budget = int((available_memory(device) - activation_bytes) * max_memory_percent)
    fits = budget // bytes_per_chunk
    if fits <= NUM_RESERVED_CHUNKS:
        raise MemoryError(f"not enough free memory for a KV cache: {budget} bytes budget, "
                          f"{bytes_per_chunk} bytes per chunk")
    return min(fits, max_useful_chunks + NUM_RESERVED_CHUNKS)
