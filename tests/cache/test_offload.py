"""Offloading under KV-pool pressure: the swap path (KV blocks to host memory and back) and the soft-reset
path give the same outputs as an unconstrained run and as transformers; nothing leaks."""

from __future__ import annotations

import pytest
import torch

from conveyor import SamplingParams
from conveyor.cache.offload import SwapPool, choose_victims
from conveyor.cache.pool import CachePool
from conveyor.engine import engine as engine_module
from conveyor.engine.engine import Engine
from conveyor.errors import InvalidRequestError
from conveyor.request import RequestState

from tests.utils import TinyModel, assert_greedy_match, hf_greedy, random_prompts

PAGE = 4
SMALL = dict(page_size=PAGE, num_blocks=24, max_batch_tokens=32, safety_margin=0.0)  # too small for all at once
PROMPTS = random_prompts([20, 15, 25, 10, 18], seed=5)
MAX_NEW = [24, 28, 16, 30, 20]
PARAMS = [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True) for n in MAX_NEW]
BLOCK_BYTES = 2 * PAGE * 2 * 2 * 16 * 4  # tiny llama: K and V, 2 layers, 2 kv heads, head_dim 16, fp32

# The engine stepped from the test's own thread is much slower with two intra-op threads on a shared 2-core
# machine (the manager's thread is not affected); one thread keeps the file fast.
pytestmark = pytest.mark.usefixtures("one_thread")


def gib(blocks: int) -> float:
    return blocks * BLOCK_BYTES / 2**30


@pytest.fixture(scope="module")
def reference(tiny_llama: TinyModel) -> list[list[int]]:
    """An unconstrained run's outputs, themselves checked against transformers."""
    outs = [o.token_ids for o in tiny_llama.llm(page_size=PAGE).generate(PROMPTS, PARAMS, use_tqdm=False)]
    for i, (prompt, n, out) in enumerate(zip(PROMPTS, MAX_NEW, outs)):
        ref, logits = hf_greedy(tiny_llama.reference, prompt, n)
        assert_greedy_match(out, ref, logits, f"unconstrained prompt {i}")
    return outs


