"""Scheduling speculating decodes: proposals count in the token budget and get their blocks."""

from __future__ import annotations

import torch

from conveyor.cache.allocator import FullAttentionCacheAllocator
from conveyor.cache.pool import CachePool
from conveyor.config import ContinuousBatchingConfig
from conveyor.request import Request, RequestState
from conveyor.sampling_params import SamplingParams
from conveyor.sched.scheduler import FIFOScheduler
from conveyor.speculative import SpeculativeConfig, Speculator


def decoding(rid: str, tokens: list[int], params: SamplingParams) -> Request:
    request = Request(rid, list(tokens[:-1]), params)
    request.output_token_ids = [tokens[-1]]
    request.num_computed_tokens = len(tokens) - 1
    request.state = RequestState.DECODING
    return request


def setup(max_batch_tokens: int = 64, disable_by_batch_size: int | None = None) -> FIFOScheduler:
    pool = CachePool(num_chunks=40, page_size=4, num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32,
                     device=torch.device("cpu"))
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                          "disable_by_batch_size": disable_by_batch_size})
    return FIFOScheduler(ContinuousBatchingConfig(page_size=4, max_batch_tokens=max_batch_tokens),
                         FullAttentionCacheAllocator(pool), Speculator(config, max_model_len=100, sliding=False))


def test_a_repeating_decode_gets_its_proposals_and_their_blocks() -> None:
    scheduler = setup()
    request = decoding("a", [1, 2, 3, 4, 1, 2], SamplingParams(temperature=0, max_new_tokens=20))
    scheduler.active.append(request)
    scheduler.allocator.allocate("a", request.num_computed_tokens)
    out = scheduler.schedule()
    [chunk] = out.chunks
    assert chunk.draft_tokens == [3, 4, 1] and chunk.num_tokens == 4
    assert scheduler.allocator.block_table("a") and len(scheduler.allocator.block_table("a")) == 3  # 9 tokens


def test_proposals_stop_at_max_new_tokens_and_the_budget() -> None:
    scheduler = setup(max_batch_tokens=3)
    near_end = decoding("a", [1, 2, 3, 4, 1, 2], SamplingParams(temperature=0, max_new_tokens=3))
    scheduler.active.append(near_end)
    scheduler.allocator.allocate("a", near_end.num_computed_tokens)
    [chunk] = scheduler.schedule().chunks
    assert len(chunk.draft_tokens) == 1  # max_new_tokens 3, 1 generated: this token and 1 proposal
    assert chunk.num_tokens == 2


def test_no_speculation_for_big_batches_or_penalised_requests() -> None:
    scheduler = setup(disable_by_batch_size=1)
    for rid in ("a", "b"):
        request = decoding(rid, [1, 2, 3, 1, 2], SamplingParams(temperature=0, max_new_tokens=20))
        scheduler.active.append(request)
        scheduler.allocator.allocate(rid, request.num_computed_tokens)
    assert all(c.num_tokens == 1 and not c.draft_tokens for c in scheduler.schedule().chunks)
    scheduler = setup()
    penalised = decoding("p", [1, 2, 3, 1, 2], SamplingParams(temperature=0, max_new_tokens=20,
                                                              repetition_penalty=1.2))
    scheduler.active.append(penalised)
    scheduler.allocator.allocate("p", penalised.num_computed_tokens)
    assert [c.num_tokens for c in scheduler.schedule().chunks] == [1]
