"""Unit tests of the schedulers (FIFO / prefill-first), the engine config and offload victim choice.

No model: the tests drive `schedule()` themselves, the way the engine does. After a step every chunk
adds its `num_tokens` to `num_computed_tokens` (and, with block sharing, its completed blocks are
indexed); a request whose whole sequence is in the cache gets a fake sampled token and becomes
DECODING; one with `max_new_tokens` outputs is removed.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.cache.allocator import FullAttentionCacheAllocator
from conveyor.cache.offload import choose_victims
from conveyor.cache.pool import NUM_RESERVED_CHUNKS, CachePool
from conveyor.config import ConfigError, ContinuousBatchingConfig, with_vllm_engine_args
from conveyor.request import Request, RequestState
from conveyor.sampling_params import SamplingParams
from conveyor.sched.output import SchedulerOutput
from conveyor.sched.scheduler import FIFOScheduler, PrefillFirstScheduler, Scheduler, make_scheduler

from tests.utils import check_allocator_invariants

FAKE_TOKEN = 7


# -- helpers -----------------------------------------------------------------------------------

def make_scheduler_for(num_blocks: int, page_size: int = 4, cls: type[Scheduler] | None = None,
                       block_sharing: bool = False, **config) -> Scheduler:
    cfg = ContinuousBatchingConfig(page_size=page_size, num_blocks=num_blocks, **config)
    pool = CachePool(num_blocks + NUM_RESERVED_CHUNKS, page_size, num_layers=1, num_kv_heads=1, head_dim=1,
                     dtype=torch.float32, device=torch.device("cpu"))
    allocator = FullAttentionCacheAllocator(pool, block_sharing=block_sharing)
    return cls(cfg, allocator) if cls is not None else make_scheduler(cfg, allocator)


def make_request(rid: str, prompt_len: int, max_new_tokens: int = 4, prompt: list[int] | None = None) -> Request:
    """Prompts are `1, 2, ..., prompt_len` unless given: any two share their shorter one as a prefix."""
    return Request(rid, prompt or list(range(1, prompt_len + 1)),
                   SamplingParams(max_new_tokens=max_new_tokens, temperature=0))


def apply_step(sched: Scheduler, out: SchedulerOutput) -> list[Request]:
    """What the engine does after a forward pass; returns the requests that finished."""
    finished = []
    for chunk in out.chunks:
        r = chunk.request
        r.num_computed_tokens += chunk.num_tokens
        assert r.num_computed_tokens <= r.num_tokens
        sched.allocator.register_full_blocks(r)
        if r.num_computed_tokens == r.num_tokens:
            r.output_token_ids.append(FAKE_TOKEN)
            r.state = RequestState.DECODING
            if len(r.output_token_ids) >= r.params.max_new_tokens:
                sched.remove(r)
                r.state = RequestState.FINISHED
                finished.append(r)
    return finished


def chunk_sizes(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(c.request.request_id, c.num_tokens) for c in out.chunks]


def pages_read(out: SchedulerOutput, page_size: int) -> int:
    return sum(math.ceil((c.request.num_computed_tokens + c.num_tokens) / page_size) for c in out.chunks)


def owned_blocks(sched: Scheduler) -> int:
    """Blocks held by any request (a shared block counts once)."""
    return len({b for t in sched.allocator.block_tables.values() for b in t})


def soft_reset(sched: Scheduler, request: Request) -> None:
    """The engine's offload path (Engine._soft_reset)."""
    sched.allocator.free(request.request_id)
    sched.requeue_front(request)
    request.num_computed_tokens = 0
    request.state = RequestState.PENDING


def run_until_state(sched: Scheduler, request: Request, state: RequestState, limit: int = 100) -> None:
    for _ in range(limit):
        if request.state is state:
            return
        apply_step(sched, sched.schedule())
    raise AssertionError(f"{request.request_id} never reached {state}")


# -- random simulation: budgets, order, liveness -----------------------------------------------

@st.composite
def workloads(draw, tight: bool):
    page_size = draw(st.integers(1, 8))
    reqs = draw(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 6), st.integers(0, 8)),
                         min_size=1, max_size=8))
    blocks_per_req = [math.ceil((p + m) / page_size) for p, m, _ in reqs]
    biggest = max(blocks_per_req)
    if tight:  # every request fits alone, not necessarily together: stalls and offload happen
        num_blocks = draw(st.integers(biggest, biggest + 4))
    else:  # everything fits at once: nothing may ever stall
        num_blocks = sum(blocks_per_req) + draw(st.integers(0, 4))
    config = dict(
        max_batch_tokens=draw(st.integers(1, 64)),
        max_requests_per_batch=draw(st.integers(1, 8)),
        # The engine rejects requests that need more pages than max_batch_pages.
        max_batch_pages=draw(st.none() | st.integers(biggest, biggest + 12)),
        scheduler_type=draw(st.sampled_from(["fifo", "prefill_first"])),
        safety_margin=draw(st.none() | st.sampled_from([0.0, 0.1, 0.15, 0.3, 0.6, 0.9])),
    )
    return page_size, num_blocks, config, reqs


