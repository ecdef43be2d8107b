"""Where a step fills the snapshots of the rings it moves on (`cache/sliding_allocator.py`,
docs/design/prefix-caching.md). A sliding window's, for each block the pass completes: a position the pass
writes outside the ring's final window is written straight to the snapshot; one still in the ring after
the pass is copied from it after the pass; one written by an earlier step that this pass overwrites is
copied before it. State layers', where a pass ends on a block boundary: the whole run after the pass."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..cache.allocator import AttentionTypeAllocator
from ..cache.pool import CachePool
from ..cache.sliding_allocator import SlidingAttentionCacheAllocator, StateCacheAllocator, chunk_slots
from ..sched.output import ScheduledChunk


def take_snapshots(allocators: list[AttentionTypeAllocator], chunks: list[ScheduledChunk],
                   copies: SnapshotCopies) -> dict[AttentionTypeAllocator, dict[str, dict[int, int]]]:
    """Per sliding allocator that shares blocks (each once, however many layer groups it serves), the
    snapshots each request's pass completes: {allocator: {request id: {block index: snapshot}}}, for the
    groups' metadata to plan. State layers' snapshots are planned into `copies` here."""
    out: dict[AttentionTypeAllocator, dict[str, dict[int, int]]] = {}
    for allocator in dict.fromkeys(allocators):
        if isinstance(allocator, SlidingAttentionCacheAllocator) and allocator.block_sharing:
            taken = {c.request.request_id: allocator.take_snapshots(
                c.request, c.request.num_computed_tokens, c.request.num_computed_tokens + c.num_tokens) for c in chunks}
            taken = {rid: t for rid, t in taken.items() if t}
            if isinstance(allocator, StateCacheAllocator):
                for rid, t in taken.items():
                    copies.after.append(chunk_slots(allocator.chunks_holding(rid, 1),
                                                    allocator.snapshot_chunks(*t.values()), allocator.page_size))
            else:
                out[allocator] = taken
    return out


@dataclass
class SnapshotCopies:
    """A step's slot copies into snapshots: `before` the pass (ring slots it overwrites) and `after` it."""

    before: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    after: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def add(self, allocator: AttentionTypeAllocator, group: int, request_id: str, start: int, end: int,
            taken: dict[int, int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Plan the snapshots `taken` ({block index: snapshot}) of one request's pass over `[start, end)` in
        one layer group; the direct writes (positions, snapshot slots), None if there are none."""
        page, window = allocator.page_size, allocator.window
        assert window is not None
        blocks = torch.tensor(list(taken))
        offsets = torch.arange(page)
        pos = (blocks[:, None] * page + offsets).flatten()
        chunks = torch.tensor([allocator.chunk(b, group) for b in taken.values()])
        snap = (chunks[:, None] * page + offsets).flatten()
        ring = pos % window
        table = torch.tensor(allocator.block_table(request_id, group))
        ring_slot = table[ring // page] * page + ring % page
        after = pos >= end - window  # in the ring once the pass is done
        before = (pos < start) & ~after
        if after.any():
            self.after.append((ring_slot[after], snap[after]))
        if before.any():
            self.before.append((ring_slot[before], snap[before]))
        direct = ~before & ~after
        return (pos[direct], snap[direct]) if direct.any() else None

    def run(self, pool: CachePool, before: bool) -> None:
        pairs = self.before if before else self.after
        if pairs:
            pool.copy_slot_list(torch.cat([s for s, _ in pairs]), torch.cat([d for _, d in pairs]))
