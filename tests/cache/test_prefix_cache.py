"""Prefix caching end to end: block digests, outputs with caching on and off, the
prefill it saves (through `llm.stats()`), free counts, and eviction of cached blocks under pressure."""

from __future__ import annotations

import hashlib
import struct

import pytest

from conveyor.cache.prefix_cache import BlockHashes, PrefixCache, block_digest
from conveyor.engine.engine import Engine
from conveyor.request import Request

from tests.utils import (PAGE, TinyModel, assert_greedy_match, assert_prefix_sharing_keeps_outputs,
                         check_allocator_invariants, greedy, hf_greedy, random_prompts)


def chain(tokens: list[int], num_blocks: int, page_size: int = PAGE) -> list[bytes]:
    digests, parent = [], b""
    for i in range(num_blocks):
        parent = block_digest(parent, tokens[i * page_size:(i + 1) * page_size])
        digests.append(parent)
    return digests


def assert_all_free(engine: Engine) -> None:
    """Nothing held: every block is uninitialized or cached, and both count as free."""
    alloc = engine.allocator
    check_allocator_invariants(alloc)
    assert not alloc.block_tables and not alloc.ref_counts
    assert alloc.num_free_blocks == alloc.num_total_blocks
    assert engine.pool.num_free + alloc.num_cached_blocks == engine.pool.num_usable
    stats = engine.stats()
    assert stats.free_blocks == stats.total_blocks and stats.kv_cache_usage == 0.0


# -- digests -----------------------------------------------------------------------------------

def test_block_digest_is_sha256_of_parent_and_little_endian_int64_tokens():
    first = block_digest(b"", [1, 2, 3, 4])
    assert first == hashlib.sha256(struct.pack("<4q", 1, 2, 3, 4)).digest()
    # Fixed values: the same in every process (no salted `hash`) and on every machine.
    assert first.hex() == "73e200e2b048c86d4e8c86b86bf62bbda84c7384e34e250b01aa30ab29d234a4"
    assert block_digest(first, [5, 6, 7, 8]).hex() == \
        "d6c3196cb2db3ef52af9bf96fe85966089108e7e3524783840e64898b3da413e"
    # Chained: the same tokens after a different parent give a different digest.
    assert block_digest(block_digest(b"", [9, 2, 3, 4]), [5, 6, 7, 8]) != block_digest(first, [5, 6, 7, 8])
    assert block_digest(b"", [1, 2, 3, 4]) != block_digest(b"", [1, 2, 3, 4 + (1 << 32)])


def test_block_hashes_extend_lazily():
    r = Request("r", list(range(10, 22)), greedy(1))
    hashes = BlockHashes(PAGE, r)
    assert hashes.digest(1) == chain(r.prompt_token_ids, 2)[1]
    assert hashes.digests == chain(r.prompt_token_ids, 2)
    with pytest.raises(AssertionError, match="not complete"):
        hashes.digest(3)


def test_prefix_cache_index_and_lifo_eviction():
    cache = PrefixCache()
    d = chain(list(range(16)), 4)
    for block, digest in zip([5, 6, 7, 8], d):
        assert cache.register(block, digest)
    assert not cache.register(9, d[0])  # a second block for a digest stays unindexed
    assert cache.lookup(d[0]) == 5 and cache.digest_of(9) is None
    assert not cache.park(9)  # no digest: back to the pool
    for block in [5, 6, 7, 8]:
        assert cache.park(block)
    cache.reuse(6)
    cache.park(6)  # cached again: now the most recent
    assert [cache.evict(), cache.evict()] == [[6], [8]]
    assert cache.lookup(d[1]) is None and cache.lookup(d[3]) is None and cache.lookup(d[0]) == 5
    assert cache.num_cached == 2


# -- outputs and savings -----------------------------------------------------------------------

def test_outputs_identical_with_and_without_prefix_caching(tiny_llama: TinyModel) -> None:
    # b: 10 blocks; c: 12 (of 12.5); d: 11 (its last block recomputed); e: 14 (a's generated tokens too).
    llm = assert_prefix_sharing_keeps_outputs(tiny_llama, (10 + 12 + 11 + 14) * PAGE)
    assert_all_free(llm.engine)