def simulate(page_size: int, num_blocks: int, config: dict, reqs: list[tuple[int, int, int]],
             offload: bool, share: bool = False) -> dict:
    sched = make_scheduler_for(num_blocks, page_size, block_sharing=share, **config)
    cfg, alloc = sched.config, sched.allocator
    usable = alloc.num_total_blocks
    assert alloc.num_free_blocks == usable == num_blocks
    page_budget = cfg.max_batch_pages or usable
    decode_first = cfg.scheduler_type == "fifo"

    requests = [make_request(f"r{i}", p, m) for i, (p, m, _) in enumerate(reqs)]
    arrivals = sorted(range(len(reqs)), key=lambda i: reqs[i][2])  # stable: same step -> list order
    arrival_rank = {requests[i].request_id: k for k, i in enumerate(arrivals)}
    first_start: dict[str, int] = {}
    num_stalls = 0
    hit_tokens = 0
    finished: list[Request] = []

    def checked_schedule(step: int) -> SchedulerOutput:
        active_before = list(sched.active)
        states = {r.request_id: r.state for r in active_before}
        waiting_before = list(sched.waiting)
        out = sched.schedule()

        ids = [c.request.request_id for c in out.chunks]
        assert len(ids) == len(set(ids)), "a request scheduled twice in one pass"
        # The three budgets.
        assert out.num_tokens <= cfg.max_batch_tokens
        assert len(out.chunks) <= cfg.max_requests_per_batch
        assert pages_read(out, page_size) <= page_budget
        for c in out.chunks:
            r = c.request
            assert 1 <= c.num_tokens <= r.num_remaining_tokens
            assert len(alloc.block_table(r.request_id)) >= math.ceil((r.num_computed_tokens + c.num_tokens) / page_size)
        # Order: active requests by category (scheduler-specific), then new ones in queue order.
        keys = []
        for c in out.chunks:
            rid = c.request.request_id
            if rid in states:
                decoding = states[rid] is RequestState.DECODING
                category = (0 if decoding else 1) if decode_first else (1 if decoding else 0)
                keys.append((category, active_before.index(c.request)))
            else:
                keys.append((2, 0))
        assert keys == sorted(keys), f"chunks out of order: {keys}"
        admitted = [c.request for c in out.chunks if c.request.request_id not in states]
        assert admitted == waiting_before[: len(admitted)], "waiting requests admitted out of order"
        for r in admitted:
            first_start.setdefault(r.request_id, step)
            assert r.state is RequestState.PREFILLING
            # A cached prefix is whole blocks, and the last token is always left to compute.
            assert r.num_computed_tokens % page_size == 0 and r.num_computed_tokens < r.num_tokens
            assert share or r.num_computed_tokens == 0
        assert list(sched.waiting) == waiting_before[len(admitted):]
        assert out.prefix_cache_hit_tokens == sum(r.num_computed_tokens for r in admitted)
        assert out.prefix_cache_query_tokens == (sum(r.num_tokens for r in admitted) if share else 0)
        nonlocal hit_tokens
        hit_tokens += out.prefix_cache_hit_tokens
        return out

    pending = list(arrivals)
    step = 0
    max_steps = 50 * sum(p + m for p, m, _ in reqs) + 100
    while pending or sched.has_work():
        assert step < max_steps, "simulation did not finish: scheduler livelock"
        while pending and reqs[pending[0]][2] <= step:
            sched.add_request(requests[pending.pop(0)])
        if not sched.has_work():
            step += 1
            continue
        out = checked_schedule(step)
        while out.stalled:  # Engine._schedule
            num_stalls += 1
            assert offload, f"stalled with an ample pool: {[(r.request_id, n) for r, n in out.stalled]}"
            for r, n in out.stalled:
                assert n >= 1
                assert r in sched.active
            scheduled = {c.request.request_id for c in out.chunks}
            victims = choose_victims(sched.active, scheduled, out.stalled, alloc)
            for v in victims:
                assert v.request_id not in scheduled
                soft_reset(sched, v)
            assert sched.active, "offload took the last active request"
            if out.chunks or not victims:
                break
            out = checked_schedule(step)
        assert out.chunks, "no progress: nothing scheduled while work remains"
        finished += apply_step(sched, out)
        # Cache bookkeeping after every step.
        assert set(alloc.block_tables) <= {r.request_id for r in sched.active}
        assert alloc.num_free_blocks + owned_blocks(sched) == usable
        check_allocator_invariants(alloc)
        for r in sched.active:
            assert len(alloc.block_tables[r.request_id]) >= math.ceil(r.num_computed_tokens / page_size)
        step += 1

    assert sorted(r.request_id for r in finished) == sorted(r.request_id for r in requests)
    for r, (_, m, _) in zip(requests, reqs):
        assert r.output_token_ids == [FAKE_TOKEN] * m
    assert alloc.num_free_blocks == usable
    assert alloc.block_tables == {}
    check_allocator_invariants(alloc)
    # A later request never starts before an earlier one.
    starts = [first_start[rid] for rid in sorted(first_start, key=arrival_rank.get)]
    assert starts == sorted(starts)
    assert len(starts) == len(requests)
    return {"stalls": num_stalls, "steps": step, "hit_tokens": hit_tokens}


@settings(max_examples=50, deadline=None)
@given(workloads(tight=False))
def test_random_workload_ample_pool(workload):
    simulate(*workload, offload=False)


