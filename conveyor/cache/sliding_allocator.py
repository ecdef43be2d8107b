"""Sliding-window and state allocators: a ring of blocks per request (docs/design/sliding-window.md), and
the window's snapshots that let sliding layers take part in prefix caching (docs/design/prefix-caching.md).

- `SlidingAttentionCacheAllocator`: a request holds at most `ceil(window / page_size)` blocks, used as a
  ring: position `p` lives at ring index `p % window`, so the last `window` tokens are always there and
  the request's blocks never grow with its length.
- `StateCacheAllocator`: a fixed run of slots per request for layers whose state is not K/V.

A ring is overwritten as the sequence moves on, so it cannot be shared. With block sharing on, each
block of a sequence that completes gets a *snapshot*: a block of this type (a chunk per layer group)
holding its positions' K/V, indexed under the block's digest (tagged with the attention type) once its
tokens are known, and cached like any completed block. The step that completes a block fills its
snapshot: positions the step writes outside the ring's final window go straight to the snapshot, the
others are copied from the ring before the pass (positions it will overwrite) or after it
(`take_snapshots`, `model_runner`). A request whose prefix hit ends at token `N` needs positions
`N - window + 1 .. N - 1`: the hit is the longest prefix whose blocks over that range all have cached
snapshots (`match_window`), and its new ring is filled from them (`restore`). So a hit costs a copy of
one window, never a recomputation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..request import Request
from .allocator import AttentionTypeAllocator, RequestDigests, table_length
from .pool import CachePool
from .prefix_cache import PrefixCache

# Snapshots are taken only while at least this share of the pool stays free for the requests themselves
# (with async batching a step's snapshots stay held until the step after it is scheduled).
SNAPSHOT_RESERVE = 0.125


class SlidingAttentionCacheAllocator(AttentionTypeAllocator):
    """Blocks for sliding-window layers: a ring of at most `ceil(window / page_size)` blocks per request.

    Position `p` is stored at ring index `p % window` (block `(p % window) // page_size`), so writing
    a token overwrites the one that just left the window. Rings are never shared; with block sharing,
    completed blocks are kept as snapshots (see the module's docstring)."""

    attention_type = "sliding_attention"

    def __init__(self, pool: CachePool, window: int, num_groups: int = 1, block_sharing: bool = False,
                 prefix_cache: PrefixCache | None = None, digests: RequestDigests | None = None) -> None:
        super().__init__(pool, num_groups, block_sharing, prefix_cache, digests)
        if window < 1:
            raise ValueError(f"sliding window must be >= 1 token, got {window}")
        if block_sharing and window < self.page_size:
            raise ValueError(f"sliding-window snapshots need a window of at least a page ({self.page_size} tokens), "
                             f"got {window}")
        self.window = window
        self.ring_blocks = table_length(window, self.page_size, window)
        self._pending: dict[str, dict[int, int]] = {}  # request -> {block index: its snapshot, not indexed yet}
        self._next: dict[str, int] = {}  # request -> the first block index not yet snapshotted (nor matched)

    def _tag(self, digest: bytes) -> bytes:
        return digest + b"/" + self.attention_type.encode()

    # -- snapshots ----------------------------------------------------------------------------
    def take_snapshots(self, request: Request, start: int, end: int) -> dict[int, int]:
        """Snapshot blocks for the request's blocks that the pass over positions `[start, end)` completes
        ({block index: snapshot}), held until `register_full_blocks` indexes them; fewer, or none, where
        the pool is short (those blocks are then never matched). Empty without block sharing."""
        if not self.block_sharing:
            return {}
        rid, page = request.request_id, self.page_size
        first, last = max(self._next.get(rid, 0), start // page), end // page
        if last <= first:
            return {}
        self._next[rid] = last
        reserve = int(self.pool.num_usable * SNAPSHOT_RESERVE)
        count = min(last - first, max(0, (self.num_free_blocks - reserve) // self.num_groups))
        taken = dict(zip(range(first, first + count), self._take(count))) if count > 0 else {}
        if taken:
            self._pending.setdefault(rid, {}).update(taken)
        return taken

    def register_full_blocks(self, request: Request) -> None:
        """Index the request's snapshots of blocks whose tokens are all known now; a digest already indexed
        (another request computed the same prefix) keeps its block, and this snapshot goes back."""
        pending = self._pending.get(request.request_id)
        if not pending:
            return
        full = request.num_computed_tokens // self.page_size
        ready = sorted(i for i in pending if i < full)
        if not ready:
            return
        hashes = self.digests.of(request)
        for i in ready:
            block = pending.pop(i)
            self.prefix_cache.register(block, self._tag(hashes.digest(i)))
            self._drop([block])

    def match_window(self, request: Request, limit: int) -> int:
        """The longest hit of at most `limit` blocks whose window (`first_needed`) has a cached snapshot
        for every block; changes nothing."""
        if limit <= 0:
            return 0
        hashes = self.digests.of(request)
        run = 0  # cached snapshots in a row ending at block i
        best = 0
        for i in range(limit):
            run = run + 1 if self.prefix_cache.lookup(self._tag(hashes.digest(i))) is not None else 0
            if run >= i + 1 - self.first_needed(i + 1):
                best = i + 1
        return best

    def first_needed(self, hit_blocks: int) -> int:
        """The first block whose positions a request resuming after `hit_blocks` blocks still reads."""
        return max(0, hit_blocks * self.page_size - self.window + 1) // self.page_size

    def snapshots_for(self, request: Request, hit_blocks: int) -> list[int]:
        """The cached snapshots of the blocks a hit of `hit_blocks` blocks reads, in block order."""
        hashes = self.digests.of(request)
        found = [self.prefix_cache.lookup(self._tag(hashes.digest(i)))
                 for i in range(self.first_needed(hit_blocks), hit_blocks)]
        assert all(b is not None for b in found), "a snapshot went missing between match and allocation"
        return found  # type: ignore[return-value]

    def pin(self, snapshots: Sequence[int]) -> None:
        """Hold snapshots while they are read (no allocation can evict them); `unpin` gives them back."""
        for block in snapshots:
            self._hold(block)

    def unpin(self, snapshots: Sequence[int]) -> None:
        self._drop(list(snapshots))

    def restore(self, request_id: str, hit_blocks: int, snapshots: Sequence[int]) -> None:
        """Fill a new ring (the request holds it) with the window before its hit from pinned `snapshots`."""
        page, end = self.page_size, hit_blocks * self.page_size
        pos = torch.arange(max(0, end - self.window + 1), end)
        index = pos // page - self.first_needed(hit_blocks)
        ring = pos % self.window
        src, dst = [], []
        for g in range(self.num_groups):
            chunks = torch.tensor([self.chunk(b, g) for b in snapshots])
            table = torch.tensor(self.block_table(request_id, g))
            src.append(chunks[index] * page + pos % page)
            dst.append(table[ring // page] * page + ring % page)
        self.pool.copy_slot_list(torch.cat(src), torch.cat(dst))
        self._next[request_id] = hit_blocks

    def free(self, request_id: str) -> int:
        self._next.pop(request_id, None)
        pending = list(self._pending.pop(request_id, {}).values())
        return super().free(request_id) + self._drop(pending)

    def exclusive_blocks(self, request_id: str) -> int:
        return super().exclusive_blocks(request_id) + len(self._pending.get(request_id, ())) * self.num_groups


class StateCacheAllocator(SlidingAttentionCacheAllocator):
    """Blocks for layers whose state is not K/V (LFM2's short convolutions, Mamba-2's mixers: `STATE_TYPES`):
    a run of `window` slots per request holding it, laid out by the layers (`layers.short_conv`,
    `layers.mamba2`); held whole from the first token, never shared."""

    def __init__(self, pool: CachePool, window: int, num_groups: int = 1, attention_type: str = "conv") -> None:
        super().__init__(pool, window, num_groups)
        self.attention_type = attention_type

    def table_length(self, num_tokens: int) -> int:
        """The whole run from the first token: a row's slots are not its position's (a row takes several)."""
        return self.ring_blocks if num_tokens > 0 else 0