def test_second_request_prefills_only_its_new_tokens(tiny_llama: TinyModel) -> None:
    first = random_prompts([41], seed=21)[0]
    second = first[:32] + random_prompts([9], seed=22)[0]
    outputs = {}
    for sharing in (True, False):
        llm = tiny_llama.llm(page_size=PAGE, allow_block_sharing=sharing)
        counts = []
        runs = []
        for prompt in (first, second, first):
            runs.append(llm.generate([prompt], greedy(4), use_tqdm=False)[0].token_ids)
            s = llm.stats()
            counts.append((s.prefill_tokens, s.prefix_cache_query_tokens, s.prefix_cache_hit_tokens))
        if sharing:
            # first: all 41 computed; second: 8 shared blocks, 9 computed; first again: 10 of its 10.25
            # blocks cached (the last token is always computed), 1 computed.
            assert counts == [(41, 41, 0), (50, 82, 32), (51, 123, 72)]
        else:
            assert counts == [(41, 0, 0), (82, 0, 0), (123, 0, 0)]
        assert runs[0] == runs[2]
        outputs[sharing] = runs
    assert outputs[True] == outputs[False]


# -- cached blocks are reclaimed before anyone waits --------------------------------------------

def test_cached_blocks_are_evicted_for_new_requests(tiny_llama: TinyModel) -> None:
    llm = tiny_llama.llm(page_size=PAGE, num_blocks=16, max_batch_tokens=64)
    engine, alloc = llm.engine, llm.engine.allocator
    a, x = random_prompts([40, 40], seed=31)
    a_out = llm.generate([a], greedy(4), use_tqdm=False)[0].token_ids  # 43 tokens computed, 11 blocks
    assert (alloc.num_cached_blocks, engine.pool.num_free) == (11, 5)  # 10 full ones and the partial 11th, a tail
    digests = chain(a, 10)
    a_blocks = [alloc.prefix_cache.lookup(d) for d in digests]
    assert None not in a_blocks
    # x needs 12 blocks, 5 are uninitialized: 7 cached ones are reclaimed, the most recent first (a's tail,
    # then its deepest full blocks).
    out = llm.generate([x], greedy(8), use_tqdm=False)[0]
    assert out.finish_reason == "length" and out.num_output_tokens == 8
    assert [alloc.prefix_cache.lookup(d) for d in digests] == a_blocks[:4] + [None] * 6
    assert (alloc.num_cached_blocks, engine.pool.num_free) == (4 + 12, 0)  # x's 11 full blocks and its tail
    # a again: its 4 surviving blocks are reused, the evicted ones are computed again; same output.
    before = llm.stats()
    assert llm.generate([a], greedy(4), use_tqdm=False)[0].token_ids == a_out
    after = llm.stats()
    assert after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens == 4 * PAGE
    assert after.prefill_tokens - before.prefill_tokens == 40 - 4 * PAGE
    now = [alloc.prefix_cache.lookup(d) for d in digests]
    assert now[:4] == a_blocks[:4] and None not in now  # the recomputed blocks are indexed again
    assert (alloc.num_cached_blocks, engine.pool.num_free) == (16, 0)
    # Two requests that need the whole pool between them, while all its 16 blocks sit cached: both run
    # at once, nobody is refused or preempted.
    y, z = random_prompts([24, 24], seed=32)
    outs = llm.generate([y, z], greedy(9), use_tqdm=False)  # 32 tokens computed each: 8 blocks each
    assert all(o.finish_reason == "length" and o.num_output_tokens == 9 for o in outs)
    stats = llm.stats()
    assert stats.soft_resets == 0 and stats.offloads == 0 and stats.finished_requests == 5
    assert_all_free(engine)
    assert alloc.num_cached_blocks == 16