@settings(max_examples=50, deadline=None)
@given(workloads(tight=True))
def test_random_workload_tight_pool_with_offload(workload):
    simulate(*workload, offload=True)


@settings(max_examples=50, deadline=None)
@given(workloads(tight=False))
def test_random_workload_ample_pool_with_block_sharing(workload):
    # Every prompt is a prefix of the longer ones: later requests reuse blocks of earlier ones.
    simulate(*workload, offload=False, share=True)


@settings(max_examples=50, deadline=None)
@given(workloads(tight=True))
def test_random_workload_tight_pool_with_block_sharing(workload):
    simulate(*workload, offload=True, share=True)


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("scheduler_type", ["fifo", "prefill_first"])
def test_seeded_workload_really_stalls_and_finishes(scheduler_type, share):
    # A fixed workload that must go through stalls and offloading, so the simulation's stall path is exercised.
    reqs = [(10, 6, 0), (12, 6, 0), (9, 6, 1), (11, 6, 1), (8, 6, 2)]
    stats = simulate(4, 5, dict(max_batch_tokens=8, max_requests_per_batch=4, max_batch_pages=None,
                                scheduler_type=scheduler_type, safety_margin=0.0), reqs, offload=True, share=share)
    assert stats["stalls"] > 0
    assert (stats["hit_tokens"] > 0) == share


# -- FIFO order --------------------------------------------------------------------------------

def _activate(sched: Scheduler, request: Request, computed: int, decoding: bool) -> None:
    """Put `request` in the active list as if it had run: `computed` tokens cached (and one sampled)."""
    if decoding:
        request.output_token_ids.append(FAKE_TOKEN)
        request.state = RequestState.DECODING
    else:
        request.state = RequestState.PREFILLING
    request.num_computed_tokens = computed
    assert sched.allocator.allocate(request.request_id, computed)
    sched.active.append(request)


def _mixed_active(cls):
    sched = make_scheduler_for(64, page_size=4, cls=cls, max_batch_tokens=64, safety_margin=0.0)
    p1 = make_request("p1", 30)
    _activate(sched, p1, 10, decoding=False)  # active prefill, first in the active list
    d1 = make_request("d1", 5)
    _activate(sched, d1, 5, decoding=True)
    p2 = make_request("p2", 20)
    _activate(sched, p2, 4, decoding=False)
    d2 = make_request("d2", 3)
    _activate(sched, d2, 3, decoding=True)
    for rid in ("n1", "n2"):
        sched.add_request(make_request(rid, 3))
    return sched


def test_fifo_decodes_then_prefills_then_new():
    sched = _mixed_active(FIFOScheduler)
    out = sched.schedule()
    assert chunk_sizes(out) == [("d1", 1), ("d2", 1), ("p1", 20), ("p2", 16), ("n1", 3), ("n2", 3)]
    assert not out.stalled


def test_prefill_first_orders_prefills_before_decodes():
    sched = _mixed_active(PrefillFirstScheduler)
    out = sched.schedule()
    assert chunk_sizes(out) == [("p1", 20), ("p2", 16), ("d1", 1), ("d2", 1), ("n1", 3), ("n2", 3)]


def test_prefill_first_budget_goes_to_prefill_first():
    # With a token budget that a prefill can eat, prefill-first starves the decode for a step; FIFO does not.
    for cls, expected in [(FIFOScheduler, [("d", 1), ("p", 7)]), (PrefillFirstScheduler, [("p", 8)])]:
        sched = make_scheduler_for(32, cls=cls, max_batch_tokens=8, safety_margin=0.0)
        _activate(sched, make_request("d", 4), 4, decoding=True)
        _activate(sched, make_request("p", 40), 8, decoding=False)
        assert chunk_sizes(sched.schedule()) == expected


def test_fifo_admits_in_arrival_order_head_of_line_blocks():
    sched = make_scheduler_for(16, page_size=4, max_batch_tokens=6, max_requests_per_batch=8, safety_margin=0.0)
    a, b, c = make_request("a", 4), make_request("b", 5), make_request("c", 1)
    for r in (a, b, c):
        sched.add_request(r)
    out = sched.schedule()
    # a takes 4 tokens; b gets the remaining 2 (chunked) rather than c jumping ahead with its 1.
    assert chunk_sizes(out) == [("a", 4), ("b", 2)]
    assert list(sched.waiting) == [c]
    assert c.state is RequestState.PENDING
    assert c.metrics.first_scheduled_time is None
    assert a.metrics.first_scheduled_time is not None
    apply_step(sched, out)
    out = sched.schedule()
    assert chunk_sizes(out) == [("a", 1), ("b", 3), ("c", 1)]