@pytest.fixture(autouse=True)
def checked_victims(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Every offload decision: never the last active request, never one in the batch about to run."""
    decisions: list[list[str]] = []

    def checked(active, scheduled, stalled, allocator):
        victims = choose_victims(active, scheduled, stalled, allocator)
        assert len(victims) < len(active), "the last active request was offloaded"
        assert not {v.request_id for v in victims} & scheduled, "a scheduled request was offloaded"
        decisions.append([v.request_id for v in victims])
        return victims

    monkeypatch.setattr(engine_module, "choose_victims", checked)
    return decisions


def assert_nothing_held(engine: Engine) -> None:
    assert engine.allocator.num_free_blocks == engine.allocator.num_total_blocks
    assert not engine.allocator.block_tables and not engine.allocator.ref_counts
    if engine.swap is not None:
        assert engine.swap.num_free == engine.swap.num_slots and not engine.swap.slots
    assert not engine._resume_state


@pytest.mark.parametrize("scheduler_type", ["fifo", "prefill_first"])
@pytest.mark.parametrize("path", ["swap", "soft_reset", "mixed"])
def test_offloaded_requests_keep_their_outputs(tiny_llama: TinyModel, reference: list[list[int]],
                                               checked_victims: list[list[str]], scheduler_type: str,
                                               path: str) -> None:
    space = {"swap": gib(100), "soft_reset": 0.0, "mixed": gib(6)}[path]
    llm = tiny_llama.llm(**SMALL, scheduler_type=scheduler_type, cpu_offload_space=space)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [o.token_ids for o in outs] == reference
    assert all(o.finish_reason == "length" for o in outs)
    stats = llm.stats()
    assert any(checked_victims), "the pool was meant to be too small to hold every request"
    assert stats.offloads == stats.swap_outs + stats.soft_resets == sum(map(len, checked_victims))
    assert stats.swap_ins == stats.swap_outs
    if path == "swap":
        assert stats.swap_ins > 0 and stats.soft_resets == 0
        assert stats.prefill_tokens == sum(map(len, PROMPTS)), "a swapped request recomputes nothing"
    elif path == "soft_reset":
        assert llm.engine.swap is None
        assert stats.soft_resets > 0 and stats.swap_ins == 0
        assert stats.prefill_tokens > sum(map(len, PROMPTS))
    else:
        assert stats.swap_ins > 0 and stats.soft_resets > 0
    assert_nothing_held(llm.engine)


def test_swap_pool_size_and_memory(tiny_llama: TinyModel) -> None:
    llm = tiny_llama.llm(**SMALL, cpu_offload_space=gib(10) + gib(1) / 2)  # floor: 10 blocks
    swap = llm.engine.swap
    assert swap.num_slots == swap.num_free == 10
    assert CachePool.bytes_per_chunk(page_size=PAGE, num_layers=2, num_kv_heads=2, head_dim=16,
                                     dtype=torch.float32) == BLOCK_BYTES
    assert all(t.device.type == "cpu" and not t.is_pinned() for t in swap.kv)  # plain memory on CPU
    assert tiny_llama.llm(**SMALL, cpu_offload_space=gib(1) / 2).engine.swap is None  # less than a block
    stats = llm.stats()
    assert (stats.swap_total_blocks, stats.swap_free_blocks, stats.swapped_requests) == (10, 10, 0)
    # A prompt bigger than the whole device pool still fails at validation, swap space or not.
    with pytest.raises(InvalidRequestError, match="KV cache capacity"):
        llm.engine.make_request("big", list(range(3, 3 + 24 * PAGE + 1)), SamplingParams(max_new_tokens=1))


def test_swap_pool_round_trip() -> None:
    """Blocks come back bit-exact into other device blocks; each request's slots in table order."""
    pool = CachePool(12, page_size=2, num_layers=2, num_kv_heads=1, head_dim=3, dtype=torch.float32,
                     device=torch.device("cpu"))
    for layer in pool.kv:
        layer.copy_(torch.randn_like(layer))
    blocks = lambda i, bs: torch.cat([pool.kv[i][:, b * 2:(b + 1) * 2] for b in bs], 1)  # noqa: E731
    before = [blocks(i, [3, 7, 5]) for i in range(2)], [blocks(i, [9]) for i in range(2)]
    swap = SwapPool(5, pool)
    swap.swap_out([("a", [3, 7, 5]), ("b", [9])])
    assert swap.num_free == 1 and swap.holds("a") and len(swap.slots["a"]) == 3
    for layer in pool.kv:
        layer[:, 4:].zero_()
    swap.swap_in([("b", [2]), ("a", [10, 4, 6])])
    for i, layer in enumerate(pool.kv):
        torch.testing.assert_close(torch.cat([layer[:, b * 2:(b + 1) * 2] for b in [10, 4, 6]], 1), before[0][i])
        torch.testing.assert_close(layer[:, 4:6], before[1][i])
    assert swap.num_free == 5 and not swap.slots
    swap.swap_out([("c", [2, 3])])
    assert swap.release("c") == 2 and swap.num_free == 5 and swap.release("c") == 0


def test_cancelling_a_swapped_request_frees_its_slots(tiny_llama: TinyModel, reference: list[list[int]]) -> None:
    engine = tiny_llama.llm(**SMALL, cpu_offload_space=gib(100)).engine
    requests = [engine.make_request(f"r{i}", p, params) for i, (p, params) in enumerate(zip(PROMPTS, PARAMS))]
    for request in requests:
        engine.add_request(request)
    for _ in range(500):
        swapped = [r for r in requests if r.state is RequestState.SWAPPED]
        if swapped:
            break
        engine.step()
    else:
        pytest.fail("no request was swapped out")
    victim = swapped[0]
    held = len(engine.swap.slots[victim.request_id])
    used = engine.swap.num_used
    assert held == -(-victim.num_computed_tokens // PAGE) and victim.request_id not in engine.allocator.block_tables
    assert engine.stats().swapped_requests == len(swapped)
    engine.cancel_request(victim.request_id)
    assert victim.state is RequestState.CANCELLED and victim.finish_reason == "abort"
    assert engine.swap.num_used == used - held and not engine.swap.holds(victim.request_id)
    while engine.has_unfinished_requests():
        engine.step()
    for i, request in enumerate(requests):
        if request is not victim:
            assert request.output_token_ids == reference[i], f"prompt {i}"
    assert_nothing_held(engine)


def test_failing_a_swapped_request_frees_its_slots(tiny_llama: TinyModel) -> None:
    engine = tiny_llama.llm(**SMALL, cpu_offload_space=gib(100)).engine
    requests = [engine.make_request(f"r{i}", p, params) for i, (p, params) in enumerate(zip(PROMPTS, PARAMS))]
    for request in requests:
        engine.add_request(request)
    while not any(r.state is RequestState.SWAPPED for r in requests):
        engine.step()
    victim = next(r for r in requests if r.state is RequestState.SWAPPED)
    engine.finish_request(victim, RequestState.FAILED, "error", error="test")
    assert not engine.swap.holds(victim.request_id)
    while engine.has_unfinished_requests():
        engine.step()
    assert_nothing_held(engine)


def test_swapped_requests_with_shared_prefix_blocks(tiny_llama: TinyModel) -> None:
    """Victims holding prefix blocks shared with others: only their references are dropped (the others
    keep reading those blocks), their swapped copy includes them, and every output is unchanged."""
    base = random_prompts([16], seed=51)[0]
    prompts = [base + tail for tail in random_prompts([6, 9, 3, 12], seed=52)]
    params = [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True) for n in (24, 20, 28, 16)]
    expected = [o.token_ids for o in tiny_llama.llm(page_size=PAGE).generate(prompts, params, use_tqdm=False)]
    engine = tiny_llama.llm(**{**SMALL, "num_blocks": 20}, cpu_offload_space=gib(100)).engine
    shared_swapped: list[int] = []
    offload = engine._offload

    def watched(victims):
        refs = engine.allocator.ref_counts
        for v in victims:
            shared_swapped.extend(b for b in engine.allocator.block_tables.get(v.request_id, []) if refs[b] > 1)
        offload(victims)

    engine._offload = watched
    requests = [engine.make_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    engine.add_request(requests[0])
    engine.step()  # r0's prompt is in the cache: the others start from its 4 prefix blocks
    for request in requests[1:]:
        engine.add_request(request)
    while engine.has_unfinished_requests():
        engine.step()
    assert [r.output_token_ids for r in requests] == expected
    stats = engine.stats()
    assert stats.prefix_cache_hit_tokens >= 3 * len(base) and stats.swap_ins > 0 and stats.soft_resets == 0
    assert shared_swapped, "a victim was meant to share prefix blocks with a running request"
    assert_nothing_held(engine)
