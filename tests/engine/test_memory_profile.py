"""KV cache sizing on CUDA: the profiling pass (run here on CPU through the real runner) and the
arithmetic from `torch.cuda`'s counters, which are monkeypatched; the real thing is in
tests/entrypoints/test_cuda.py."""

from __future__ import annotations

import pytest
import torch

from conveyor import ContinuousBatchingConfig
from conveyor.cache.pool import NUM_RESERVED_CHUNKS, CachePool, plan_num_chunks, working_memory_bytes
from conveyor.engine import memory_profile
from conveyor.engine.memory_profile import profile_split, run_profile_pass, scratch_chunks, working_memory

from tests.utils import TinyModel

CUDA = torch.device("cuda")


def test_profile_split() -> None:
    assert profile_split(512, 64) == [8] * 64
    assert profile_split(10, 4) == [3, 3, 2, 2]
    assert profile_split(3, 64) == [1, 1, 1]  # fewer tokens than requests: one token each
    assert sum(profile_split(1000, 7)) == 1000 and len(profile_split(1000, 7)) == 7


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_profile_pass_runs_the_real_runner(tiny_models: dict[str, TinyModel], kind: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The pass runs max_batch_tokens tokens and samples one row per request (full and hybrid models)."""
    model = tiny_models[kind].llm().engine.model
    config = ContinuousBatchingConfig(max_batch_tokens=40, max_requests_per_batch=6, page_size=4)
    calls: list[tuple[int, int]] = []
    from conveyor.engine.model_runner import ModelRunner

    execute = ModelRunner.execute

    def spy(self: ModelRunner, chunks: list) -> object:
        result = execute(self, chunks)
        calls.append((sum(c.num_tokens for c in chunks), len(result.token_ids)))
        assert self.pool.num_chunks == scratch_chunks(model, config)
        return result

    monkeypatch.setattr(ModelRunner, "execute", spy)
    run_profile_pass(model, config, torch.device("cpu"), torch.float32)
    assert calls == [(40, 6)]


def test_measured_working_memory_is_the_peak_above_weights_and_scratch(tiny_llama: TinyModel,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_llama.llm().engine.model
    config = ContinuousBatchingConfig(max_batch_tokens=64, max_requests_per_batch=8)
    scratch = scratch_chunks(model, config) * CachePool.bytes_per_chunk(16, 2, model.num_kv_heads, model.head_dim,
                                                                        torch.bfloat16)
    events: list[str] = []
    monkeypatch.setattr(memory_profile, "run_profile_pass", lambda *a: events.append("pass"))
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, _n=name: events.append(_n))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 10_000)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 10_000 + scratch + 7_000)
    assert working_memory(model, config, CUDA, torch.bfloat16) == 7_000
    assert events.index("reset_peak_memory_stats") < events.index("pass") < events.index("empty_cache", 2)
    # A given num_blocks or a CPU device: no pass, the estimate as before.
    events.clear()
    assert working_memory(model, ContinuousBatchingConfig(num_blocks=9), CUDA, torch.bfloat16) == \
        working_memory_bytes(model, ContinuousBatchingConfig(num_blocks=9), torch.bfloat16)
    assert working_memory(model, config, torch.device("cpu"), torch.float32) == \
        working_memory_bytes(model, config, torch.float32)
    assert events == []


def test_cuda_pool_is_sized_from_mem_get_info(monkeypatch: pytest.MonkeyPatch) -> None:
    """0.9 by default on CUDA of what mem_get_info leaves after the measured working memory; capped."""
    free = 100 * 2**20
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 4 * free))
    plan = dict(num_blocks=None, bytes_per_chunk=2**16, activation_bytes=20 * 2**20, device=CUDA)
    assert plan_num_chunks(max_memory_percent=None, max_useful_chunks=10**6, **plan) == \
        int(80 * 2**20 * 0.9) // 2**16
    assert plan_num_chunks(max_memory_percent=0.5, max_useful_chunks=10**6, **plan) == 40 * 2**20 // 2**16
    assert plan_num_chunks(max_memory_percent=None, max_useful_chunks=100, **plan) == 100 + NUM_RESERVED_CHUNKS
    with pytest.raises(MemoryError, match="not enough free memory"):
        plan_num_chunks(max_memory_percent=None, max_useful_chunks=100,
                        **(plan | {"activation_bytes": free - 2**16}))