def test_fifo_request_limit_keeps_later_requests_waiting():
    sched = make_scheduler_for(16, max_batch_tokens=100, max_requests_per_batch=2, safety_margin=0.0)
    reqs = [make_request(f"r{i}", 2) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    assert [c.request for c in out.chunks] == reqs[:2]
    assert list(sched.waiting) == reqs[2:]


# -- chunking ----------------------------------------------------------------------------------

@pytest.mark.parametrize("cls", [FIFOScheduler, PrefillFirstScheduler])
def test_long_prompt_is_chunked_and_samples_after_last_chunk(cls):
    sched = make_scheduler_for(32, page_size=4, cls=cls, max_batch_tokens=16)
    r = make_request("long", 100, max_new_tokens=3)
    sched.add_request(r)
    sizes = []
    while not r.output_token_ids:
        out = sched.schedule()
        assert [c.request for c in out.chunks] == [r]
        sizes.append(out.chunks[0].num_tokens)
        assert r.state is RequestState.PREFILLING
        apply_step(sched, out)
        if r.num_computed_tokens < 100:
            assert r.output_token_ids == []  # no sample before the prompt is fully cached
        assert len(sched.allocator.block_table("long")) == math.ceil(r.num_computed_tokens / 4)
    assert sizes == [16, 16, 16, 16, 16, 16, 4]
    assert r.num_computed_tokens == 100
    assert r.state is RequestState.DECODING
    # Then one token per step.
    out = sched.schedule()
    assert chunk_sizes(out) == [("long", 1)]


def test_prefill_chunk_shrinks_by_number_of_decodes():
    sched = make_scheduler_for(64, page_size=4, max_batch_tokens=16, safety_margin=0.0)
    decoders = [make_request(f"d{i}", 2, max_new_tokens=50) for i in range(3)]
    for d in decoders:
        sched.add_request(d)
    apply_step(sched, sched.schedule())  # all three prefilled in one pass (6 tokens)
    assert all(d.state is RequestState.DECODING for d in decoders)
    long = make_request("long", 100, max_new_tokens=2)
    sched.add_request(long)
    sizes = []
    while not long.output_token_ids:
        out = sched.schedule()
        assert [c.num_tokens for c in out.chunks[:3]] == [1, 1, 1]
        assert out.chunks[3].request is long
        sizes.append(out.chunks[3].num_tokens)
        assert out.num_tokens <= 16
        apply_step(sched, out)
    assert sizes == [13] * 7 + [9]


# -- safety margin -----------------------------------------------------------------------------

def _margin_setup(margin):
    # 10 blocks of 4 tokens; the active request holds 9 of them -> free fraction 0.1.
    sched = make_scheduler_for(10, page_size=4, max_batch_tokens=64, safety_margin=margin)
    big = make_request("big", 33, max_new_tokens=3)
    sched.add_request(big)
    apply_step(sched, sched.schedule())
    assert len(sched.allocator.block_table("big")) == 9
    assert sched.allocator.num_free_blocks == 1
    small = make_request("small", 2)
    sched.add_request(small)
    return sched, big, small


def test_safety_margin_holds_back_new_requests():
    sched, big, small = _margin_setup(0.15)
    out = sched.schedule()
    assert chunk_sizes(out) == [("big", 1)]
    assert list(sched.waiting) == [small]
    assert sched.allocator.num_free_blocks == 1


def test_safety_margin_zero_admits():
    sched, big, small = _margin_setup(0.0)
    out = sched.schedule()
    assert chunk_sizes(out) == [("big", 1), ("small", 2)]
    assert sched.allocator.num_free_blocks == 0


def test_safety_margin_is_strictly_below():
    sched, big, small = _margin_setup(0.1)  # free fraction == margin: not below, so admitted
    assert chunk_sizes(sched.schedule()) == [("big", 1), ("small", 2)]


def test_safety_margin_does_not_block_an_idle_engine():
    sched = make_scheduler_for(4, page_size=4, safety_margin=0.9)
    r = make_request("r", 16)  # takes the whole pool
    sched.add_request(r)
    assert chunk_sizes(sched.schedule()) == [("r", 16)]


def test_fifo_default_margin_holds_back_prefill_first_does_not():
    for scheduler_type, admitted in [("fifo", False), ("prefill_first", True)]:
        sched = make_scheduler_for(10, page_size=4, max_batch_tokens=64, scheduler_type=scheduler_type)
        sched.add_request(make_request("big", 33))
        apply_step(sched, sched.schedule())
        sched.add_request(make_request("small", 2))
        assert (("small", 2) in chunk_sizes(sched.schedule())) is admitted


# -- admission and stalls ----------------------------------------------------------------------

def test_admission_is_all_or_nothing():
    sched = make_scheduler_for(4, page_size=4, max_batch_tokens=64, safety_margin=0.0)
    a = make_request("a", 7, max_new_tokens=5)
    sched.add_request(a)
    apply_step(sched, sched.schedule())  # a: 7 tokens cached + 1 sampled = 8 -> 2 blocks, decode fits
    assert sched.allocator.num_free_blocks == 2
    b = make_request("b", 12)  # its chunk needs 3 blocks, 2 are free
    c = make_request("c", 1)
    sched.add_request(b)
    sched.add_request(c)
    out = sched.schedule()
    assert chunk_sizes(out) == [("a", 1)]
    assert not out.stalled  # waiting requests are never reported as stalled
    assert sched.allocator.num_free_blocks == 2
    assert "b" not in sched.allocator.block_tables
    assert b.state is RequestState.PENDING
    assert list(sched.waiting) == [b, c]  # and c does not jump the queue
    assert sched.active == [a]


def test_decode_needing_a_block_with_empty_pool_is_stalled():
    sched = make_scheduler_for(2, page_size=4, max_batch_tokens=64, safety_margin=0.0)
    a, b = make_request("a", 4), make_request("b", 4)
    sched.add_request(a)
    sched.add_request(b)
    apply_step(sched, sched.schedule())
    assert sched.allocator.num_free_blocks == 0
    assert a.num_tokens == b.num_tokens == 5  # the 5th token needs a second block each
    out = sched.schedule()
    assert out.chunks == []
    assert [(r.request_id, n) for r, n in out.stalled] == [("a", 1), ("b", 1)]
    assert sched.allocator.num_free_blocks == 0
    assert len(sched.allocator.block_table("a")) == len(sched.allocator.block_table("b")) == 1
    # Freeing one request un-stalls the other.
    sched.remove(b)
    out = sched.schedule()
    assert chunk_sizes(out) == [("a", 1)]
    assert not out.stalled


def test_decode_without_new_block_is_not_stalled_by_empty_pool():
    sched = make_scheduler_for(1, page_size=4, max_batch_tokens=64)
    a = make_request("a", 2)
    sched.add_request(a)
    apply_step(sched, sched.schedule())
    assert sched.allocator.num_free_blocks == 0
    out = sched.schedule()  # token 3 fits in the block a already holds
    assert chunk_sizes(out) == [("a", 1)]
    assert not out.stalled


def test_running_prefill_shrinks_to_room_then_stalls():
    sched = make_scheduler_for(6, page_size=4, max_batch_tokens=8, safety_margin=0.0)
    hog = make_request("hog", 8, max_new_tokens=10)
    sched.add_request(hog)
    apply_step(sched, sched.schedule())  # hog: 2 blocks (+ decode will need a third at token 9)
    p = make_request("p", 40)
    sched.add_request(p)
    out = sched.schedule()  # hog decode takes block 3; p admitted with 7 tokens -> 2 blocks
    assert chunk_sizes(out) == [("hog", 1), ("p", 7)]
    apply_step(sched, out)
    assert sched.allocator.num_free_blocks == 1
    out = sched.schedule()  # p may only grow to (2 + 1) * 4 = 12 tokens: a chunk of 5
    assert chunk_sizes(out) == [("hog", 1), ("p", 5)]
    apply_step(sched, out)
    assert sched.allocator.num_free_blocks == 0
    out = sched.schedule()  # p has no room at all now: stalled asking for one block
    assert chunk_sizes(out) == [("hog", 1)]
    assert [(r.request_id, n) for r, n in out.stalled] == [("p", 1)]


def test_page_budget_skips_without_stalling():
    # max_batch_pages=5: a's decode reads 3 pages, b's would read 3 more -> b waits a step, unstalled.
    sched = make_scheduler_for(32, page_size=4, max_batch_tokens=64, max_batch_pages=5, safety_margin=0.0)
    a, b = make_request("a", 9), make_request("b", 9)
    _activate(sched, a, 9, decoding=True)
    _activate(sched, b, 9, decoding=True)
    d = make_request("d", 12)  # would read 3 pages, only 2 left
    sched.add_request(d)
    free = sched.allocator.num_free_blocks
    out = sched.schedule()
    assert chunk_sizes(out) == [("a", 1)]
    assert pages_read(out, 4) == 3
    assert not out.stalled
    assert list(sched.waiting) == [d]
    assert sched.allocator.num_free_blocks == free
    apply_step(sched, out)
    sched.remove(a)
    out = sched.schedule()
    assert chunk_sizes(out) == [("b", 1)]  # 3 pages; d's 3 more would exceed 5
    assert list(sched.waiting) == [d]


# -- config ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    dict(page_size=0),
    dict(page_size=-4),
    dict(max_batch_tokens=0),
    dict(max_requests_per_batch=0),
    dict(num_blocks=0),
    dict(max_batch_pages=0),
    dict(max_memory_percent=0),
    dict(max_memory_percent=0.0),
    dict(max_memory_percent=1.5),
    dict(scheduler_type="lifo"),
    dict(scheduler_type="FIFO"),
    dict(safety_margin=1.0),
    dict(safety_margin=-0.1),
    dict(scheduler_type="prefill_first", safety_margin=1.0),
    dict(cpu_offload_space=-1.0),
])
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError) as info:
        ContinuousBatchingConfig(**kwargs)
    assert isinstance(info.value, ConfigError)


