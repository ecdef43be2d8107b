"""Unit and property tests of the KV pool (`CachePool`) and `FullAttentionCacheAllocator`, with and without
block sharing (prefix caching)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from conveyor import LLM, ContinuousBatchingConfig
from conveyor.cache import pool as cache_pool
from conveyor.cache.allocator import FullAttentionCacheAllocator
from conveyor.cache.sliding_allocator import SlidingAttentionCacheAllocator
from conveyor.cache.pool import NUM_RESERVED_CHUNKS, CachePool, plan_num_chunks, working_memory_bytes
from conveyor.cache.prefix_cache import block_digest
from conveyor.kernels import host_memory
from conveyor.request import Request
from conveyor.sampling_params import SamplingParams

from tests.utils import check_allocator_invariants, make_pool, smaps_fields

RESERVED = set(range(NUM_RESERVED_CHUNKS))


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# -- CachePool ---------------------------------------------------------------------------------

def test_reserved_chunks_are_0_and_1():
    assert NUM_RESERVED_CHUNKS == 2
    pool = make_pool(10)
    assert pool.num_usable == 8
    assert pool.num_free == 8


def test_pool_never_hands_out_reserved_chunks():
    pool = make_pool(12)
    got = pool.allocate(pool.num_usable)
    assert got is not None
    assert sorted(got) == list(range(2, 12))
    assert not RESERVED & set(got)
    assert pool.num_free == 0
    # Free everything and take it again one at a time: still never 0 or 1.
    pool.free(got)
    seen = [pool.allocate(1)[0] for _ in range(pool.num_usable)]
    assert sorted(seen) == list(range(2, 12))
    assert pool.allocate(1) is None


def test_pool_needs_more_than_reserved_chunks():
    with pytest.raises(ValueError):
        make_pool(2)
    with pytest.raises(ValueError):
        make_pool(1)
    assert make_pool(3).num_usable == 1


def test_pool_allocate_is_all_or_nothing():
    pool = make_pool(7)  # 5 usable
    first = pool.allocate(3)
    assert first is not None and len(first) == 3
    assert pool.num_free == 2
    assert pool.allocate(3) is None
    assert pool.num_free == 2  # nothing taken by the failed call
    rest = pool.allocate(2)
    assert rest is not None and len(rest) == 2
    assert set(first).isdisjoint(rest)
    assert pool.num_free == 0
    assert pool.allocate(1) is None
    assert pool.allocate(0) == []


def test_pool_free_count_arithmetic():
    pool = make_pool(20)  # 18 usable
    a = pool.allocate(5)
    b = pool.allocate(7)
    assert pool.num_free == 18 - 12
    pool.free(a)
    assert pool.num_free == 18 - 7
    pool.free(b)
    assert pool.num_free == 18
    c = pool.allocate(18)
    assert len(set(c)) == 18
    assert pool.num_free == 0


def test_pool_kv_tensor_shape():
    pool = CachePool(5, 8, num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float32,
                     device=torch.device("cpu"))
    assert len(pool.kv) == 3
    assert pool.kv[0].shape == (2, 5 * 8, 2, 4)
    assert CachePool.bytes_per_chunk(8, 3, 2, 4, torch.float32) == 2 * 8 * 3 * 2 * 4 * 4
    assert CachePool.bytes_per_chunk(8, 3, 2, 4, torch.float16) == 2 * 8 * 3 * 2 * 4 * 2


def test_a_cpu_pool_sits_on_huge_pages_where_the_kernel_gives_them():
    # decode at depth reads every position's rows: on 4 KiB pages a TLB miss every few positions
    if host_memory.thp_mode() == "off":
        pytest.skip("transparent huge pages are off on this machine")
    pool = CachePool(40, 32, num_layers=2, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                     device=torch.device("cpu"))  # a layer: 2 x 1,280 slots x 2 KiB, 5 MiB
    for layer in pool.kv:
        assert layer.data_ptr() % host_memory.HUGE_PAGE == 0 and layer.is_contiguous()
        if host_memory.thp_mode() == "madvise":
            assert "hg" in smaps_fields(layer.data_ptr())["VmFlags"]
        assert not layer[:, :NUM_RESERVED_CHUNKS * 32].any()  # the reserved chunks zeroed, as on small pages


# -- FullAttentionCacheAllocator ---------------------------------------------------------------

def test_pool_resident_bytes_count_the_pages_written():
    # 4 MiB chunks (2 x 32 tokens x 128 heads x 128 dims x 4 bytes); slack for the partial (huge, with
    # transparent huge pages) pages at both ends of the K and V halves of the tensor.
    pool = CachePool(20, 32, num_layers=1, num_kv_heads=128, head_dim=128, dtype=torch.float32,
                     device=torch.device("cpu"))
    per_chunk, slack = CachePool.bytes_per_chunk(32, 1, 128, 128, torch.float32), 4 * 2**21
    assert pool.nbytes == 20 * per_chunk
    assert NUM_RESERVED_CHUNKS * per_chunk <= pool.resident_bytes() <= NUM_RESERVED_CHUNKS * per_chunk + slack
    chunks = pool.allocate(10)
    for c in chunks:
        pool.kv[0][:, c * 32:(c + 1) * 32].fill_(1.0)
    assert 12 * per_chunk <= pool.resident_bytes() <= 12 * per_chunk + slack
    pool.kv[0].fill_(0.0)
    assert pool.nbytes <= pool.resident_bytes() <= pool.nbytes + slack


def test_pool_hands_out_the_chunks_freed_last_first():
    # so a workload keeps reusing the memory it has touched instead of faulting in the whole pool
    pool = make_pool(10, page_size=4)
    first = pool.allocate(3)
    assert first == [2, 3, 4]
    pool.free(first[1:])
    assert pool.allocate(2) == [3, 4] and pool.allocate(1) == [5]
    pool.free([4, 3])
    assert pool.allocate(3) == [4, 3, 6] and pool.num_free == 8 - 5  # 2, 5, 4, 3, 6 held


def test_allocator_blocks_for_tokens():
    alloc = FullAttentionCacheAllocator(make_pool(10, page_size=4))
    assert [alloc.blocks_for_tokens(n) for n in range(0, 10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]
    assert alloc.num_total_blocks == 8
    assert alloc.num_free_blocks == 8


def test_allocator_table_grows_by_ceil_tokens_over_page_size():
    page = 4
    alloc = FullAttentionCacheAllocator(make_pool(40, page_size=page))
    held = 0
    for tokens in [1, 2, 4, 5, 5, 9, 16, 17, 30, 3]:
        assert alloc.blocks_needed("r", tokens) == max(ceil_div(tokens, page) - held, 0)
        assert alloc.allocate("r", tokens)
        held = max(held, ceil_div(tokens, page))
        assert len(alloc.block_table("r")) == held
    assert alloc.num_free_blocks == 38 - held
    # Block tables only grow: asking for fewer tokens keeps what is there.
    table = list(alloc.block_table("r"))
    assert alloc.allocate("r", 1)
    assert alloc.block_table("r") == table


def test_allocator_zero_token_allocation_creates_empty_table():
    alloc = FullAttentionCacheAllocator(make_pool(4))
    assert alloc.allocate("r", 0)
    assert alloc.block_table("r") == []
    assert alloc.num_free_blocks == 2


def test_allocator_allocate_is_all_or_nothing():
    alloc = FullAttentionCacheAllocator(make_pool(6, page_size=4))  # 4 usable blocks = 16 tokens
    assert alloc.allocate("a", 8)  # 2 blocks
    assert not alloc.allocate("b", 12)  # needs 3, 2 free
    assert alloc.num_free_blocks == 2
    assert "b" not in alloc.block_tables
    assert not alloc.allocate("a", 17)  # needs 3 more, 2 free
    assert len(alloc.block_table("a")) == 2
    assert alloc.num_free_blocks == 2
    assert alloc.allocate("a", 16)
    assert alloc.num_free_blocks == 0


def test_allocator_free_returns_all_blocks():
    alloc = FullAttentionCacheAllocator(make_pool(12, page_size=2))
    assert alloc.allocate("a", 7)  # 4 blocks
    assert alloc.allocate("b", 3)  # 2 blocks
    assert alloc.allocate("a", 9)  # +1
    assert alloc.num_free_blocks == 10 - 7
    a_blocks = set(alloc.block_table("a"))
    assert alloc.free("a") == 5
    assert "a" not in alloc.block_tables
    assert alloc.num_free_blocks == 10 - 2
    assert alloc.free("a") == 0  # freeing twice returns nothing
    assert alloc.num_free_blocks == 8
    assert alloc.free("b") == 2
    assert alloc.num_free_blocks == 10
    # The freed blocks are handed out again.
    assert alloc.allocate("c", 20)
    assert a_blocks <= set(alloc.block_table("c"))


def test_allocator_trim_returns_the_blocks_past_the_kept_tokens():
    alloc = FullAttentionCacheAllocator(make_pool(12, page_size=4), block_sharing=True)
    assert alloc.allocate("a", 13)  # 4 blocks: 3 full + 1 (speculative positions 9..12, say)
    head = alloc.block_table("a")[:3]
    assert alloc.trim("a", 9) == 1 and alloc.block_table("a") == head  # 9 tokens need 3 blocks
    assert alloc.num_free_blocks == 10 - 3
    assert alloc.trim("a", 12) == 0 and alloc.trim("nobody", 3) == 0
    assert alloc.trim("a", 0) == 3 and alloc.num_free_blocks == 10
    assert alloc.free("a") == 0


def test_allocator_blocks_needed_for_unknown_request():
    alloc = FullAttentionCacheAllocator(make_pool(6, page_size=3))
    assert alloc.blocks_needed("nobody", 7) == 3
    assert alloc.blocks_needed("nobody", 0) == 0


# -- property test -----------------------------------------------------------------------------

REQUEST_IDS = ["r0", "r1", "r2", "r3"]
ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.sampled_from(REQUEST_IDS), st.integers(0, 40)),
        st.tuples(st.just("free"), st.sampled_from(REQUEST_IDS), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=50, deadline=None)
@given(num_chunks=st.integers(3, 24), page_size=st.integers(1, 8), ops=ops)
def test_allocator_invariants_under_random_ops(num_chunks, page_size, ops):
    pool = make_pool(num_chunks, page_size)
    alloc = FullAttentionCacheAllocator(pool)
    usable = pool.num_usable
    assert usable == num_chunks - NUM_RESERVED_CHUNKS

    for op, rid, tokens in ops:
        before_table = list(alloc.block_tables.get(rid, []))
        before_free = alloc.num_free_blocks
        if op == "alloc":
            needed = max(ceil_div(tokens, page_size) - len(before_table), 0)
            ok = alloc.allocate(rid, tokens)
            assert ok == (needed <= before_free)
            if ok:
                table = alloc.block_table(rid)
                assert table[: len(before_table)] == before_table  # existing blocks keep their place
                assert len(table) == len(before_table) + needed
                assert alloc.num_free_blocks == before_free - needed
            else:
                assert alloc.block_tables.get(rid, []) == before_table
                assert alloc.num_free_blocks == before_free
        else:
            assert alloc.free(rid) == len(before_table)
            assert rid not in alloc.block_tables
            assert alloc.num_free_blocks == before_free + len(before_table)

        owned = [c for table in alloc.block_tables.values() for c in table]
        assert len(owned) == len(set(owned)), "a chunk is owned by two requests (or twice)"
        assert not RESERVED & set(owned), "a reserved chunk was handed out"
        assert all(NUM_RESERVED_CHUNKS <= c < num_chunks for c in owned)
        assert alloc.num_free_blocks + len(owned) == usable
        assert set(pool._free).isdisjoint(owned)

    for rid in REQUEST_IDS:
        alloc.free(rid)
    assert alloc.num_free_blocks == usable
    assert sorted(pool._free) == list(range(NUM_RESERVED_CHUNKS, num_chunks))


# -- FullAttentionCacheAllocator with block sharing (prefix caching) ---------------------------

def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_new_tokens=8, temperature=0))


def compute(alloc: FullAttentionCacheAllocator, request: Request, end: int) -> None:
    """What a step does for `request`: its tokens up to `end` get slots and K/V; completed blocks are indexed."""
    assert alloc.allocate(request.request_id, end)
    request.num_computed_tokens = end
    alloc.register_full_blocks(request)


def admit(alloc: FullAttentionCacheAllocator, request: Request, end: int | None = None) -> list[int] | None:
    """Scheduler admission: match, then allocate the matched blocks plus the chunk up to `end`."""
    matched = alloc.match_prefix(request)
    start = len(matched) * alloc.page_size
    if not alloc.allocate(request.request_id, end or request.num_tokens, shared=matched):
        return None
    request.num_computed_tokens = start
    return matched


def sharing_allocator(num_chunks: int, page_size: int = 4) -> FullAttentionCacheAllocator:
    return FullAttentionCacheAllocator(make_pool(num_chunks, page_size), block_sharing=True)


def test_disabled_sharing_matches_nothing():
    alloc = FullAttentionCacheAllocator(make_pool(20))
    a = make_request("a", list(range(16)))
    compute(alloc, a, 16)
    assert alloc.match_prefix(make_request("b", list(range(16)) + [99])) == []
    alloc.free("a")
    assert alloc.num_cached_blocks == 0 and alloc.pool.num_free == 18
    check_allocator_invariants(alloc)


def test_tails_need_one_layer_group_and_rings_are_never_shared():
    with pytest.raises(ValueError, match="one layer group"):
        FullAttentionCacheAllocator(make_pool(8), block_sharing=True, num_groups=2, keep_tails=True)
    with pytest.raises(ValueError, match="at least a page"):
        SlidingAttentionCacheAllocator(make_pool(8, page_size=4), window=3, block_sharing=True)
    sliding = SlidingAttentionCacheAllocator(make_pool(8), window=8)
    assert not sliding.block_sharing
    assert sliding.match_prefix(make_request("a", list(range(20)))) == []
    with pytest.raises(ValueError, match="does not share"):
        sliding.allocate("a", 8, shared=[2])


def test_shared_blocks_are_reference_counted_and_cached_when_freed():
    alloc = sharing_allocator(20)  # 18 blocks of 4 tokens
    a = make_request("a", list(range(100, 118)))  # 18 tokens: 4 full blocks + 2 tokens
    compute(alloc, a, 18)
    table_a = list(alloc.block_table("a"))
    b = make_request("b", list(range(100, 112)) + [7, 7, 7])  # shares 3 blocks (12 tokens)
    assert admit(alloc, b) == table_a[:3]
    assert b.num_computed_tokens == 12
    assert alloc.block_table("b")[:3] == table_a[:3] and alloc.block_table("b")[3] not in table_a
    assert [alloc.ref_counts[x] for x in table_a] == [2, 2, 2, 1, 1]
    check_allocator_invariants(alloc)
    # a finishes: its unshared completed block is cached, its partial block goes back to the pool.
    assert alloc.free("a") == 5
    assert alloc.num_cached_blocks == 1 and alloc.prefix_cache.is_cached(table_a[3])
    assert [alloc.ref_counts[x] for x in table_a[:3]] == [1, 1, 1]
    assert alloc.num_free_blocks == 18 - 4
    check_allocator_invariants(alloc)
    alloc.free("b")
    assert alloc.num_cached_blocks == 4 and alloc.num_free_blocks == 18 and not alloc.ref_counts
    check_allocator_invariants(alloc)
    # The whole chain is still matchable, and a match takes blocks out of the cached list.
    c = make_request("c", list(range(100, 118)) + [5])
    assert admit(alloc, c) == table_a[:4]
    assert alloc.num_cached_blocks == 0 and c.num_computed_tokens == 16
    check_allocator_invariants(alloc)


def test_match_leaves_the_last_token_to_compute():
    alloc = sharing_allocator(20)
    prompt = list(range(50, 66))  # exactly 4 blocks
    compute(alloc, make_request("a", prompt), 16)
    assert len(alloc.match_prefix(make_request("same", prompt))) == 3  # (16 - 1) // 4
    assert len(alloc.match_prefix(make_request("plus1", prompt + [1]))) == 4
    assert len(alloc.match_prefix(make_request("short", prompt[:5]))) == 1
    assert alloc.match_prefix(make_request("tiny", prompt[:4])) == []


def test_match_is_longest_chained_prefix():
    alloc = sharing_allocator(20)
    compute(alloc, make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0]), 12)
    # Same second block after a different first block: no match at all (digests are chained).
    assert alloc.match_prefix(make_request("b", [0, 2, 3, 4, 5, 6, 7, 8, 0])) == []
    assert len(alloc.match_prefix(make_request("c", [1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11, 12, 0]))) == 1
    check_allocator_invariants(alloc)


def test_duplicate_prefix_computed_twice_keeps_one_indexed_block():
    alloc = sharing_allocator(20)
    a, b = make_request("a", [3] * 9), make_request("b", [3] * 9)
    assert admit(alloc, a) == [] and admit(alloc, b) == []  # admitted together: nothing computed yet
    for r in (a, b):
        r.num_computed_tokens = 9
        alloc.register_full_blocks(r)
    indexed = [x for x in alloc.block_table("a") + alloc.block_table("b") if alloc.prefix_cache.digest_of(x)]
    assert indexed == alloc.block_table("a")[:2]  # a registered first; b's copies stay private
    check_allocator_invariants(alloc)
    alloc.free("b")
    assert alloc.num_cached_blocks == 0 and alloc.pool.num_free == 18 - 3
    check_allocator_invariants(alloc)


def test_cached_blocks_are_reclaimed_newest_first():
    alloc = sharing_allocator(9)  # 7 blocks of 4
    a = make_request("a", list(range(10, 22)) + [0])  # 3 full blocks + 1 token
    b = make_request("b", list(range(30, 38)) + [0])  # 2 full blocks + 1 token
    compute(alloc, a, 13)
    compute(alloc, b, 9)
    ta, tb = list(alloc.block_table("a")), list(alloc.block_table("b"))
    alloc.free("a")
    alloc.free("b")
    assert list(alloc.prefix_cache._cached) == ta[:3] + tb[:2]  # the order they became cached
    assert alloc.pool.num_free == 2 and alloc.num_free_blocks == 7
    # 4 new blocks: the two uninitialized ones and the two most recently cached (b's, evicted deepest
    # first); the pool hands out the chunks freed last first, so the evicted ones lead.
    assert alloc.allocate("x", 16)
    assert sorted(alloc.block_table("x")) == sorted([ta[3], tb[2]] + tb[:2])
    assert alloc.block_table("x")[:2] == [tb[0], tb[1]]
    assert list(alloc.prefix_cache._cached) == ta[:3]
    assert alloc.match_prefix(make_request("b2", list(range(30, 38)) + [0])) == []  # evicted: no match
    assert alloc.match_prefix(make_request("a2", list(range(10, 22)) + [0])) == ta[:3]
    check_allocator_invariants(alloc)
    assert alloc.allocate("x", 20)  # one more: a's deepest block goes
    assert alloc.match_prefix(make_request("a3", list(range(10, 22)) + [0])) == ta[:2]
    assert not alloc.allocate("x", 32)  # 3 more wanted, 2 reclaimable: nothing changes
    assert list(alloc.prefix_cache._cached) == ta[:2] and len(alloc.block_table("x")) == 5
    check_allocator_invariants(alloc)


def test_admission_never_reclaims_its_own_matched_blocks():
    alloc = sharing_allocator(8)  # 6 blocks of 4
    a = make_request("a", list(range(40, 56)) + [1])  # 4 full blocks
    compute(alloc, a, 17)
    alloc.free("a")
    assert alloc.num_cached_blocks == 4 and alloc.pool.num_free == 2
    # 4 matched (all cached) + 3 new: 6 blocks count as free, but only 2 may be reclaimed for it.
    b = make_request("b", list(range(40, 56)) + [9] * 12)
    before = (list(alloc.prefix_cache._cached), dict(alloc.ref_counts), list(alloc.pool._free))
    assert admit(alloc, b) is None
    assert (list(alloc.prefix_cache._cached), dict(alloc.ref_counts), list(alloc.pool._free)) == before
    assert "b" not in alloc.block_tables and b.num_computed_tokens == 0
    # A smaller chunk fits: 4 matched + 2 new.
    assert admit(alloc, b, end=24) is not None
    assert b.num_computed_tokens == 16 and alloc.num_free_blocks == 0
    check_allocator_invariants(alloc)


def test_shared_blocks_only_start_a_table():
    alloc = sharing_allocator(10)
    compute(alloc, make_request("a", list(range(9))), 9)
    alloc.allocate("b", 1)
    with pytest.raises(ValueError, match="only start a table"):
        alloc.allocate("b", 9, shared=alloc.block_table("a")[:1])


def test_digests_are_computed_once_per_block():
    alloc = sharing_allocator(40)
    r = make_request("r", list(range(3, 35)))  # 8 blocks
    calls = []
    original = r.token_slice
    r.token_slice = lambda s, e: calls.append((s, e)) or original(s, e)
    admit(alloc, r, end=4)
    for end in range(5, 33):
        compute(alloc, r, end)
    assert calls == [(0, 4)] + [(i, i + 4) for i in range(4, 32, 4)]


# -- property test with sharing ----------------------------------------------------------------

# (op, request, argument, number): admissions and computation dominate; frees and evictions interleave.
_rids = st.sampled_from(REQUEST_IDS)
_admit = st.tuples(st.just("admit"), _rids, st.integers(0, 3), st.integers(1, 16))  # sequence, chunk
_compute = st.tuples(st.just("compute"), _rids, st.integers(0, 1), st.integers(1, 16))  # sampled token, chunk
_free = st.tuples(st.just("free"), _rids, st.just(0), st.just(0))
_evict = st.tuples(st.just("evict"), st.just("x"), st.just(0), st.integers(1, 4))  # blocks to reclaim
sharing_ops = st.lists(st.one_of(_admit, _admit, _compute, _compute, _free, _evict), min_size=5, max_size=60)


@st.composite
def shared_prefix_sequences(draw) -> list[list[int]]:
    """Up to 4 token sequences, each a cut of one common stem plus a suffix of its own."""
    stem = draw(st.lists(st.integers(0, 1), min_size=1, max_size=20))
    return [stem[:draw(st.integers(0, len(stem)))] + draw(st.lists(st.integers(0, 1), min_size=1, max_size=6))
            for _ in range(draw(st.integers(1, 4)))]


@settings(max_examples=200, deadline=None)
@given(num_chunks=st.integers(3, 16), page_size=st.integers(1, 4),
       sequences=shared_prefix_sequences(), ops=sharing_ops)
def test_allocator_sharing_invariants_under_random_ops(num_chunks, page_size, sequences, ops):
    """Admit with a matching prefix / compute / free / evict (a fresh request forcing reclaims), in any order.

    A shadow of the cache records which token every slot holds: every computed position of every
    request must read its own token (so a matched block really holds the prefix), new tokens are only
    written into blocks the request alone holds, and no digest is ever left pointing at other content."""
    alloc = sharing_allocator(num_chunks, page_size)
    shadow: dict[tuple[int, int], int] = {}  # (block, offset) -> token written there
    requests: dict[str, Request] = {}

    def snapshot():
        return ({k: list(v) for k, v in alloc.block_tables.items()}, dict(alloc.ref_counts),
                list(alloc.pool._free), list(alloc.prefix_cache._cached), dict(alloc.prefix_cache._block_of))

    def write(r: Request, end: int) -> None:
        table = alloc.block_table(r.request_id)
        for p in range(r.num_computed_tokens, end):
            block = table[p // page_size]
            assert alloc.ref_counts[block] == 1 and alloc.prefix_cache.digest_of(block) is None, \
                "new K/V written into a shared or indexed block"
            shadow[block, p % page_size] = r.token_slice(p, p + 1)[0]
        r.num_computed_tokens = end
        alloc.register_full_blocks(r)

    for op, rid, arg, n in ops:
        before = snapshot()
        if op == "admit" and rid not in requests:
            r = make_request(rid, list(sequences[arg % len(sequences)]))
            matched = alloc.match_prefix(r)
            # Longest chained prefix, capped so the last token is computed.
            digests, parent = [], b""
            for i in range((r.num_tokens - 1) // page_size):
                parent = block_digest(parent, r.token_slice(i * page_size, (i + 1) * page_size))
                digests.append(parent)
            expected = []
            for d in digests:
                if alloc.prefix_cache.lookup(d) is None:
                    break
                expected.append(alloc.prefix_cache.lookup(d))
            assert matched == expected
            assert snapshot() == before, "match_prefix changed something"
            start = len(matched) * page_size
            end = min(start + n, r.num_tokens)
            free_before = alloc.num_free_blocks
            newly_held = sum(alloc.prefix_cache.is_cached(b) for b in matched)
            needed = ceil_div(end, page_size) - len(matched)
            ok = alloc.allocate(rid, end, shared=matched)
            assert ok == (needed <= free_before - newly_held)
            event(f"admission: {'matched' if matched else 'no match'}, {'ok' if ok else 'refused'}")
            if newly_held:
                event("admission matched a cached block")
            if ok:
                requests[rid] = r
                r.num_computed_tokens = start
                assert alloc.block_table(rid)[:len(matched)] == matched
                assert alloc.num_free_blocks == free_before - newly_held - needed
                write(r, end)
            else:
                assert snapshot() == before, "a refused admission changed something"
        elif op in ("admit", "compute") and rid in requests:
            r = requests[rid]
            if r.num_computed_tokens == r.num_tokens:
                r.output_token_ids.append(arg % 2)  # a sampled token, to be computed next
            end = min(r.num_computed_tokens + n, r.num_tokens)
            if alloc.allocate(rid, end):
                write(r, end)
            else:
                assert snapshot() == before
        elif op == "free" and rid in requests:
            held = alloc.block_table(rid)
            assert alloc.free(rid) == len(held)
            del requests[rid]
        elif op == "evict":  # a request with fresh content takes every uninitialized block and `n` more
            cached = list(alloc.prefix_cache._cached)
            if alloc.allocate("x", (alloc.pool.num_free + n) * page_size):
                event("evict reclaimed cached blocks")  # the most recently cached went, digests with them
                assert list(alloc.prefix_cache._cached) == cached[:-n]
                assert all(alloc.prefix_cache.digest_of(b) is None for b in cached[-n:])
                assert set(cached[-n:]) <= set(alloc.block_table("x"))
                check_allocator_invariants(alloc)
                alloc.free("x")  # never computed: its blocks go straight back to the pool
            else:
                assert snapshot() == before
        check_allocator_invariants(alloc)
        for r in requests.values():  # every computed token reads back as itself
            table = alloc.block_table(r.request_id)
            for p in range(r.num_computed_tokens):
                assert shadow.get((table[p // page_size], p % page_size)) == r.token_slice(p, p + 1)[0]
        for block in alloc.prefix_cache._cached:  # cached blocks are complete (all slots written)
            assert all((block, o) in shadow for o in range(page_size))

    for rid in list(requests):
        alloc.free(rid)
    check_allocator_invariants(alloc)
    assert not alloc.ref_counts and alloc.num_free_blocks == alloc.num_total_blocks


# -- sizing --------------------------------------------------------------------------------------

def test_num_blocks_overrides_sizing():
    assert plan_num_chunks(num_blocks=7, max_memory_percent=0.5, bytes_per_chunk=1, activation_bytes=0,
                           max_useful_chunks=100, device=torch.device("cpu")) == 7 + NUM_RESERVED_CHUNKS


def test_pool_is_sized_from_free_memory_after_the_working_memory(tiny_llama, monkeypatch):
    """The pool takes max_memory_percent of what is left once one full pass's working memory (activations,
    logits, index tensors, and prefill attention's: whole scores and masks where the backend builds them, a
    context's laid-out K/V for the native kernels) is set aside; too little memory is a clear error."""
    free = 32 << 20
    monkeypatch.setattr(cache_pool, "available_memory", lambda device: free)
    per_chunk = CachePool.bytes_per_chunk(16, 2, 2, 16, torch.float32)  # page 16, 2 layers, 2 kv heads, dim 16
    working = {}
    for backend in ("torch", "auto"):
        config = ContinuousBatchingConfig(max_memory_percent=0.5, attention_backend=backend)
        engine = LLM(tiny_llama.path, dtype="float32", config=config).engine
        dense = engine.runner.attention.dense_scores
        working[dense] = working_memory_bytes(engine.model, config, torch.float32, dense)
        assert engine.pool.num_chunks == int((free - working[dense]) * 0.5) // per_chunk
    assert 8 << 20 < working[True] < free  # attention scores of 512 queries x 512 keys x 4 heads dominate
    if False in working:  # the native kernels (they build here): blocks of scores, never a chunk's whole
        assert working[True] - working[False] > 2 * 4 * 512 * 512 * 4
    bigger = ContinuousBatchingConfig(max_batch_tokens=1024, max_requests_per_batch=128)
    assert working_memory_bytes(engine.model, bigger, torch.float32) > working[True]
    assert working_memory_bytes(engine.model, bigger, torch.float32, False) > working_memory_bytes(
        engine.model, ContinuousBatchingConfig(), torch.float32, False)
    config = ContinuousBatchingConfig(max_memory_percent=0.5, attention_backend="torch")
    # room for 2 chunks: only the reserved ones
    monkeypatch.setattr(cache_pool, "available_memory", lambda device: working[True] + 4 * per_chunk)
    with pytest.raises(MemoryError, match="not enough free memory for a KV cache"):
        LLM(tiny_llama.path, dtype="float32", config=config)
