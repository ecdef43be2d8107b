"""Sliding-window and hybrid models: layer groups, `SlidingAttentionCacheAllocator`, `HybridCacheAllocator`
(unit and property tests), and Mistral with a window, Gemma 2 and Gemma 3 against transformers, with
prompts and generations far longer than the window, chunked prefill, offloading and bounded rings."""

from __future__ import annotations

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor import SamplingParams
from conveyor.cache.allocator import FullAttentionCacheAllocator, RequestDigests
from conveyor.cache.hybrid_allocator import HybridCacheAllocator
from conveyor.cache.sliding_allocator import SlidingAttentionCacheAllocator, StateCacheAllocator
from conveyor.cache.pool import NUM_RESERVED_CHUNKS, layer_groups
from conveyor.cache.prefix_cache import PrefixCache
from conveyor.models.base import attention_layer_types
from conveyor.request import Request

from tests.utils import (PAGE, TINY_COMMON, WINDOW, TinyModel, all_free, assert_greedy_match, assert_next_turn_resumes,
                         assert_prefix_sharing_keeps_outputs, greedy, hf_greedy, make_pool, random_prompts)

SLIDING_KINDS = ["mistral_sliding", "gemma2", "gemma3"]
PROMPTS = random_prompts([3, 9, 20, 31], seed=3)  # up to ~4 windows long
MAX_NEW = 20


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def references(tiny_models: dict[str, TinyModel]) -> dict[str, list[tuple[list[int], torch.Tensor]]]:
    return {kind: [hf_greedy(tiny_models[kind].reference, p, MAX_NEW) for p in PROMPTS] for kind in SLIDING_KINDS}


def assert_matches(kind: str, outputs: list[list[int]], references: dict, label: str) -> None:
    for i, (ours, (ref, logits)) in enumerate(zip(outputs, references[kind])):
        assert_greedy_match(ours, ref, logits, f"{kind} {label} prompt {i}")


# -- layer groups and allocators ----------------------------------------------------------------

def test_layer_groups_have_one_type_and_equal_size():
    s, f = "sliding_attention", "full_attention"
    assert layer_groups([f] * 4) == [(f, [0, 1, 2, 3])]
    assert layer_groups([s, f, s, f]) == [(s, [0, 2]), (f, [1, 3])]
    assert layer_groups([s] * 5 + [f]) == [(s, [0]), (s, [1]), (s, [2]), (s, [3]), (s, [4]), (f, [5])]
    assert layer_groups([s, s, s, s, f, f]) == [(s, [0, 1]), (s, [2, 3]), (f, [4, 5])]


def test_layer_types_come_from_the_model_config(tiny_models: dict[str, TinyModel]):
    configs = {k: tiny_models[k].reference.config for k in ("llama", "mistral", "mistral_sliding", "gemma2", "gemma3")}
    assert attention_layer_types(configs["llama"]) == ["full_attention"] * 2
    assert attention_layer_types(configs["mistral"]) == ["full_attention"] * 2  # sliding_window=None
    assert attention_layer_types(configs["mistral_sliding"]) == ["sliding_attention"] * 2
    assert attention_layer_types(configs["gemma2"]) == ["sliding_attention", "full_attention"] * 2
    assert attention_layer_types(configs["gemma3"]) == ["sliding_attention"] * 5 + ["full_attention"]
    long_window = transformers.MistralConfig(**TINY_COMMON, sliding_window=512)
    assert attention_layer_types(long_window) == ["full_attention"] * 2  # window >= context: same as full


def test_sliding_ring_is_bounded_by_the_window():
    alloc = SlidingAttentionCacheAllocator(make_pool(20, page_size=4), window=10)  # ring of 3 blocks
    assert [alloc.table_length(n) for n in (0, 1, 4, 5, 12, 13, 1000)] == [0, 1, 1, 2, 3, 3, 3]
    assert alloc.allocate("a", 6) and len(alloc.block_table("a")) == 2
    assert alloc.blocks_needed("a", 500) == 1
    assert alloc.allocate("a", 500) and len(alloc.block_table("a")) == 3
    assert alloc.blocks_needed("a", 10_000) == 0 and alloc.allocate("a", 10_000)
    assert alloc.chunks_holding("a", 5) == alloc.block_table("a")[:2]
    assert alloc.free("a") == 3 and alloc.num_free_blocks == 18