def test_config_accepts_edge_values():
    cfg = ContinuousBatchingConfig(page_size=1, max_memory_percent=1.0, safety_margin=0.0, num_blocks=1,
                                   max_batch_pages=1)
    assert cfg.safety_margin == 0.0
    assert ContinuousBatchingConfig(safety_margin=0.99).safety_margin == 0.99


def test_config_safety_margin_defaults():
    assert ContinuousBatchingConfig().safety_margin == 0.15
    assert ContinuousBatchingConfig(scheduler_type="fifo").safety_margin == 0.15
    assert ContinuousBatchingConfig(scheduler_type="prefill_first").safety_margin == 0.0
    assert ContinuousBatchingConfig(scheduler_type="prefill_first", safety_margin=0.2).safety_margin == 0.2


def test_make_scheduler_picks_the_type():
    assert type(make_scheduler_for(4, scheduler_type="fifo")) is FIFOScheduler
    assert type(make_scheduler_for(4, scheduler_type="prefill_first")) is PrefillFirstScheduler


# -- choose_victims ----------------------------------------------------------------------------

def _victim_setup(blocks: list[int]):
    """Active requests r0 (oldest) .. rN (newest), holding the given numbers of blocks."""
    sched = make_scheduler_for(64, page_size=1, safety_margin=0.0)
    active = []
    for i, n in enumerate(blocks):
        r = make_request(f"r{i}", n)
        _activate(sched, r, n, decoding=True)
        active.append(r)
    return sched, active


