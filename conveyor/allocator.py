"""Cache allocators: cut the pool's chunks into blocks and keep each request's block table.

`FullAttentionCacheAllocator`: a request holds one block per `page_size` tokens of its sequence,
in order; block `i` of its table holds tokens `[i * page_size, (i + 1) * page_size)`. Allocation
is all or nothing.

With block sharing on (prefix caching, SPEC section 6; see `prefix_cache.py`), completed blocks
are hashed as they complete (`register_full_blocks`, which the engine calls after every step) and
a new request starts its table with the blocks that already hold its longest cached prefix
(`match_prefix`, then `allocate(..., shared=...)`). A block counts its holders; when the last one
frees it, a completed block stays cached (content and digest kept) and any other block goes back
to the pool. Cached blocks count as free: `allocate` reclaims them, newest first, once the pool's
uninitialized blocks run out. Without sharing no block is ever hashed, so every freed block goes
straight back to the pool.

An allocator whose blocks cannot be shared (a future sliding-window one, which recycles its
pages) sets `supports_sharing = False`; the engine turns sharing on only if every allocator
supports it.
"""

from __future__ import annotations

from collections.abc import Sequence

from .cache_pool import CachePool
from .prefix_cache import BlockHashes, PrefixCache
from .request import Request


class FullAttentionCacheAllocator:
    """Blocks for full-attention layers: one chunk per block, tables grow with the sequence."""

    attention_type = "full_attention"
    supports_sharing = True

    def __init__(self, pool: CachePool, block_sharing: bool = False) -> None:
        if block_sharing and not self.supports_sharing:
            raise ValueError(f"{type(self).__name__} does not support block sharing")
        self.pool = pool
        self.page_size = pool.page_size
        self.block_sharing = block_sharing
        self.block_tables: dict[str, list[int]] = {}
        self.ref_counts: dict[int, int] = {}  # held block -> number of requests holding it
        self.prefix_cache = PrefixCache()
        self._hashes: dict[str, BlockHashes] = {}  # request -> digests of its leading completed blocks
        self._num_registered: dict[str, int] = {}  # request -> leading blocks already indexed (or matched)

    # -- counts -----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks a request could get now: uninitialized ones plus cached ones (reclaimable)."""
        return self.pool.num_free + self.prefix_cache.num_cached

    @property
    def num_cached_blocks(self) -> int:
        return self.prefix_cache.num_cached

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_usable

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """New blocks a request needs so that its first `num_tokens` tokens have slots."""
        held = len(self.block_tables.get(request_id, ()))
        return max(self.blocks_for_tokens(num_tokens) - held, 0)

    # -- prefix matching --------------------------------------------------------------------
    def match_prefix(self, request: Request) -> list[int]:
        """Blocks already holding the longest completed prefix of a request that holds no blocks and
        has nothing computed; changes nothing. At most `(num_tokens - 1) // page_size` blocks, so
        the last token is always computed (its logits are needed)."""
        if not self.block_sharing or request.num_computed_tokens or request.request_id in self.block_tables:
            return []
        hashes = self._block_hashes(request)
        matched: list[int] = []
        for i in range((request.num_tokens - 1) // self.page_size):
            block = self.prefix_cache.lookup(hashes.digest(i))
            if block is None:
                break
            matched.append(block)
        return matched

    def register_full_blocks(self, request: Request) -> None:
        """Index the request's blocks that its `num_computed_tokens` has just completed."""
        if not self.block_sharing:
            return
        rid = request.request_id
        done = self._num_registered.get(rid, 0)
        full = request.num_computed_tokens // self.page_size
        if full <= done:
            return
        table = self.block_tables[rid]
        hashes = self._block_hashes(request)
        for i in range(done, full):
            self.prefix_cache.register(table[i], hashes.digest(i))
        self._num_registered[rid] = full

    # -- allocation -------------------------------------------------------------------------
    def allocate(self, request_id: str, num_tokens: int, shared: Sequence[int] = ()) -> bool:
        """Grow the request's table to cover `num_tokens` tokens; False (nothing changed) if no room.
        `shared` (from `match_prefix`) starts a new table with blocks already computed: each gains a
        holder, and only the rest are taken from the free blocks."""
        held = len(self.block_tables.get(request_id, ()))
        if shared and held:
            raise ValueError(f"shared blocks can only start a table; {request_id!r} already holds {held}")
        needed = max(self.blocks_for_tokens(num_tokens) - held - len(shared), 0)
        # A matched block that is cached now counts as free, but it cannot be reclaimed for this request.
        reclaimable = self.num_free_blocks - sum(self.prefix_cache.is_cached(b) for b in shared)
        if needed > reclaimable:
            return False
        for block in shared:
            self._hold(block)
        new = self._take(needed)
        for block in new:
            self.ref_counts[block] = 1
        table = self.block_tables.setdefault(request_id, [])
        table.extend(shared)
        table.extend(new)
        if shared:
            self._num_registered[request_id] = len(shared)
        return True

    def free(self, request_id: str) -> int:
        """Give up every block the request holds (and its digests); how many it held. A block whose
        last holder this was stays cached if it is completed and indexed, else goes back to the pool."""
        blocks = self.block_tables.pop(request_id, [])
        self._hashes.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        uninitialized = []
        for block in blocks:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                del self.ref_counts[block]
                if not self.prefix_cache.park(block):
                    uninitialized.append(block)
        self.pool.free(uninitialized)
        return len(blocks)

    def exclusive_blocks(self, request_id: str) -> int:
        """Blocks that freeing this request would return (shared ones stay with their other users)."""
        return sum(1 for b in self.block_tables.get(request_id, ()) if self.ref_counts[b] == 1)

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables[request_id]

    def _block_hashes(self, request: Request) -> BlockHashes:
        """The request's digests, kept until it is freed (a lookup that did not lead to admission keeps
        them for the next try); tied to the request object, so a reused id never reads stale ones."""
        hashes = self._hashes.get(request.request_id)
        if hashes is None or hashes.tokens is not request:
            hashes = self._hashes[request.request_id] = BlockHashes(self.page_size, request)
        return hashes

    def _hold(self, block: int) -> None:
        if block not in self.ref_counts:
            self.prefix_cache.reuse(block)  # cached -> held
        self.ref_counts[block] = self.ref_counts.get(block, 0) + 1

    def _take(self, n: int) -> list[int]:
        """`n` blocks for new content; the caller has checked there are enough free ones. Cached
        blocks are reclaimed (newest first) only for what the uninitialized pool lacks."""
        for _ in range(n - self.pool.num_free):
            self.pool.free([self.prefix_cache.evict()])
        blocks = self.pool.allocate(n)
        assert blocks is not None
        return blocks
