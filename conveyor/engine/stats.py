"""`EngineStats`: the engine's counters and gauges as one snapshot, for `stats()`, the server's metrics and
the dashboard (one module, so the engine loop stays about the loop)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..cache.allocator import CacheAllocator
    from ..cache.offload import SwapPool
    from ..sched.scheduler import Scheduler
    from ..speculative import Speculator
    from .graph_runner import CudaGraphs


@dataclass
class EngineStats:
    """A snapshot of the engine's counters (cumulative) and gauges (now); the server's metrics read it."""

    prompt_tokens: int = 0  # prompt tokens of every request admitted
    generation_tokens: int = 0  # tokens sampled
    prefill_tokens: int = 0  # tokens actually run through prefill (recomputation after a reset included)
    prefix_cache_query_tokens: int = 0  # tokens of admitted requests looked up in the prefix cache
    prefix_cache_hit_tokens: int = 0  # of those, tokens found cached (their prefill was skipped)
    offloads: int = 0  # requests offloaded, either path
    swap_outs: int = 0  # of those, requests whose blocks were swapped to host memory
    swap_ins: int = 0  # swapped requests whose blocks were copied back (resumed without recomputation)
    soft_resets: int = 0  # offloaded requests that took the soft-reset path
    finished_requests: int = 0
    free_blocks: int = 0  # uninitialized plus cached (reclaimable) blocks
    total_blocks: int = 0
    running_requests: int = 0
    waiting_requests: int = 0
    swapped_requests: int = 0  # waiting requests whose blocks are in the swap pool
    swap_free_blocks: int = 0
    swap_total_blocks: int = 0
    # Speculative decoding (vLLM's counters): verification passes with proposals, tokens proposed,
    # tokens accepted, and accepted per proposal position.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    cuda_graph_captures: int = 0  # decode shapes captured as CUDA graphs
    cuda_graph_replays: int = 0  # steps run by replaying a graph
    cuda_graph_eager_steps: int = 0  # steps with graphs on that ran eagerly (prefill chunks, over the largest bucket)

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.free_blocks / self.total_blocks if self.total_blocks else 0.0


def snapshot(counters: EngineStats, allocator: CacheAllocator, scheduler: Scheduler, swap: SwapPool | None,
             speculator: Speculator | None, graphs: CudaGraphs | None) -> EngineStats:
    """`counters` so far plus the cache and queue gauges now (safe to read from another thread)."""
    stats = EngineStats(**vars(counters))
    stats.free_blocks = allocator.num_free_blocks
    stats.total_blocks = allocator.num_total_blocks
    stats.running_requests = len(scheduler.active)
    stats.waiting_requests = len(scheduler.waiting)
    if swap is not None:
        stats.swapped_requests = len(swap.slots)
        stats.swap_free_blocks = swap.num_free
        stats.swap_total_blocks = swap.num_slots
    if speculator is not None:
        stats.spec_decode_num_drafts = speculator.num_drafts
        stats.spec_decode_num_draft_tokens = speculator.num_draft_tokens
        stats.spec_decode_num_accepted_tokens = speculator.num_accepted_tokens
        stats.spec_decode_num_accepted_tokens_per_pos = list(speculator.accepted_per_pos)
    if graphs is not None:
        stats.cuda_graph_captures, stats.cuda_graph_replays = graphs.captures, graphs.replays
        stats.cuda_graph_eager_steps = graphs.eager_steps
    return stats