def _ids(victims):
    return [v.request_id for v in victims]


def test_victims_newest_first_and_stop_when_enough():
    sched, active = _victim_setup([2, 2, 2, 2])
    stalled = [(active[0], 1)]
    assert _ids(choose_victims(sched.active, set(), stalled, sched.allocator)) == ["r3"]
    assert _ids(choose_victims(sched.active, set(), [(active[0], 2)], sched.allocator)) == ["r3"]
    assert _ids(choose_victims(sched.active, set(), [(active[0], 3)], sched.allocator)) == ["r3", "r2"]
    assert _ids(choose_victims(sched.active, set(), [(active[0], 4)], sched.allocator)) == ["r3", "r2"]
    assert _ids(choose_victims(sched.active, set(), [(active[0], 5)], sched.allocator)) == ["r3", "r2", "r1"]


def test_victims_skip_scheduled_requests():
    sched, active = _victim_setup([2, 2, 2, 2])
    stalled = [(active[0], 3)]
    assert _ids(choose_victims(sched.active, {"r3"}, stalled, sched.allocator)) == ["r2", "r1"]
    assert _ids(choose_victims(sched.active, {"r3", "r1"}, stalled, sched.allocator)) == ["r2", "r0"]


def test_victims_never_take_the_last_active_request():
    sched, active = _victim_setup([1, 1, 1])
    # Needs far more than anyone holds: every request but one goes, the oldest stays.
    assert _ids(choose_victims(sched.active, set(), [(active[0], 100)], sched.allocator)) == ["r2", "r1"]
    sched1, active1 = _victim_setup([3])
    assert choose_victims(sched1.active, set(), [(active1[0], 1)], sched1.allocator) == []
    # The survivor may be a scheduled one; then the oldest unscheduled can go.
    assert _ids(choose_victims(sched.active, {"r2"}, [(active[0], 100)], sched.allocator)) == ["r1", "r0"]


def test_victim_that_is_itself_stalled_drops_its_need():
    sched, active = _victim_setup([1, 1, 1])
    # r2 (newest) is stalled: offloading it removes its own need, so nothing more is taken.
    assert _ids(choose_victims(sched.active, set(), [(active[2], 5)], sched.allocator)) == ["r2"]


def test_victims_sum_needs_of_all_stalled():
    sched, active = _victim_setup([1, 1, 1, 1, 1])
    stalled = [(active[0], 1), (active[1], 1)]
    assert _ids(choose_victims(sched.active, set(), stalled, sched.allocator)) == ["r4", "r3"]


def test_no_victims_without_stalls():
    sched, active = _victim_setup([2, 2])
    assert choose_victims(sched.active, set(), [], sched.allocator) == []


# -- admission with prefix caching -------------------------------------------------------------

def _finished_sharer(sched: Scheduler, prompt_len: int) -> Request:
    """Run a request with prompt 1..prompt_len to the end: its completed blocks stay cached."""
    a = make_request("a", prompt_len, max_new_tokens=1)
    sched.add_request(a)
    while not a.is_finished:
        apply_step(sched, sched.schedule())
    return a


def test_admission_skips_the_cached_prefix():
    sched = make_scheduler_for(32, page_size=4, max_batch_tokens=64, safety_margin=0.0, block_sharing=True)
    a = make_request("a", 18, max_new_tokens=10)
    sched.add_request(a)
    apply_step(sched, sched.schedule())  # a: 18 tokens computed, 4 full blocks indexed
    b = make_request("b", 0, prompt=list(range(1, 13)) + [50, 51, 52])  # shares a's first 3 blocks
    sched.add_request(b)
    out = sched.schedule()
    assert chunk_sizes(out) == [("a", 1), ("b", 3)]
    assert b.num_computed_tokens == 12 and b.state is RequestState.PREFILLING
    assert (out.prefix_cache_query_tokens, out.prefix_cache_hit_tokens) == (15, 12)
    assert sched.allocator.block_table("b")[:3] == sched.allocator.block_table("a")[:3]
    assert sched.allocator.block_table("b")[3] not in sched.allocator.block_table("a")
    apply_step(sched, out)
    assert b.output_token_ids == [FAKE_TOKEN]  # its prompt is complete: it samples after one chunk


def test_whole_cached_prompt_still_computes_its_last_block():
    sched = make_scheduler_for(32, page_size=4, max_batch_tokens=64, block_sharing=True)
    _finished_sharer(sched, 16)
    again = make_request("again", 16)  # exactly 4 blocks, all cached: the last one is recomputed
    sched.add_request(again)
    out = sched.schedule()
    assert chunk_sizes(out) == [("again", 4)] and again.num_computed_tokens == 12
    assert (out.prefix_cache_query_tokens, out.prefix_cache_hit_tokens) == (16, 12)
    longer = make_request("longer", 17)  # 4 cached blocks + 1 token
    sched.add_request(longer)
    out = sched.schedule()
    assert ("longer", 1) in chunk_sizes(out) and longer.num_computed_tokens == 16


