"""Cache allocators: cut the pool's chunks into blocks and keep each request's block tables.

One allocator per attention type of the model (docs/design/kv-cache.md), all drawing chunks from the one
`CachePool`. A model's layers are split into groups of equal size (`cache_pool.layer_groups`), a
chunk being one page in each layer of a group; an allocator serves the `num_groups` groups of its
attention type, so one of its blocks (a page in every layer of that type) is `num_groups` chunks,
one per group. Every count below (`num_free_blocks`, `blocks_needed`, ...) is in pool chunks, so a
single allocator and the `HybridCacheAllocator` that combines several (`hybrid_allocator`) look the
same to the scheduler and the engine; for a model with one attention type there is one group and a
block is exactly one chunk.

- `FullAttentionCacheAllocator` (here): a request holds one block per `page_size` tokens of its
  sequence, in order; block `i` holds tokens `[i * page_size, (i + 1) * page_size)`.
- `SlidingAttentionCacheAllocator` and `StateCacheAllocator` (`sliding_allocator`): a ring per request.

Allocation is all or nothing. With block sharing on (prefix caching, docs/design/prefix-caching.md; see
`prefix_cache.py`), completed blocks are hashed as they complete (`register_full_blocks`, which the
engine calls after every step) and a new request starts its table with the blocks that already hold
its longest cached prefix (`match_prefix`, then `allocate(..., shared=...)`). A block counts its
holders; when the last one frees it, a completed block stays cached (content and digest kept, its
sibling chunks with it) and any other block goes back to the pool. Cached blocks count as free:
`allocate` reclaims them, newest first, once the pool's uninitialized chunks run out. The allocators of
one pool share one `PrefixCache` and one `RequestDigests`. Without sharing no block is ever hashed, so
every freed block goes straight back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..request import Request
from .pool import CachePool
from .prefix_cache import BlockHashes, PrefixCache


def table_length(num_tokens: int, page_size: int, window: int | None) -> int:
    """Blocks a request of `num_tokens` tokens holds: one per page for full attention (`window` None),
    at most a ring of `ceil(window / page_size)` for a sliding window."""
    pages = -(-num_tokens // page_size)
    return pages if window is None else min(pages, -(-window // page_size))


class CacheAllocator:
    """What the scheduler, the engine and the model runner ask of the cache, in pool chunks."""

    pool: CachePool
    page_size: int
    block_sharing: bool = False
    prefix_cache: PrefixCache  # the pool's, every type's (empty where blocks are not shared)

    @property
    def num_free_blocks(self) -> int:
        """Chunks a request could get now: uninitialized ones plus cached ones (reclaimable)."""
        return self.pool.num_free + self.prefix_cache.num_cached

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_usable

    @property
    def num_cached_blocks(self) -> int:
        """Chunks the prefix cache keeps (reclaimable, so counted free too)."""
        return self.prefix_cache.num_cached

    def reset_prefix_cache(self) -> int:
        """Every cached (unheld) block back to the free pool, its digest dropped; how many chunks."""
        count = self.prefix_cache.num_cached
        while self.prefix_cache.num_cached:
            self.pool.free(self.prefix_cache.evict())
        return count

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Chunks a sequence of `num_tokens` tokens occupies (and a pass over it reads)."""
        raise NotImplementedError

    def chunk_end(self, start: int, end: int) -> int:
        """Where a prefill chunk planned over `[start, end)` stops (`end`, unless the cache wants a pass to end
        sooner: `hybrid_allocator`)."""
        return end

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """New chunks a request needs so that its first `num_tokens` tokens have slots."""
        raise NotImplementedError

    def allocate(self, request_id: str, num_tokens: int, shared: Sequence[int] = (),
                 tail: tuple[int, int] | None = None) -> bool:
        raise NotImplementedError

    def free(self, request_id: str) -> int:
        raise NotImplementedError

    def trim(self, request_id: str, num_tokens: int) -> int:
        """Give back the blocks past those that hold the first `num_tokens` tokens (speculative
        positions that were rejected); how many chunks went back."""
        raise NotImplementedError

    def exclusive_blocks(self, request_id: str) -> int:
        """Chunks that freeing this request would return (shared ones stay with their other users)."""
        raise NotImplementedError

    def chunks_holding(self, request_id: str, num_tokens: int) -> list[int]:
        """The request's chunks that hold its first `num_tokens` tokens, in a fixed order (what a
        swap copies out, and where it is copied back once the request has new blocks)."""
        raise NotImplementedError

    def match_prefix(self, request: Request) -> list[int]:
        return []

    def match_tail(self, request: Request, matched: int) -> tuple[int, int] | None:
        """(a cached tail block, its tokens that continue the request's first `matched` blocks) to copy
        instead of computing them; None if there is none (`prefix_cache`, tails)."""
        return None

    def register_full_blocks(self, request: Request) -> None:
        """Index the blocks the request's `num_computed_tokens` has just completed (prefix caching)."""

    def keep_tail(self, request: Request) -> None:
        """A request that finished: its last block, partly filled, stays cached as a tail once the request
        frees it (`prefix_cache`, tails); nothing where blocks are not shared."""

    def holds(self, request_id: str) -> bool:
        raise NotImplementedError

    def max_tokens(self, request_id: str, num_computed: int, upto: int) -> int:
        """The longest sequence (at most `upto` tokens) the request could cover with the chunks it holds
        plus the free ones; it already covers `num_computed`."""
        lo, hi = num_computed, upto
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.blocks_needed(request_id, mid) <= self.num_free_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def capacity_tokens(self, limit: int) -> int:
        """The longest sequence (at most `limit` tokens) one request could hold in the whole pool."""
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.blocks_for_tokens(mid) <= self.num_total_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo


# Layer types whose per-request state is not K/V: a fixed run of slots (`sliding_allocator.StateCacheAllocator`).
STATE_TYPES = ("conv", "mamba")


class RequestDigests:
    """Each request's block digests (`BlockHashes`), computed once for all the allocators of a pool and
    kept until it is freed (a lookup that did not lead to admission keeps them for the next try); tied to
    the request object, so a reused id never reads stale ones."""

    def __init__(self, page_size: int, prefix_key: Callable[[int], bytes] | None = None) -> None:
        """`prefix_key`: what besides the tokens decides a prompt's K/V, by `Request.rope_length` (the model's)."""
        self.page_size = page_size
        self.prefix_key = prefix_key
        self._hashes: dict[str, BlockHashes] = {}

    def of(self, request: Request) -> BlockHashes:
        hashes = self._hashes.get(request.request_id)
        if hashes is None or hashes.tokens is not request:
            key = self.prefix_key(request.rope_length) if self.prefix_key is not None else b""
            if request.lora_request is not None:  # blocks computed under an adapter are that adapter's alone
                key += request.lora_request.cache_key
            if request.cache_salt is not None:  # and under a salt, that salt's
                key += b"salt:" + request.cache_salt.encode()
            hashes = self._hashes[request.request_id] = BlockHashes(self.page_size, request, key)
        return hashes

    def known(self, request_id: str) -> BlockHashes | None:
        return self._hashes.get(request_id)

    def forget(self, request_id: str) -> None:
        self._hashes.pop(request_id, None)