def test_multi_group_blocks_take_one_chunk_per_group():
    pool = make_pool(14, page_size=2)  # 12 usable chunks
    full = FullAttentionCacheAllocator(pool, num_groups=2)
    sliding = SlidingAttentionCacheAllocator(pool, window=4, num_groups=3)  # ring of 2 blocks
    hybrid = HybridCacheAllocator([full, sliding])
    assert hybrid.blocks_for_tokens(3) == 2 * 2 + 2 * 3
    assert hybrid.allocate("a", 3) and pool.num_free == 2
    tables = [full.block_table("a", g) for g in range(2)] + [sliding.block_table("a", g) for g in range(3)]
    chunks = [c for t in tables for c in t]
    assert len(chunks) == len(set(chunks)) == 10 and all(len(t) == 2 for t in tables)
    assert sorted(hybrid.chunks_holding("a", 3)) == sorted(chunks)
    assert not hybrid.allocate("b", 1)  # needs 2 + 3 chunks, 2 free: nothing taken
    assert pool.num_free == 2 and not full.holds("b") and not sliding.holds("b")
    assert hybrid.exclusive_blocks("a") == 10
    assert hybrid.capacity_tokens(100) == 6  # 12 chunks: the ring (6 chunks) + 3 full blocks (6 chunks)
    assert hybrid.free("a") == 10 and pool.num_free == 12


REQUESTS = ["r0", "r1", "r2"]
hybrid_ops = st.lists(st.tuples(st.sampled_from(["alloc", "free"]), st.sampled_from(REQUESTS), st.integers(0, 30)),
                      max_size=50)


@settings(max_examples=100, deadline=None)
@given(num_chunks=st.integers(3, 40), page_size=st.integers(1, 5), window=st.integers(1, 12),
       full_groups=st.integers(1, 3), sliding_groups=st.integers(1, 3), ops=hybrid_ops)
