"""How much memory one full-size pass needs besides the KV pool, reserved before the pool is sized.

On CUDA it is measured: after the model is loaded, one profiling pass of `max_batch_tokens` tokens
(split over up to `max_requests_per_batch` requests, each sampling one row, so the LM head and the
sampler run at their largest batch too) runs through the real `ModelRunner` over a scratch pool
just big enough for it, and the peak of `torch.cuda.max_memory_allocated` above what was
allocated before the pass is the working memory. The scratch pool is freed and the allocator's
cache emptied before `torch.cuda.mem_get_info` is read for the pool (`cache_pool.plan_num_chunks`).
Elsewhere the estimate `cache_pool.working_memory_bytes` is used, as before: the CPU has no peak
counter, and its pool is sized from available system memory.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..cache.allocator import table_length
from ..cache.hybrid_allocator import build_allocators
from ..cache.pool import NUM_RESERVED_CHUNKS, CachePool, layer_groups, working_memory_bytes
from ..request import Request
from ..sampling_params import SamplingParams
from ..sched.output import ScheduledChunk

logger = logging.getLogger("conveyor")


def profile_split(max_batch_tokens: int, max_requests: int) -> list[int]:
    """Token counts of the profiling pass's requests: `max_batch_tokens` in all, over as many requests
    as a pass may hold (at most `max_requests`, at least one token each), as evenly as possible."""
    n = max(1, min(max_requests, max_batch_tokens))
    base, extra = divmod(max_batch_tokens, n)
    return [base + (i < extra) for i in range(n)]


@torch.inference_mode()
def run_profile_pass(model: Any, config: Any, device: torch.device, dtype: torch.dtype) -> None:
    """One forward pass of `max_batch_tokens` tokens plus sampling, over a scratch pool; leaves nothing behind."""
    from ..layers.attention import make_attention_backend
    from .model_runner import ModelRunner

    groups = layer_groups(model.layer_types)
    lengths = profile_split(config.max_batch_tokens, config.max_requests_per_batch)
    pool = CachePool(scratch_chunks(model, config), config.page_size, len(groups[0][1]), model.num_kv_heads,
                     model.head_dim, dtype, device)
    allocator, runner_groups = build_allocators(pool, groups, model.cache_windows, block_sharing=False)
    attention = make_attention_backend(device, dtype, config.attention_backend)  # the backend the engine runs
    runner = ModelRunner(model, pool, runner_groups, device, max_logit_rows=config.max_requests_per_batch,
                         attention=attention)
    vocab = model.config.vocab_size
    chunks = []
    for i, n in enumerate(lengths):
        request = Request(f"memory-profile-{i}", [(i + t) % vocab for t in range(n)],
                          SamplingParams(max_new_tokens=1, temperature=0.0))
        if not allocator.allocate(request.request_id, n):
            raise RuntimeError("the profiling pool is too small for its own batch")  # sized above: a bug if hit
        chunks.append(ScheduledChunk(request, n))
    try:
        runner.execute(chunks)
    finally:
        for chunk in chunks:
            allocator.free(chunk.request.request_id)


def measured_working_memory(model: Any, config: Any, device: torch.device, dtype: torch.dtype) -> int:
    """Peak bytes the profiling pass allocated on the CUDA device beyond what was held before it
    (weights), the scratch pool excluded; the caching allocator is emptied afterwards."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run_profile_pass(model, config, device, dtype)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    groups = layer_groups(model.layer_types)
    scratch = scratch_chunks(model, config) * CachePool.bytes_per_chunk(
        config.page_size, len(groups[0][1]), model.num_kv_heads, model.head_dim, dtype)
    return max(peak - before - scratch, 0)


def scratch_chunks(model: Any, config: Any) -> int:
    """Chunks of the profiling pass's scratch pool: its requests' blocks plus the reserved ones."""
    groups, windows = layer_groups(model.layer_types), model.cache_windows
    return NUM_RESERVED_CHUNKS + sum(
        table_length(n, config.page_size, windows.get(t))
        for n in profile_split(config.max_batch_tokens, config.max_requests_per_batch) for t, _ in groups)


def working_memory(model: Any, config: Any, device: torch.device, dtype: torch.dtype, dense_scores: bool = True) -> int:
    """Bytes to keep free for one full-size pass: measured on CUDA when the pool is sized from free
    memory (`num_blocks` None), the estimate otherwise (`dense_scores`: the attention backend's; and for an
    encoder, whose passes the profiling pass, which samples, does not stand for)."""
    if device.type != "cuda" or config.num_blocks is not None or getattr(model, "encoder_only", False):
        return working_memory_bytes(model, config, dtype, dense_scores)
    measured = measured_working_memory(model, config, device, dtype)
    logger.info("profiling pass of %d tokens: %.0f MiB working memory (estimate %.0f MiB)", config.max_batch_tokens,
                measured / 2**20, working_memory_bytes(model, config, dtype, dense_scores) / 2**20)
    return measured
