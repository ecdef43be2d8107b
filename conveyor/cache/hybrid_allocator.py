"""The allocators of a model's attention types over one pool, seen as one (`HybridCacheAllocator`), and
`build_allocators`, which makes them from the model's layer groups (docs/design/kv-cache.md).

With block sharing, the types share one `PrefixCache` (so eviction is one order over every cached block,
whatever its type) and one `RequestDigests`; a prefix hit is the longest that every type can resume:
full attention's cached blocks, for a sliding window the snapshots of the window before the hit, for
state layers a snapshot of the state right after it (`sliding_allocator`). A model without full
attention shares this way too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..request import Request
from .allocator import (STATE_TYPES, AttentionTypeAllocator, CacheAllocator, FullAttentionCacheAllocator,
                        RequestDigests)
from .pool import CachePool
from .prefix_cache import PrefixCache
from .sliding_allocator import SlidingAttentionCacheAllocator, StateCacheAllocator

# With state layers, prefill passes end on multiples of this many tokens (rounded down to pages), where their
# state is kept: a prompt that shares only its beginning with an earlier one (a system prompt) resumes there.
STATE_INTERVAL = 512


class HybridCacheAllocator(CacheAllocator):
    """Several attention types' allocators over one pool, seen as one: admission is all or nothing
    across them, and counts are the sums (every count is in chunks of the shared pool)."""

    def __init__(self, allocators: Sequence[AttentionTypeAllocator]) -> None:
        pools = {id(a.pool) for a in allocators}
        if len(pools) != 1:
            raise ValueError("a hybrid allocator needs allocators over one pool")
        self.block_sharing = all(a.block_sharing for a in allocators)
        if self.block_sharing != any(a.block_sharing for a in allocators) or (self.block_sharing and (
                len({id(a.prefix_cache) for a in allocators}) != 1 or len({id(a.digests) for a in allocators}) != 1)):
            raise ValueError("block sharing needs every allocator to share, over one prefix cache and one digest set")
        self.allocators = list(allocators)
        self.pool = allocators[0].pool
        self.page_size = self.pool.page_size
        self.prefix_cache = allocators[0].prefix_cache
        self.full = next((a for a in allocators if isinstance(a, FullAttentionCacheAllocator)), None)
        # The types whose rings a hit must fill from snapshots: sliding windows and state layers.
        self.rings = [a for a in allocators if isinstance(a, SlidingAttentionCacheAllocator)]
        # Full attention allocates first: its matched blocks are held before another type's allocation could
        # reclaim them from the cache.
        self._order = sorted(self.allocators, key=lambda a: a is not self.full)
        # request -> the hit `match_prefix` found (in blocks) and each ring's snapshots for it, for `allocate`
        self._hits: dict[str, tuple[int, list[list[int]]]] = {}
        states = self.block_sharing and any(isinstance(a, StateCacheAllocator) for a in allocators)
        self.state_interval = max(self.page_size, STATE_INTERVAL // self.page_size * self.page_size) if states else 0

    def chunk_end(self, start: int, end: int) -> int:
        """With state layers, a chunk stops at the next multiple of `state_interval` (a state kept there)."""
        return min(end, (start // self.state_interval + 1) * self.state_interval) if self.state_interval else end

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return sum(a.blocks_for_tokens(num_tokens) for a in self.allocators)

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        return sum(a.blocks_needed(request_id, num_tokens) for a in self.allocators)

    def match_prefix(self, request: Request) -> Sequence[int]:
        """The longest prefix every type resumes from its cache: the full-attention blocks (their number is
        the hit in pages), or, for a model without full attention, the hit's page indices."""
        if not self.block_sharing or request.num_computed_tokens or self.holds(request.request_id):
            return []
        full = self.full.match_prefix(request) if self.full is not None else None
        limit = len(full) if full is not None else (request.num_tokens - 1) // self.page_size
        checks = [ring.resumable(request, limit) for ring in self.rings]
        hit = max(n for n in range(limit + 1) if all(check[n] for check in checks))
        if hit:
            self._hits[request.request_id] = (hit, [ring.snapshots_for(request, hit) for ring in self.rings])
        return full[:hit] if full is not None else range(hit)

    def allocate(self, request_id: str, num_tokens: int, shared: Sequence[int] = (),
                 tail: tuple[int, int] | None = None) -> bool:
        """As one allocator's; `shared` (from `match_prefix`): the full-attention blocks are shared and each
        new ring is filled from its snapshots (pinned meanwhile)."""
        if tail:
            raise ValueError("hybrid models keep no tails")
        hit, snapshots = self._hits.pop(request_id, (0, [])) if shared else (0, [])
        if len(shared) != hit:
            raise ValueError(f"shared blocks must come from match_prefix for {request_id!r}")
        for ring, blocks in zip(self.rings, snapshots):
            ring.pin(blocks)
        try:
            needed = self.blocks_needed(request_id, num_tokens)
            room = self.num_free_blocks
            if hit and self.full is not None:
                needed -= hit * self.full.num_groups
                room = self.full.shared_room(shared)
            if needed > room:
                return False
            for a in self._order:
                assert a.allocate(request_id, num_tokens, shared if a is self.full and hit else ())
            for ring, blocks in zip(self.rings, snapshots):
                ring.restore(request_id, hit, blocks)
            return True
        finally:
            for ring, blocks in zip(self.rings, snapshots):
                ring.unpin(blocks)

    def register_full_blocks(self, request: Request) -> None:
        for a in self.allocators:
            a.register_full_blocks(request)

    def free(self, request_id: str) -> int:
        self._hits.pop(request_id, None)
        return sum(a.free(request_id) for a in self.allocators)

    def trim(self, request_id: str, num_tokens: int) -> int:
        return sum(a.trim(request_id, num_tokens) for a in self.allocators)

    def exclusive_blocks(self, request_id: str) -> int:
        return sum(a.exclusive_blocks(request_id) for a in self.allocators)

    def chunks_holding(self, request_id: str, num_tokens: int) -> list[int]:
        return [c for a in self.allocators for c in a.chunks_holding(request_id, num_tokens)]

    def holds(self, request_id: str) -> bool:
        return self.allocators[0].holds(request_id)


