"""Offloading (docs/design/offloading.md): which active requests give up their cache when others stall, and
the host swap pool that keeps the KV blocks of those that fit.

Demand-driven: the scheduler reports stalled requests and the blocks each asked for; we pick the
fewest victims that free that many blocks, newest first (so older requests, already scheduled,
keep their cache), never a request in the batch about to run, and never the last active request.

A victim takes one of two paths (the engine decides, `Engine._offload`):

- swap, when `cpu_offload_space` > 0 and its blocks fit in the free slots of the `SwapPool`: every
  block holding its computed tokens (shared prefix blocks included, so it can resume on its own)
  is copied to host memory, all such victims of one step in one batched copy per layer; its device
  blocks are freed and it waits at the head of the queue in the SWAPPED state with its
  `num_computed_tokens` kept. When it is admitted again its new blocks are filled back from the
  swap slots (batched too) and it resumes without recomputing anything.
- soft reset, otherwise: its blocks are freed and it goes back to the head of the waiting queue
  with `num_computed_tokens = 0`, so its prompt plus the tokens it already generated are
  prefilled again when room returns.

What the user receives is unchanged either way.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from ..request import Request
from .allocator import CacheAllocator
from .kv_format import as_bytes
from .pool import CachePool
from .transfer import to_device


def choose_victims(active: list[Request], scheduled: set[str], stalled: list[tuple[Request, int]],
                   allocator: CacheAllocator) -> list[Request]:
    """Newest-first victims until the stalled requests that remain have the blocks they asked for."""
    need = {r.request_id: n for r, n in stalled}
    victims: list[Request] = []
    freed = 0
    for request in reversed(active):
        if freed >= sum(need.values()) or len(active) - len(victims) <= 1:
            break
        if request.request_id in scheduled:
            continue
        victims.append(request)
        freed += allocator.exclusive_blocks(request.request_id)
        need.pop(request.request_id, None)
    return victims


@dataclass
class _PendingCopy:
    """A swap-out's data in host staging buffers (one per layer), bound for `slots` once `event` fired."""

    event: torch.cuda.Event | None  # None: already complete (CPU)
    slots: torch.Tensor
    staged: list[torch.Tensor]

    def ready(self) -> bool:
        return self.event is None or self.event.query()


class SwapPool:
    """Host memory for swapped-out chunks: `num_slots` slots, each one pool chunk (a page in every
    layer of a layer group, K and V; a whole block for models with one attention type), laid out like
    the device pool, one tensor per layer of a group `[2, num_slots, page_size, kv_heads, head_dim]`.
    Pinned when the device is CUDA (fast, DMA-able copies); plain memory on CPU. Tracks which slots
    each swapped request holds, in the order of `CacheAllocator.chunks_holding`."""

    def __init__(self, num_slots: int, pool: CachePool) -> None:
        if num_slots < 1:
            raise ValueError(f"a swap pool needs at least one slot, got {num_slots}")
        self.pool = pool
        self.num_slots = num_slots
        first = pool.kv[0]
        self.device = first.device
        pin = first.device.type == "cuda"
        self.kv = [torch.empty(2, num_slots, pool.page_size, *layer.shape[2:], dtype=as_bytes(layer).dtype,
                               device="cpu", pin_memory=pin) for layer in pool.kv]  # fp8 pages as their bytes
        self._free: deque[int] = deque(range(num_slots))
        self.slots: dict[str, list[int]] = {}  # swapped request -> its slots, in `chunks_holding` order
        self._pending: deque[_PendingCopy] = deque()  # swap-outs not yet scattered into their slots

    @staticmethod
    def num_slots_for(space_gib: float, bytes_per_block: int) -> int:
        return int(space_gib * 2**30) // bytes_per_block

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def holds(self, request_id: str) -> bool:
        return request_id in self.slots

    def _device_view(self, layer: int) -> torch.Tensor:
        kv = as_bytes(self.pool.kv[layer])
        return kv.view(2, self.pool.num_chunks, self.pool.page_size, *kv.shape[2:])

    def swap_out(self, entries: list[tuple[str, list[int]]]) -> None:
        """Copy each request's device blocks into newly taken slots: one gather and one copy per layer
        for all of them. The caller has checked that they fit (`num_free`) and frees the device blocks
        (safe at once: later writes to them are queued after the gather on the same stream). On CUDA the
        copy lands in pinned staging buffers without waiting; they are scattered into the slots once
        their event has fired (`_settle`), at the latest before the swap pool is next read."""
        blocks = [b for _, bs in entries for b in bs]
        if not blocks:
            return
        assert len(blocks) <= len(self._free), "swap pool overflow"
        slots = [self._free.popleft() for _ in blocks]
        start = 0
        for rid, bs in entries:
            assert rid not in self.slots, f"request {rid!r} is already swapped out"
            self.slots[rid] = slots[start:start + len(bs)]
            start += len(bs)
        src = to_device(blocks, torch.long, self.device)
        staged = []
        for layer in range(len(self.kv)):
            gathered = self._device_view(layer).index_select(1, src)  # on the device
            staged.append(gathered.to("cpu", non_blocking=True) if self.device.type == "cuda" else gathered)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self._pending.append(_PendingCopy(event, torch.tensor(slots), staged))
        self._settle(wait=False)

    def _settle(self, wait: bool) -> None:
        """Scatter finished swap-out copies into their slots, oldest first (a slot released and taken
        again is written in order); with `wait`, wait for all of them."""
        while self._pending and (wait or self._pending[0].ready()):
            done = self._pending.popleft()
            if done.event is not None:
                done.event.synchronize()
            for host, staging in zip(self.kv, done.staged):
                host.index_copy_(1, done.slots, staging)

    def swap_in(self, entries: list[tuple[str, list[int]]]) -> None:
        """Copy each request's slots back into the given device chunks (its new blocks' `chunks_holding`),
        batched like `swap_out`, and free the slots. The gathered slots go through pinned buffers that
        PyTorch keeps until their non-blocking copy has run, so the slots can be taken again at once."""
        blocks: list[int] = []
        slots: list[int] = []
        for rid, bs in entries:
            held = self.slots.pop(rid)
            assert len(bs) == len(held), f"request {rid!r}: {len(held)} slots swapped, {len(bs)} blocks given"
            blocks += bs
            slots += held
        if not blocks:
            return
        self._settle(wait=True)
        src = torch.tensor(slots)
        dst = to_device(blocks, torch.long, self.device)
        pin = self.device.type == "cuda"
        for layer, host in enumerate(self.kv):
            staging = torch.empty(2, len(slots), *host.shape[2:], dtype=host.dtype, pin_memory=pin)
            torch.index_select(host, 1, src, out=staging)
            self._device_view(layer).index_copy_(1, dst, staging.to(self.device, non_blocking=True))
        self._free.extend(slots)

    def release(self, request_id: str) -> int:
        """Drop a swapped request's slots without copying (it was cancelled or failed); how many."""
        held = self.slots.pop(request_id, [])
        self._free.extend(held)
        return len(held)