def test_preempted_requests_with_shared_prefixes_keep_their_outputs(tiny_llama: TinyModel) -> None:
    """A pool too small for everyone: requests sharing a prefix are soft-reset and come back, matching
    their own cached blocks (generated tokens included) if nothing reclaimed them; outputs unchanged."""
    base = random_prompts([24], seed=51)[0]
    prompts = [base + tail for tail in random_prompts([6, 9, 3, 12, 5, 8], seed=52)]
    max_new = [40, 30, 45, 20, 35, 25]
    params = [greedy(n) for n in max_new]
    results = {}
    for sharing in (True, False):
        llm = tiny_llama.llm(page_size=PAGE, num_blocks=36, max_batch_tokens=64, safety_margin=0.0,
                             allow_block_sharing=sharing)
        results[sharing] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.stats()
        assert stats.soft_resets > 0, "the pool was meant to be too small to hold every request"
        assert all(n == len(out) for n, out in zip(max_new, results[sharing]))
        results[sharing, "prefill"] = stats.prefill_tokens
        if sharing:
            assert_all_free(llm.engine)
    assert results[True, "prefill"] < sum(map(len, prompts)) < results[False, "prefill"]
    assert results[True] == results[False]
    for i, (prompt, out) in enumerate(zip(prompts, results[True])):
        ref, logits = hf_greedy(tiny_llama.reference, prompt, len(out))
        assert_greedy_match(out, ref, logits, f"prompt {i}")


def test_sharing_turned_off_prefills_everything(tiny_llama: TinyModel) -> None:
    """(Sliding and hybrid models, which cannot share, are checked in test_sliding.py.)"""
    llm = tiny_llama.llm(page_size=PAGE, allow_block_sharing=False)
    assert llm.engine.block_sharing is False and llm.engine.allocator.block_sharing is False
    prompt = random_prompts([20], seed=41)[0]
    llm.generate([prompt, prompt], greedy(2), use_tqdm=False)
    llm.generate([prompt], greedy(2), use_tqdm=False)
    stats = llm.stats()
    assert (stats.prefill_tokens, stats.prefix_cache_hit_tokens) == (60, 0)


def test_a_finished_requests_tail_is_copied_not_computed(tiny_llama: TinyModel) -> None:
    """A finished request's last, partly filled block stays cached as a tail: a request that continues its tokens
    (a beam's next step, a chat's next turn) copies their K/V instead of computing them, and its greedy tokens
    are still transformers' (fp32); a request that differs inside the tail computes it; tails are evicted
    like any cached block (`reset_prefix_cache`) and nothing is lost."""
    llm = tiny_llama.llm(page_size=PAGE, num_blocks=64)
    engine, alloc = llm.engine, llm.engine.allocator
    prompt = random_prompts([10], seed=33)[0]
    first = llm.generate([prompt], greedy(2), use_tqdm=False)[0].token_ids  # 11 tokens computed: 2 blocks + 3
    assert alloc.num_cached_blocks == 3 and len(alloc.prefix_cache._tail_of) == 1
    check_allocator_invariants(alloc)

    def run(tokens: list[int], new: int) -> tuple[int, int]:
        """The prompt hit and prefill tokens of generating `new` greedy tokens after `tokens`, checked."""
        before = llm.stats()
        [out] = llm.generate([tokens], greedy(new), use_tqdm=False)
        ref, logits = hf_greedy(tiny_llama.reference, tokens, new)
        assert_greedy_match(out.token_ids, ref, logits, "after a tail")
        after = llm.stats()
        return (after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens,
                after.prefill_tokens - before.prefill_tokens)

    continued = prompt + first + [7]  # 13 tokens: 2 full blocks and the 3-token tail reused, 2 computed
    assert run(continued, 4) == (11, 2)
    assert run(prompt[:9] + [prompt[9] + 1] + first + [7], 4) == (8, 5)  # differs inside the tail: computed
    check_allocator_invariants(alloc)
    assert llm.reset_prefix_cache() and alloc.num_cached_blocks == 0 and not alloc.prefix_cache._tail_of
    assert run(continued, 1) == (0, 13)
    assert_all_free(engine)