LayerGroup = tuple[AttentionTypeAllocator, int, list[int]]  # (its allocator, index within it, layers)


def build_allocators(pool: CachePool, groups: Sequence[tuple[str, list[int]]], windows: dict[str, int],
                     block_sharing: bool, prefix_key: Callable[[int], bytes] | None = None,
                     keep_tails: bool = False) -> tuple[CacheAllocator, list[LayerGroup]]:
    """One allocator per attention type over `pool` for the model's layer `groups` (see
    `cache_pool.layer_groups`): the allocator the scheduler sees (the only one, or a
    `HybridCacheAllocator` over all; always where a sliding or state type shares), and per group its allocator
    and index within it. `windows`: the ring of every type but full attention, in slots
    (`CausalLM.cache_windows`). `prefix_key` and `keep_tails` as `FullAttentionCacheAllocator` takes them
    (tails: full attention alone)."""
    types = list(dict.fromkeys(t for t, _ in groups))
    cache, digests = PrefixCache(), RequestDigests(pool.page_size, prefix_key)
    allocators: dict[str, AttentionTypeAllocator] = {}
    for attention_type in types:
        k = sum(t == attention_type for t, _ in groups)
        if attention_type == "full_attention":
            allocators[attention_type] = FullAttentionCacheAllocator(
                pool, block_sharing, num_groups=k, keep_tails=keep_tails and types == [attention_type],
                prefix_cache=cache, digests=digests)
        else:
            assert attention_type in windows, f"{attention_type} layers need their ring's size"
            allocators[attention_type] = (
                StateCacheAllocator(pool, windows[attention_type], k, attention_type, block_sharing, cache,
                                    digests)
                if attention_type in STATE_TYPES else
                SlidingAttentionCacheAllocator(pool, windows[attention_type], k, block_sharing, cache, digests))
    out: list[LayerGroup] = []
    for attention_type, layers in groups:
        allocator = allocators[attention_type]
        out.append((allocator, sum(a is allocator for a, _, _ in out), layers))
    single = types == ["full_attention"] or (len(types) == 1 and not block_sharing)
    return (allocators[types[0]] if single else HybridCacheAllocator(list(allocators.values()))), out