def test_admission_with_a_cached_prefix_is_all_or_nothing():
    sched = make_scheduler_for(8, page_size=4, max_batch_tokens=64, safety_margin=0.0, block_sharing=True)
    _finished_sharer(sched, 16)  # 4 blocks cached, 4 uninitialized
    alloc = sched.allocator
    hog = make_request("hog", 12, max_new_tokens=50, prompt=[90] * 12)
    sched.add_request(hog)
    apply_step(sched, sched.schedule())  # hog takes 3 uninitialized blocks (then its decode needs a 4th)
    assert (alloc.pool.num_free, alloc.num_cached_blocks) == (1, 4)
    b = make_request("b", 0, prompt=list(range(1, 17)) + [60] * 12)  # 4 cached blocks + 3 new
    sched.add_request(b)
    cached_before = list(alloc.prefix_cache._cached)
    out = sched.schedule()
    # 5 blocks count as free, but 4 of them are b's own prefix: hog's decode takes the 5th, b waits.
    assert chunk_sizes(out) == [("hog", 1)]
    assert list(sched.waiting) == [b] and b.num_computed_tokens == 0 and "b" not in alloc.block_tables
    assert list(alloc.prefix_cache._cached) == cached_before  # b's matched blocks were not taken either
    assert not set(cached_before) & alloc.ref_counts.keys()
    check_allocator_invariants(alloc)


def test_page_budget_counts_shared_pages():
    sched = make_scheduler_for(32, page_size=4, max_batch_tokens=64, max_batch_pages=5, safety_margin=0.0,
                               block_sharing=True)
    _finished_sharer(sched, 13)  # 3 full blocks cached
    d = make_request("d", 0, max_new_tokens=10, prompt=[60] * 5)
    _activate(sched, d, 5, decoding=True)  # its decode reads 2 pages, leaving 3
    b = make_request("b", 0, prompt=list(range(1, 13)) + [70])  # 3 shared pages + 1 new
    sched.add_request(b)
    out = sched.schedule()
    assert chunk_sizes(out) == [("d", 1)]  # b would read 4 pages, though it needs only 1 new block
    assert list(sched.waiting) == [b] and b.num_computed_tokens == 0
    sched.remove(d)
    out = sched.schedule()
    assert chunk_sizes(out) == [("b", 1)] and pages_read(out, 4) == 4


def test_cached_blocks_count_as_free_for_the_safety_margin():
    sched = make_scheduler_for(10, page_size=4, max_batch_tokens=64, safety_margin=0.5, block_sharing=True)
    _finished_sharer(sched, 33)  # 8 of 10 blocks cached
    alloc = sched.allocator
    assert alloc.pool.num_free == 2 and alloc.num_free_blocks == 10
    big = make_request("big", 8, max_new_tokens=10, prompt=[80] * 8)
    sched.add_request(big)
    apply_step(sched, sched.schedule())  # big holds 2 (3 after its next decode) of 10: 80% still free
    small = make_request("small", 2, prompt=[81, 82])
    sched.add_request(small)
    assert chunk_sizes(sched.schedule()) == [("big", 1), ("small", 2)]
    assert alloc.num_cached_blocks == 6  # the 2 new blocks came from the cached ones, newest first
    check_allocator_invariants(alloc)


# -- priority scheduling -----------------------------------------------------------------------

def prioritized(rid: str, prompt_len: int, priority: int, max_new_tokens: int = 8, ago: float = 0.0) -> Request:
    """A request of that priority whose arrival was `ago` seconds back."""
    request = Request(rid, list(range(1, prompt_len + 1)),
                      SamplingParams(max_new_tokens=max_new_tokens, temperature=0, priority=priority))
    request.metrics.arrival_time -= ago
    return request


def test_priority_admits_lowest_first_ties_by_arrival():
    sched = make_scheduler_for(64, scheduler_type="priority", max_requests_per_batch=1)
    for rid, priority in (("a", 5), ("b", 1), ("c", 5), ("d", 1), ("e", -3)):
        sched.add_request(prioritized(rid, 3, priority, max_new_tokens=1))
    order = []
    while sched.has_work():
        out = sched.schedule()
        order += [c.request.request_id for c in out.chunks if c.request.request_id not in order]
        apply_step(sched, out)
    assert order == ["e", "b", "d", "a", "c"]
    assert sched.allocator.num_free_blocks == sched.allocator.num_total_blocks and not sched.keys


