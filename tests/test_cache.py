"""Unit and property tests of the KV pool (`CachePool`) and `FullAttentionCacheAllocator`."""

from __future__ import annotations

import torch
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.allocator import FullAttentionCacheAllocator
from conveyor.cache_pool import NUM_RESERVED_CHUNKS, CachePool

RESERVED = set(range(NUM_RESERVED_CHUNKS))


def make_pool(num_chunks: int, page_size: int = 4) -> CachePool:
    return CachePool(num_chunks, page_size, num_layers=1, num_kv_heads=1, head_dim=1,
                     dtype=torch.float32, device=torch.device("cpu"))


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


# -- FullAttentionCacheAllocator ---------------------------------------------------------------

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
