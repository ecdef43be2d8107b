"""Sliding-window and state allocators: a ring of blocks per request (docs/design/sliding-window.md), and
the snapshots that let them take part in prefix caching (docs/design/prefix-caching.md).

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
`N - window + 1 .. N - 1`: a hit can end where the blocks over that range all have cached snapshots
(`resumable`), and its new ring is filled from them (`restore`). So a hit costs a copy of one window,
never a recomputation. State layers keep the whole state where a pass ends on a page boundary
(`StateCacheAllocator`).
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
    per_block_snapshots = True  # a snapshot per block of the window (a state's is its whole run: no page minimum)

    def __init__(self, pool: CachePool, window: int, num_groups: int = 1, block_sharing: bool = False,
                 prefix_cache: PrefixCache | None = None, digests: RequestDigests | None = None) -> None:
        super().__init__(pool, num_groups, block_sharing, prefix_cache, digests)
        if window < 1:
            raise ValueError(f"sliding window must be >= 1 token, got {window}")
        if block_sharing and self.per_block_snapshots and window < self.page_size:
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

    def resumable(self, request: Request, limit: int) -> list[bool]:
        """For each hit of 0 .. `limit` blocks, whether this type could resume after it: the window before
        it (`first_needed`) has a cached snapshot for every block. Changes nothing."""
        hashes = self.digests.of(request)
        ok, run = [True], 0  # run: cached snapshots in a row ending at block i
        for i in range(limit):
            run = run + 1 if self.prefix_cache.lookup(self._tag(hashes.digest(i))) is not None else 0
            ok.append(run >= i + 1 - self.first_needed(i + 1))
        return ok

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
        pending = self._pending.get(request_id, {}).values()
        return super().exclusive_blocks(request_id) + sum(1 + len(self._siblings.get(b, ())) for b in pending)


class StateCacheAllocator(SlidingAttentionCacheAllocator):
    """Blocks for layers whose state is not K/V (LFM2's short convolutions, Mamba-2's mixers: `STATE_TYPES`):
    a run of `window` slots per request holding it, laid out by the layers (`layers.short_conv`,
    `layers.mamba2`); held whole from the first token, never shared.

    With block sharing, a pass that ends on a block boundary leaves the state after those blocks: it is
    copied whole into a snapshot (every chunk of the run, in `chunks_holding`'s order: the first is the
    snapshot's block, the others its siblings), indexed under the last block's digest; a hit must end
    exactly where a snapshot is, and the new run is a copy of it."""

    per_block_snapshots = False

    def __init__(self, pool: CachePool, window: int, num_groups: int = 1, attention_type: str = "conv",
                 block_sharing: bool = False, prefix_cache: PrefixCache | None = None,
                 digests: RequestDigests | None = None) -> None:
        super().__init__(pool, window, num_groups, block_sharing, prefix_cache, digests)
        self.attention_type = attention_type

    def table_length(self, num_tokens: int) -> int:
        """The whole run from the first token: a row's slots are not its position's (a row takes several)."""
        return self.ring_blocks if num_tokens > 0 else 0

    def take_snapshots(self, request: Request, start: int, end: int) -> dict[int, int]:
        """{the pass's last block: a snapshot to copy the run into after the pass} where the pass over
        `[start, end)` ends on a block boundary (and the pool has room); else empty."""
        rid, page = request.request_id, self.page_size
        if not self.block_sharing or end % page or end <= start or end // page <= self._next.get(rid, 0):
            return {}
        self._next[rid] = end // page
        size = self.ring_blocks * self.num_groups
        if self.num_free_blocks - size < int(self.pool.num_usable * SNAPSHOT_RESERVE):
            return {}
        blocks = self._take(self.ring_blocks)
        chunks = [self.chunk(b, g) for g in range(self.num_groups) for b in blocks]
        for block in blocks:  # one block of the whole run: the first, the others its siblings
            self._siblings.pop(block, None)
            del self.ref_counts[block]
        self.ref_counts[chunks[0]], self._siblings[chunks[0]] = 1, chunks[1:]
        self._pending.setdefault(rid, {})[end // page - 1] = chunks[0]
        return {end // page - 1: chunks[0]}

    def snapshot_chunks(self, snapshot: int) -> list[int]:
        """A held snapshot's chunks, in the order of a run's (`chunks_holding`)."""
        return [snapshot, *self._siblings.get(snapshot, ())]

    def resumable(self, request: Request, limit: int) -> list[bool]:
        """For each hit of 0 .. `limit` blocks: whether a snapshot of the state after it is cached."""
        hashes = self.digests.of(request)
        return [True] + [self.prefix_cache.lookup(self._tag(hashes.digest(i))) is not None for i in range(limit)]

    def snapshots_for(self, request: Request, hit_blocks: int) -> list[int]:
        """The cached snapshot of the state after the hit's last block."""
        block = self.prefix_cache.lookup(self._tag(self.digests.of(request).digest(hit_blocks - 1)))
        assert block is not None, "a snapshot went missing between match and allocation"
        return [block]

    def restore(self, request_id: str, hit_blocks: int, snapshots: Sequence[int]) -> None:
        """Copy the pinned snapshot of the state after `hit_blocks` blocks into the request's new run."""
        src = self.snapshot_chunks(snapshots[0])
        dst = self.chunks_holding(request_id, 1)
        self.pool.copy_slot_list(*chunk_slots(src, dst, self.page_size))
        self._next[request_id] = hit_blocks


def chunk_slots(src: Sequence[int], dst: Sequence[int], page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every slot of chunks `src`, and of `dst` in the same order: a whole-chunk copy's slot lists."""
    offsets = torch.arange(page_size)
    return ((torch.tensor(src)[:, None] * page_size + offsets).flatten(),
            (torch.tensor(dst)[:, None] * page_size + offsets).flatten())