def test_hybrid_allocator_invariants_under_random_ops(num_chunks, page_size, window, full_groups, sliding_groups,
                                                      ops):
    pool = make_pool(num_chunks, page_size)
    full = FullAttentionCacheAllocator(pool, num_groups=full_groups)
    sliding = SlidingAttentionCacheAllocator(pool, window=window, num_groups=sliding_groups)
    hybrid = HybridCacheAllocator([full, sliding])
    ring = -(-window // page_size)
    lengths: dict[str, int] = {}
    for op, rid, tokens in ops:
        free_before, need = hybrid.num_free_blocks, hybrid.blocks_needed(rid, tokens)
        if op == "alloc":
            ok = hybrid.allocate(rid, tokens)
            assert ok == (need <= free_before)
            assert hybrid.num_free_blocks == free_before - (need if ok else 0)
            if ok:
                lengths[rid] = max(lengths.get(rid, 0), tokens)
        else:
            held = hybrid.exclusive_blocks(rid)
            assert hybrid.free(rid) == held and hybrid.num_free_blocks == free_before + held
            lengths.pop(rid, None)
        owned = [c for a in (full, sliding) for rid_ in a.block_tables for g in range(a.num_groups)
                 for c in a.block_table(rid_, g)]
        assert len(owned) == len(set(owned)), "a chunk is owned twice"
        assert all(NUM_RESERVED_CHUNKS <= c < num_chunks for c in owned), "a reserved chunk was handed out"
        assert hybrid.num_free_blocks + len(owned) == pool.num_usable
        for r, n in lengths.items():
            assert len(sliding.block_table(r)) == min(-(-n // page_size), ring) <= ring
            assert len(full.block_table(r)) == -(-n // page_size)
        assert all(count == 1 for a in (full, sliding) for count in a.ref_counts.values())
    for rid in REQUESTS:
        hybrid.free(rid)
    assert pool.num_free == pool.num_usable and not full.ref_counts and not sliding.ref_counts


def sharing_hybrid(num_chunks: int, page_size: int, window: int) -> tuple[HybridCacheAllocator,
                                                                          FullAttentionCacheAllocator,
                                                                          SlidingAttentionCacheAllocator]:
    """A sliding and a full-attention allocator sharing blocks over one pool, the sliding one first (as
    Gemma's first layer is)."""
    pool, cache, digests = make_pool(num_chunks, page_size), PrefixCache(), RequestDigests(page_size)
    full = FullAttentionCacheAllocator(pool, True, prefix_cache=cache, digests=digests)
    sliding = SlidingAttentionCacheAllocator(pool, window, 1, True, cache, digests)
    return HybridCacheAllocator([sliding, full]), full, sliding


def run_through(hybrid: HybridCacheAllocator, sliding: SlidingAttentionCacheAllocator, request: Request) -> None:
    """What the engine does for a request in one pass: its snapshots, its tokens computed, its blocks indexed."""
    sliding.take_snapshots(request, request.num_computed_tokens, request.num_tokens)
    request.num_computed_tokens = request.num_tokens
    hybrid.register_full_blocks(request)


def test_a_hit_holds_its_blocks_before_any_type_reclaims_the_cache():
    """With the pool's last free chunk not enough for the new ring, the ring reclaims cached blocks: never the
    full-attention blocks the hit shares (the newest cached ones here), whatever the allocators' order."""
    hybrid, full, sliding = sharing_hybrid(40 + NUM_RESERVED_CHUNKS, page_size=2, window=4)
    a = Request("a", list(range(10, 19)), SamplingParams(max_new_tokens=1))  # 4 full blocks and a token
    assert hybrid.allocate("a", 9)
    run_through(hybrid, sliding, a)
    hybrid.free("a")
    assert hybrid.num_cached_blocks == 4 + 4  # its full blocks and their snapshots
    assert hybrid.allocate("c", 58) and hybrid.pool.num_free == 1  # 29 full blocks and a ring of 2
    b = Request("b", list(range(10, 19)), SamplingParams(max_new_tokens=1))
    shared = hybrid.match_prefix(b)
    assert len(shared) == 4 and all(full.prefix_cache.is_cached(block) for block in shared)
    assert hybrid.allocate("b", 9, shared)
    assert full.block_table("b")[:4] == list(shared) and all(full.ref_counts[block] == 1 for block in shared)
    assert hybrid.num_cached_blocks == 2  # the snapshots of blocks 2 and 3 (the ones b read) are left
    for rid in ("b", "c"):
        hybrid.free(rid)
    hybrid.reset_prefix_cache()
    assert hybrid.pool.num_free == hybrid.pool.num_usable


def test_a_state_snapshot_is_the_whole_run_and_counts_so():
    """A pass ending on a page boundary snapshots the whole state run (3 blocks x 2 groups here): held,
    counted and freed as all its chunks, whatever the one block that stands for it."""
    pool, cache, digests = make_pool(40 + NUM_RESERVED_CHUNKS, page_size=2), PrefixCache(), RequestDigests(2)
    state = StateCacheAllocator(pool, 6, 2, "mamba", True, cache, digests)
    request = Request("a", list(range(10, 19)), SamplingParams(max_new_tokens=1))
    assert state.allocate("a", 9) and state.num_held_chunks == 6
    assert state.take_snapshots(request, 0, 7) == {}  # (not on a page boundary)
    taken = state.take_snapshots(request, 7, 8)
    assert list(taken) == [3] and len(state.snapshot_chunks(taken[3])) == 6
    assert state.num_held_chunks == state.exclusive_blocks("a") == 12 == pool.num_usable - pool.num_free
    assert state.free("a") == 12 and pool.num_free == pool.num_usable and not cache.num_cached


BASES = [list(range(10, 40)), list(range(10, 20)) + list(range(50, 70)), list(range(80, 110))]
sharing_ops = st.lists(st.tuples(st.sampled_from(["admit", "step", "free"]), st.sampled_from(REQUESTS),
                                 st.integers(0, 2), st.integers(1, 30)), max_size=60)


@settings(max_examples=120, deadline=None)
@given(num_chunks=st.integers(6, 60), page_size=st.integers(1, 4), window_pages=st.integers(1, 3),
       extra=st.integers(0, 3), full_groups=st.integers(0, 2), sliding_groups=st.integers(1, 3), state=st.booleans(),
       ops=sharing_ops)
def test_shared_rings_lose_no_chunk_under_random_ops(num_chunks, page_size, window_pages, extra, full_groups,
                                                     sliding_groups, state, ops):
    """Prefix caching over full attention and a window's snapshots or a state's (or either alone): requests
    admitted on their longest hit, stepped (snapshots taken, indexed), freed; every chunk is free, held (a
    table's or a pending snapshot's) or cached, exactly one of them, and the counts say so."""
    pool = make_pool(num_chunks, page_size)
    cache, digests = PrefixCache(), RequestDigests(page_size)
    full = ([FullAttentionCacheAllocator(pool, True, full_groups, prefix_cache=cache, digests=digests)]
            if full_groups else [])
    window = window_pages * page_size + extra
    sliding = (StateCacheAllocator(pool, window, sliding_groups, "mamba", True, cache, digests) if state else
               SlidingAttentionCacheAllocator(pool, window, sliding_groups, True, cache, digests))
    hybrid = HybridCacheAllocator([sliding, *full])  # (a sliding first layer, as Gemma's: full still allocates first)
    requests: dict[str, Request] = {}
    for op, rid, base, n in ops:
        if op == "admit" and rid not in requests:
            request = Request(rid, BASES[base][:n + 1], SamplingParams(max_new_tokens=1))
            shared = hybrid.match_prefix(request)
            if hybrid.allocate(rid, request.num_tokens, shared):
                request.num_computed_tokens = len(shared) * page_size
                requests[rid] = request
        elif op == "step" and rid in requests:
            request = requests[rid]
            start = request.num_computed_tokens
            end = min(request.num_tokens, start + n)
            sliding.take_snapshots(request, start, end)
            request.num_computed_tokens = end
            hybrid.register_full_blocks(request)
        elif op == "free":
            hybrid.free(rid)
            requests.pop(rid, None)
        held = [c for a in (*full, sliding) for b in a.ref_counts for c in (b, *a._siblings.get(b, ()))]
        cached = [c for block, siblings in cache._cached.items() for c in (block, *siblings)]
        every = list(pool._free) + held + cached
        assert len(every) == len(set(every)), "a chunk in two states at once"
        assert sorted(every) == list(range(NUM_RESERVED_CHUNKS, num_chunks)), "chunks lost, or reserved ones used"
        assert hybrid.num_free_blocks == pool.num_free + len(cached) == pool.num_usable - len(held)
    for rid in REQUESTS:
        hybrid.free(rid)
    assert not sliding.ref_counts and not any(a.ref_counts for a in full)
    hybrid.reset_prefix_cache()
    assert pool.num_free == pool.num_usable


# -- models against transformers ----------------------------------------------------------------

@pytest.mark.parametrize("kind", SLIDING_KINDS)
@pytest.mark.parametrize("config", [
    {"page_size": 4},
    {"page_size": 3, "max_batch_tokens": 5},  # window not a page multiple; chunks shorter than the window
    {"page_size": 16, "max_batch_tokens": 13},  # one page holds the window; chunks longer than it
], ids=["page4", "page3-chunk5", "page16-chunk13"])
def test_sliding_and_hybrid_models_match_transformers(kind, config, tiny_models, references):
    llm = tiny_models[kind].llm(**config)
    outs = llm.generate(PROMPTS, greedy(MAX_NEW), use_tqdm=False)
    assert_matches(kind, [o.token_ids for o in outs], references, str(config))
    assert all_free(llm)


@pytest.mark.parametrize("kind", ["mistral_sliding", "gemma2"])
def test_pytorch_attention_path_matches_too(kind, tiny_models, references, monkeypatch):
    monkeypatch.setenv("CONVEYOR_NATIVE_KERNELS", "0")
    llm = tiny_models[kind].llm(page_size=4, max_batch_tokens=7)
    assert type(llm.engine.runner.attention).__name__ == "TorchPagedAttention"
    outs = llm.generate(PROMPTS, greedy(MAX_NEW), use_tqdm=False)
    assert_matches(kind, [o.token_ids for o in outs], references, "pytorch attention")


@pytest.mark.parametrize("kind", ["mistral_sliding", "gemma3"])
def test_sliding_pages_stay_bounded_while_generating(kind, tiny_models):
    llm = tiny_models[kind].llm(page_size=4)
    engine = llm.engine
    alloc = engine.allocator
    sliding = alloc if isinstance(alloc, SlidingAttentionCacheAllocator) else alloc.allocators[0]
    assert isinstance(sliding, SlidingAttentionCacheAllocator) and sliding.ring_blocks == WINDOW // 4
    engine.add_request(engine.make_request("long", PROMPTS[3], greedy(60)))
    lengths = []
    while engine.has_unfinished_requests():
        engine.step()
        if sliding.holds("long"):
            lengths.append(len(sliding.block_table("long")))
    assert max(lengths) == sliding.ring_blocks  # 91 tokens, never more than the window's pages
    assert all_free(llm)


@pytest.mark.parametrize("kind", SLIDING_KINDS)
def test_sliding_and_hybrid_models_share_prefixes(kind, tiny_models):
    """`shared_prefix_scenario` (page 4, chunks of 24 tokens, three times the window: snapshots written
    straight, copied before and after passes): every type resumes the hits full attention alone would get."""
    assert_prefix_sharing_keeps_outputs(tiny_models[kind], (10 + 12 + 11 + 14) * PAGE)  # as the llama's


@pytest.mark.parametrize("kind", ["mistral_sliding", "gemma3"])
@pytest.mark.parametrize("config", [
    {"page_size": 3, "max_batch_tokens": 5},  # window not a page multiple; chunks shorter than the window
    {"page_size": 4, "max_batch_tokens": 13, "use_async_batching": True, "pad_steps": True},  # indexed a step late
], ids=["page3-chunk5", "page4-async-padded"])
def test_a_next_turn_resumes_after_the_generated_tokens(kind, config, tiny_models):
    assert_next_turn_resumes(tiny_models[kind], config)


def test_windows_shorter_than_a_page_share_nothing(tiny_models):
    llm = tiny_models["gemma2"].llm(page_size=16)  # the window (8 tokens) fits in one page: no snapshots
    assert llm.engine.block_sharing is False and llm.engine.allocator.block_sharing is False
    prompt = PROMPTS[3]
    llm.generate([prompt, prompt], greedy(2), use_tqdm=False)
    stats = llm.stats()
    assert (stats.prefill_tokens, stats.prefix_cache_hit_tokens) == (2 * len(prompt), 0)


@pytest.mark.parametrize("scheduler_type", ["fifo", "prefill_first"])
@pytest.mark.parametrize("swap", [False, True], ids=["soft-reset", "swap"])
def test_hybrid_offloading_keeps_outputs(scheduler_type, swap, tiny_models, references):
    """A pool far too small for the four requests at once: requests are offloaded and resumed (by
    swapping their full and sliding chunks, or by recomputation) and the outputs do not change."""
    llm = tiny_models["gemma2"].llm(page_size=4, num_blocks=30, scheduler_type=scheduler_type,
                                    cpu_offload_space=1.0 if swap else 0.0)
    outs = llm.generate(PROMPTS, greedy(MAX_NEW), use_tqdm=False)
    stats = llm.stats()
    assert stats.offloads > 0
    assert (stats.swap_ins > 0) == swap and (stats.soft_resets > 0) == (not swap)
    assert_matches("gemma2", [o.token_ids for o in outs], references, f"offload {scheduler_type}")
    assert all_free(llm)
    if swap:
        assert llm.engine.swap.num_free == llm.engine.swap.num_slots


def test_hybrid_request_larger_than_the_pool_fails_alone(tiny_models, references):
    llm = tiny_models["gemma2"].llm(page_size=4, num_blocks=24)  # a ring of 2 chunks + 22 full blocks
    assert llm.engine.capacity_tokens == 88
    too_long = random_prompts([llm.engine.capacity_tokens + 1], seed=9)[0]
    with pytest.raises(ValueError, match="KV cache capacity"):
        llm.generate([too_long], greedy(1), use_tqdm=False)
    outs = llm.generate(PROMPTS[:2], greedy(MAX_NEW), use_tqdm=False)
    assert_matches("gemma2", [o.token_ids for o in outs], references, "after a refused request")
    assert all_free(llm)