class AttentionTypeAllocator(CacheAllocator):
    """Block tables for the `num_groups` layer groups of one attention type. A block is known by its
    group-0 chunk; the chunks of the other groups are its siblings. `prefix_cache` and `digests`: the
    pool's, shared with the other types' allocators (a new one each where this allocator is alone)."""

    attention_type = ""
    window: int | None = None  # sliding window in tokens; None for full attention

    def __init__(self, pool: CachePool, num_groups: int = 1, block_sharing: bool = False,
                 prefix_cache: PrefixCache | None = None, digests: RequestDigests | None = None) -> None:
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        self.pool = pool
        self.page_size = pool.page_size
        self.num_groups = num_groups
        self.block_sharing = block_sharing
        self.prefix_cache = prefix_cache if prefix_cache is not None else PrefixCache()
        self.digests = digests if digests is not None else RequestDigests(self.page_size)
        self.block_tables: dict[str, list[int]] = {}
        self.ref_counts: dict[int, int] = {}  # held block -> number of requests holding it
        self._siblings: dict[int, list[int]] = {}  # held block -> its chunks in groups 1 .. num_groups - 1

    def table_length(self, num_tokens: int) -> int:
        """Blocks in the table of a request whose sequence has `num_tokens` tokens."""
        return table_length(num_tokens, self.page_size, self.window)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return self.table_length(num_tokens) * self.num_groups

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        held = len(self.block_tables.get(request_id, ()))
        return max(self.table_length(num_tokens) - held, 0) * self.num_groups

    def holds(self, request_id: str) -> bool:
        return request_id in self.block_tables

    @property
    def num_held_chunks(self) -> int:
        """Chunks its requests hold (their tables', and snapshots being filled): O(held blocks)."""
        return sum(1 + len(self._siblings.get(block, ())) for block in self.ref_counts)

    def chunk(self, block: int, group: int) -> int:
        """A held block's chunk in one of this allocator's layer groups."""
        return block if group == 0 else self._siblings[block][group - 1]

    def block_table(self, request_id: str, group: int = 0) -> list[int]:
        """The request's chunks for one of this allocator's layer groups, in table order."""
        table = self.block_tables[request_id]
        return table if group == 0 else [self._siblings[b][group - 1] for b in table]

    def chunks_holding(self, request_id: str, num_tokens: int) -> list[int]:
        if request_id not in self.block_tables:
            return []
        n = self.table_length(num_tokens)
        return [c for g in range(self.num_groups) for c in self.block_table(request_id, g)[:n]]

    def exclusive_blocks(self, request_id: str) -> int:
        return sum(1 for b in self.block_tables.get(request_id, ()) if self.ref_counts[b] == 1) * self.num_groups

    def allocate(self, request_id: str, num_tokens: int, shared: Sequence[int] = (),
                 tail: tuple[int, int] | None = None) -> bool:
        """Grow the request's table to cover `num_tokens` tokens; False (nothing changed) if no room."""
        if shared or tail:
            raise ValueError(f"{type(self).__name__} does not share blocks")
        needed = self.blocks_needed(request_id, num_tokens)
        if needed > self.num_free_blocks:
            return False
        self.block_tables.setdefault(request_id, []).extend(self._take(needed // self.num_groups))
        return True

    def free(self, request_id: str) -> int:
        """Give up every block the request holds; how many chunks it held. A block whose last holder
        this was goes back to the pool (or, with prefix caching, may stay cached)."""
        self.digests.forget(request_id)
        return self._drop(self.block_tables.pop(request_id, []))

    def trim(self, request_id: str, num_tokens: int) -> int:
        table = self.block_tables.get(request_id)
        keep = self.table_length(num_tokens)
        if table is None or len(table) <= keep:
            return 0
        tail = table[keep:]
        del table[keep:]
        return self._drop(tail)

    def _drop(self, blocks: list[int]) -> int:
        """One holder fewer for each block; an unheld one stays cached if it has a digest (or is an
        expected tail), else goes back to the pool with its siblings; chunks given up."""
        returned = []
        given_up = sum(1 + len(self._siblings.get(block, ())) for block in blocks)
        for block in blocks:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                del self.ref_counts[block]
                siblings = self._siblings.pop(block, [])
                if not self.prefix_cache.park(block, siblings):
                    returned += [block, *siblings]
        self.pool.free(returned)
        return given_up

    def _hold(self, block: int) -> None:
        """One holder more for a block that is held or cached (cached -> held, its siblings back here)."""
        if block not in self.ref_counts:
            siblings = self.prefix_cache.reuse(block)
            if siblings:
                self._siblings[block] = siblings
        self.ref_counts[block] = self.ref_counts.get(block, 0) + 1

    def _take(self, n: int) -> list[int]:
        """`n` new blocks (each `num_groups` chunks) held once; the caller has checked there is room. Cached
        blocks are reclaimed (newest first) only for what the uninitialized pool lacks."""
        while self.pool.num_free < n * self.num_groups:
            self.pool.free(self.prefix_cache.evict())
        chunks = self.pool.allocate(n * self.num_groups)
        assert chunks is not None
        blocks = chunks[:n]
        for i, block in enumerate(blocks):
            self.ref_counts[block] = 1
            if self.num_groups > 1:
                self._siblings[block] = chunks[n + i * (self.num_groups - 1):n + (i + 1) * (self.num_groups - 1)]
        return blocks


class FullAttentionCacheAllocator(AttentionTypeAllocator):
    """Blocks for full-attention layers: tables grow with the sequence; blocks can be shared."""

    attention_type = "full_attention"

    def __init__(self, pool: CachePool, block_sharing: bool = False, num_groups: int = 1,
                 prefix_key: Callable[[int], bytes] | None = None, keep_tails: bool = False,
                 prefix_cache: PrefixCache | None = None, digests: RequestDigests | None = None) -> None:
        """`prefix_key`: what besides the tokens decides a prompt's K/V, by `Request.rope_length` (the model's;
        for the digests made here). `keep_tails`: finished requests' last, partly filled blocks stay cached
        as tails (`prefix_cache`; one layer group only)."""
        super().__init__(pool, num_groups, block_sharing, prefix_cache,
                         digests if digests is not None else RequestDigests(pool.page_size, prefix_key))
        if keep_tails and num_groups != 1:
            raise ValueError("tails need a model with full attention only (one layer group)")
        self.keep_tails = block_sharing and keep_tails
        self._num_registered: dict[str, int] = {}  # request -> leading blocks already indexed (or matched)

    # -- prefix matching --------------------------------------------------------------------
    def match_prefix(self, request: Request) -> list[int]:
        """Blocks already holding the longest completed prefix of a request that holds no blocks and
        has nothing computed; changes nothing. At most `(num_tokens - 1) // page_size` blocks, so
        the last token is always computed (its logits are needed)."""
        if not self.block_sharing or request.num_computed_tokens or request.request_id in self.block_tables:
            return []
        hashes = self.digests.of(request)
        matched: list[int] = []
        for i in range((request.num_tokens - 1) // self.page_size):
            block = self.prefix_cache.lookup(hashes.digest(i))
            if block is None:
                break
            matched.append(block)
        return matched

    def match_tail(self, request: Request, matched: int) -> tuple[int, int] | None:
        if not self.keep_tails:
            return None
        hashes = self.digests.of(request)
        start = matched * self.page_size
        rest = request.token_slice(start, min(start + self.page_size - 1, request.num_tokens - 1))
        return self.prefix_cache.match_tail(hashes.digest(matched - 1) if matched else hashes.root, rest)

    def register_full_blocks(self, request: Request) -> None:
        if not self.block_sharing:
            return
        rid = request.request_id
        done = self._num_registered.get(rid, 0)
        full = request.num_computed_tokens // self.page_size
        if full <= done:
            return
        table = self.block_tables[rid]
        hashes = self.digests.of(request)
        for i in range(done, full):
            self.prefix_cache.register(table[i], hashes.digest(i))
        self._num_registered[rid] = full

    # -- allocation -------------------------------------------------------------------------
    def shared_room(self, shared: Sequence[int]) -> int:
        """Chunks free for the rest of a table that starts with `shared`: a matched block that is cached now
        counts as free, but it cannot be reclaimed for the request that matched it."""
        return self.num_free_blocks - sum(self.num_groups for b in shared if self.prefix_cache.is_cached(b))

    def allocate(self, request_id: str, num_tokens: int, shared: Sequence[int] = (),
                 tail: tuple[int, int] | None = None) -> bool:
        """Grow the request's table to cover `num_tokens` tokens; False (nothing changed) if no room.
        `shared` (from `match_prefix`) starts a new table with blocks already computed: each gains a
        holder, and only the rest are taken from the free blocks. `tail` (from `match_tail`): its first
        tokens' K/V are copied into the block after the shared ones (the tail pinned meanwhile)."""
        if tail is not None:
            kept = self.prefix_cache.pin(tail[0])
            try:
                if not self.allocate(request_id, num_tokens, shared):
                    return False
                self.pool.copy_slots(tail[0], self.block_tables[request_id][len(shared)], tail[1])
                return True
            finally:
                self.prefix_cache.park_tail(tail[0], *kept)
        if not shared:
            return super().allocate(request_id, num_tokens)
        held = len(self.block_tables.get(request_id, ()))
        if held:
            raise ValueError(f"shared blocks can only start a table; {request_id!r} already holds {held}")
        needed = max(self.table_length(num_tokens) - len(shared), 0)
        if needed * self.num_groups > self.shared_room(shared):
            return False
        for block in shared:
            self._hold(block)
        self.block_tables[request_id] = [*shared, *self._take(needed)]
        self._num_registered[request_id] = len(shared)
        return True

    def keep_tail(self, request: Request) -> None:
        hashes = self.digests.known(request.request_id)
        if not self.keep_tails or hashes is None or hashes.tokens is not request:
            return
        full, kept = divmod(request.num_computed_tokens, self.page_size)
        table = self.block_tables.get(request.request_id, [])
        if kept and len(table) > full:
            tokens = request.token_slice(full * self.page_size, request.num_computed_tokens)
            self.prefix_cache.expect_tail(table[full], hashes.digest(full - 1) if full else hashes.root, tuple(tokens))

    def free(self, request_id: str) -> int:
        self._num_registered.pop(request_id, None)
        table = self.block_tables.get(request_id, [])
        try:
            return super().free(request_id)
        finally:
            for block in table:  # an expected tail not released here is none (a partial block is never shared)
                self.prefix_cache.forget_expected(block)