def test_priority_preempts_the_lowest_running_request_when_the_slots_are_full():
    sched = make_scheduler_for(64, scheduler_type="priority", max_requests_per_batch=2)
    first, second, third = (prioritized(f"r{i}", 4, 10, max_new_tokens=50) for i in range(3))
    for r in (first, second, third):
        sched.add_request(r)
    for _ in range(3):
        apply_step(sched, sched.schedule())
    assert sched.active == [first, second] and second.state is RequestState.DECODING
    urgent = prioritized("urgent", 4, 0, max_new_tokens=2)
    sched.add_request(urgent)
    out = sched.schedule()
    assert out.preempted == [second] and not out.chunks  # the later of the two lowest goes
    soft_reset(sched, second)
    assert [r.request_id for r in sched.waiting] == ["urgent", "r1", "r2"]  # back in its place, ahead of r2
    out = sched.schedule()
    assert not out.preempted and ("urgent", 4) in chunk_sizes(out)
    equal = prioritized("equal", 4, 0)
    sched.add_request(equal)  # ranks below urgent (a tie, later), above r0: r0 makes room
    assert sched.schedule().preempted == [first]


def test_priority_does_not_preempt_for_equal_or_lower_ranks_or_when_it_fits():
    sched = make_scheduler_for(64, scheduler_type="priority", max_requests_per_batch=2)
    for r in (prioritized("a", 4, 3), prioritized("b", 4, 3)):
        sched.add_request(r)
    apply_step(sched, sched.schedule())
    sched.add_request(prioritized("same", 4, 3))
    sched.add_request(prioritized("lower", 4, 7))
    assert not sched.schedule().preempted
    roomy = make_scheduler_for(64, scheduler_type="priority", max_requests_per_batch=3)
    for r in (prioritized("a", 4, 3), prioritized("b", 4, 0)):
        roomy.add_request(r)
    apply_step(roomy, roomy.schedule())
    roomy.add_request(prioritized("c", 4, 0))  # a slot and blocks are free: admitted, nobody preempted
    out = roomy.schedule()
    assert not out.preempted and ("c", 4) in chunk_sizes(out)


def test_priority_preempts_for_blocks_only_if_that_lets_the_request_in():
    sched = make_scheduler_for(10, page_size=4, scheduler_type="priority", safety_margin=0.0)
    low, mid = prioritized("low", 16, 9), prioritized("mid", 16, 5)  # 4 blocks each
    for r in (low, mid):
        sched.add_request(r)
    apply_step(sched, sched.schedule())
    assert sched.allocator.num_free_blocks == 2
    sched.add_request(prioritized("big", 28, 7))  # 7 blocks: low's 4 and the 2 free are not enough, mid outranks it
    assert not sched.schedule().preempted
    sched2 = make_scheduler_for(10, page_size=4, scheduler_type="priority", safety_margin=0.0)
    for r in (prioritized("low", 16, 9), prioritized("mid", 16, 5)):
        sched2.add_request(r)
    apply_step(sched2, sched2.schedule())
    sched2.add_request(prioritized("urgent", 20, 0))
    assert [r.request_id for r in sched2.schedule().preempted] == ["low"]  # 2 + 4 free >= 5: mid stays


def test_priority_aging_bounds_how_long_a_request_is_overtaken():
    for aging, first in ((1.0, "old"), (None, "new")):
        sched = make_scheduler_for(64, scheduler_type="priority", priority_aging=aging, max_requests_per_batch=1)
        sched.add_request(prioritized("old", 3, 5, ago=10.0))  # 10 s of waiting: worth 10 levels at 1 s a level
        sched.add_request(prioritized("new", 3, 0))
        assert sched.waiting[0].request_id == first, aging


def test_priority_victims_of_a_stall_go_lowest_first():
    sched = make_scheduler_for(64, page_size=1, scheduler_type="priority", safety_margin=0.0)
    for rid, priority in (("p1", 1), ("p9", 9), ("p5", 5)):
        sched.add_request(prioritized(rid, 2, priority))
    apply_step(sched, sched.schedule())
    assert [r.request_id for r in sched.active] == ["p1", "p5", "p9"]
    stalled = [(sched.active[0], 2)]
    assert _ids(choose_victims(sched.active, set(), stalled, sched.allocator)) == ["p9"]


def test_scheduling_policy_is_vllms_name_for_the_scheduler_type():
    assert with_vllm_engine_args(None, scheduling_policy="priority").scheduler_type == "priority"
    assert with_vllm_engine_args(None, scheduling_policy="fcfs").scheduler_type == "fifo"
    first_come = ContinuousBatchingConfig(scheduler_type="prefill_first")
    assert with_vllm_engine_args(first_come, scheduling_policy="fcfs").scheduler_type == "prefill_first"
    with pytest.raises(ConfigError, match=r"scheduling_policy \(vLLM's name for scheduler_type\)='priority' disagrees with scheduler_type='prefill_f"):
        with_vllm_engine_args(first_come, scheduling_policy="priority")
    with pytest.raises(ConfigError, match=r"scheduling_policy .*='fcfs' disagrees with scheduler_type='priority'"):
        with_vllm_engine_args(ContinuousBatchingConfig(scheduler_type="priority"), scheduling_policy="fcfs")
    with pytest.raises(ConfigError, match=r"scheduling_policy must be one of \('fcfs', 'priority'\)"):
        with_vllm_engine_args(None, scheduling_policy="lifo")
    for bad in (0, -1.0, float("inf")):
        with pytest.raises(ConfigError, match="priority_aging must be a number of seconds > 0"):
            ContinuousBatchingConfig(priority_aging=bad)
    with pytest.raises(ValueError, match="priority must be an integer"):
        SamplingParams(priority=1.5)
