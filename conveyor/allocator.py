"""Cache allocators: cut the pool's chunks into blocks and keep each request's block table.

`FullAttentionCacheAllocator`: a request holds one block per `page_size` tokens of its sequence,
in order; block `i` of its table holds tokens `[i * page_size, (i + 1) * page_size)`. Allocation
is all or nothing, and a request's blocks go back to the pool the moment it is freed.
"""

from __future__ import annotations

from .cache_pool import CachePool


class FullAttentionCacheAllocator:
    """Blocks for full-attention layers: one chunk per block, tables grow with the sequence."""

    attention_type = "full_attention"

    def __init__(self, pool: CachePool) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_usable

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """New blocks a request needs so that its first `num_tokens` tokens have slots."""
        held = len(self.block_tables.get(request_id, ()))
        return max(self.blocks_for_tokens(num_tokens) - held, 0)

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's table to cover `num_tokens` tokens; False (nothing taken) if no room."""
        needed = self.blocks_needed(request_id, num_tokens)
        if needed == 0:
            self.block_tables.setdefault(request_id, [])
            return True
        blocks = self.pool.allocate(needed)
        if blocks is None:
            return False
        self.block_tables.setdefault(request_id, []).extend(blocks)
        return True

    def free(self, request_id: str) -> int:
        """Return every block the request holds; how many were returned."""
        blocks = self.block_tables.pop(request_id, [])
        self.pool.free(blocks)
        return len(blocks)

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables[request_id]
