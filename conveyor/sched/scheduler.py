"""Schedulers: which requests, and how many of their tokens, go into the next forward pass
(docs/design/scheduler.md: chunked prefill and the scheduler).

Every step fills one pass under three limits: the token budget (`max_batch_tokens` query tokens),
the cache budget (`max_batch_pages` KV pages read) and `max_requests_per_batch`. Active requests
(those holding cache blocks) come first, in the order the scheduler type prefers; then waiting
requests in arrival order, unless free cache has fallen below `safety_margin`. A prompt that does
not fit the remaining token budget is chunked: as many of its tokens as fit go now, the rest next
step (an encoder's prompt, `Request.whole_prompt`, waits for a pass it fits whole). Admission is all
or nothing: a waiting request gets blocks for its whole chunk or nothing. With prefix caching, a
waiting request first looks up the completed blocks that already hold the longest prefix of its
sequence: it starts with them, their prefill skipped, and its chunk begins after them (the cache
budget still counts them: shared pages are read too); a request that asks for prompt logprobs skips
the lookup, since it needs every prompt position's logits (so does a pooling request that pools more
than its last token's hidden state). An active request that cannot get the blocks it needs is
reported as stalled, with the number of blocks it asked for, so the engine can offload others to
make room.

The scheduler decides and runs nothing: speculative proposals reach it through the narrow `Proposer`
interface (the engine passes its `Speculator`), and it reads only the few fields of the
configuration it is given (`SchedulingLimits`). `SCHEDULERS` is the one table of scheduler types:
`ContinuousBatchingConfig` validates `scheduler_type` against it and takes each type's default
safety margin from it, and the CLI offers its names.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import deque
from typing import Protocol

from ..cache.allocator import CacheAllocator
from ..request import Request, RequestState
from .output import ScheduledChunk, SchedulerOutput


class SchedulingLimits(Protocol):
    """What a scheduler reads of `ContinuousBatchingConfig` (which sits above this module)."""

    scheduler_type: str
    max_batch_tokens: int
    max_requests_per_batch: int
    max_batch_pages: int | None
    safety_margin: float | None
    priority_aging: float | None


class Proposer(Protocol):
    """Speculative proposals as the scheduler sees them (`speculative.Speculator` is one)."""

    def active(self, num_running: int) -> bool:
        """Whether requests speculate at all with this many running."""
        ...

    def propose(self, request: Request, budget: int) -> list[int]:
        """Proposed tokens for a decoding request, at most `budget` (empty: a plain decode)."""
        ...


class _Budget:
    """What is left of one pass's three limits."""

    def __init__(self, config: SchedulingLimits, num_pages: int) -> None:
        self.tokens = config.max_batch_tokens
        self.requests = config.max_requests_per_batch
        self.pages = config.max_batch_pages or num_pages

    def exhausted(self) -> bool:
        return self.tokens == 0 or self.requests == 0

    def take(self, tokens: int, pages: int) -> None:
        self.tokens -= tokens
        self.requests -= 1
        self.pages -= pages


class Scheduler:
    """Common mechanics; subclasses choose the order of active requests and their default safety margin."""

    default_safety_margin = 0.0  # `safety_margin=None` in the config resolves to this

    def __init__(self, config: SchedulingLimits, allocator: CacheAllocator, proposer: Proposer | None = None) -> None:
        self.config = config
        self.allocator = allocator
        self.proposer = proposer  # speculative decoding's proposals, None = off
        self.waiting: deque[Request] = deque()
        self.active: list[Request] = []

    # -- queue management -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request: Request, free: bool = True) -> int:
        """Take a request out of the queues and free its blocks (finish, failure or cancel); with
        `free=False` the caller frees them later (a step still in flight uses them)."""
        if request in self.active:
            self.active.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        return self.allocator.free(request.request_id) if free else 0

    def requeue_front(self, request: Request) -> None:
        """Put an offloaded request back at the head of the waiting queue."""
        self.active.remove(request)
        self.waiting.appendleft(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.active)

    # -- policy -----------------------------------------------------------------------------
    def active_order(self) -> list[Request]:
        raise NotImplementedError

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = _Budget(self.config, self.allocator.num_total_blocks)
        speculate = self.proposer is not None and self.proposer.active(len(self.active))
        for request in self.active_order():
            if budget.exhausted():
                break
            self._schedule_active(request, budget, out, speculate)
        if not self._hold_back_new():
            while self.waiting and not budget.exhausted():
                if not self._admit(self.waiting[0], budget, out):
                    break
                self._activate(self.waiting.popleft())
        return out

    def _activate(self, request: Request) -> None:
        """A request just admitted joins the active ones (their order is the preemption order, reversed)."""
        self.active.append(request)

    def _hold_back_new(self) -> bool:
        free = self.allocator.num_free_blocks / self.allocator.num_total_blocks
        return bool(self.active) and free < self.config.safety_margin

    def _schedule_active(self, request: Request, budget: _Budget, out: SchedulerOutput, speculate: bool) -> None:
        if speculate and request.state is RequestState.DECODING and self._speculate(request, budget, out):
            return
        n = min(request.num_remaining_tokens, budget.tokens)
        if request.state is RequestState.PREFILLING:
            # A running prefill may shrink its chunk to what its blocks plus the free pool can hold.
            start = request.num_computed_tokens
            n = self.allocator.max_tokens(request.request_id, start, self.allocator.chunk_end(start, start + n)) - start
        if n <= 0:
            out.stalled.append((request, self.allocator.blocks_needed(
                request.request_id, request.num_computed_tokens + 1)))
            return
        end = request.num_computed_tokens + n
        needed = self.allocator.blocks_needed(request.request_id, end)
        if needed > self.allocator.num_free_blocks:
            out.stalled.append((request, needed))
            return
        pages = self.allocator.blocks_for_tokens(end)
        if pages > budget.pages:
            return
        self.allocator.allocate(request.request_id, end)
        budget.take(n, pages)
        out.chunks.append(ScheduledChunk(request, n))

    def _speculate(self, request: Request, budget: _Budget, out: SchedulerOutput) -> bool:
        """Schedule a decode with its proposals (counted in the token budget) if there are any and
        their blocks fit; False leaves it to the plain path."""
        assert self.proposer is not None
        drafts = self.proposer.propose(request, budget.tokens - 1)
        end = request.num_computed_tokens + 1 + len(drafts)
        if not drafts or self.allocator.blocks_needed(request.request_id, end) > self.allocator.num_free_blocks:
            return False
        pages = self.allocator.blocks_for_tokens(end)
        if pages > budget.pages:
            return False
        self.allocator.allocate(request.request_id, end)
        budget.take(1 + len(drafts), pages)
        out.chunks.append(ScheduledChunk(request, 1 + len(drafts), drafts))
        return True

    def _admit(self, request: Request, budget: _Budget, out: SchedulerOutput) -> bool:
        # Not a swapped request, nor one that needs every prompt position computed (prompt logprobs, pooling).
        looked_up = self.allocator.block_sharing and request.num_computed_tokens == 0 and request.reuses_prefix
        cached = self.allocator.match_prefix(request) if looked_up else []
        tail = self.allocator.match_tail(request, len(cached)) if looked_up else None  # copied, not computed
        hit = len(cached) * self.allocator.page_size + (tail[1] if tail else 0)
        start = request.num_computed_tokens + hit
        n = self.allocator.chunk_end(start, start + min(request.num_tokens - start, budget.tokens)) - start
        if request.whole_prompt and start + n < request.num_tokens:
            return False  # an encoder's prompt goes in one pass (the input processor checked that it fits one)
        end = start + n
        pages = self.allocator.blocks_for_tokens(end)
        if pages > budget.pages or not self.allocator.allocate(request.request_id, end, shared=cached, tail=tail):
            return False
        request.num_computed_tokens = start
        if looked_up:
            out.prefix_cache_query_tokens += request.num_tokens
            out.prefix_cache_hit_tokens += hit
        request.state = RequestState.PREFILLING
        if request.metrics.first_scheduled_time is None:
            request.metrics.first_scheduled_time = time.monotonic()
            request.num_cached_tokens = hit
        budget.take(n, pages)
        out.chunks.append(ScheduledChunk(request, n))
        return True


class FIFOScheduler(Scheduler):
    """Active decodes first, then active prefills, then new requests by arrival: finish what runs."""

    default_safety_margin = 0.15  # new prefills wait below 15% free cache, so running decodes rarely stall

    def active_order(self) -> list[Request]:
        decoding = [r for r in self.active if r.state is RequestState.DECODING]
        prefilling = [r for r in self.active if r.state is RequestState.PREFILLING]
        return decoding + prefilling


class PrefillFirstScheduler(Scheduler):
    """Active prefills first, so chunked prompts finish before decodes resume."""

    def active_order(self) -> list[Request]:
        prefilling = [r for r in self.active if r.state is RequestState.PREFILLING]
        decoding = [r for r in self.active if r.state is RequestState.DECODING]
        return prefilling + decoding


class PriorityScheduler(Scheduler):
    """vLLM's priority policy: the request with the lowest `priority` runs first, ties by arrival; active
    decodes, then active prefills, each in that order, then waiting requests in that order. A waiting
    request that cannot be admitted (`max_requests_per_batch` reached, or too few free blocks for its
    first chunk) while running requests rank below it has them preempted, lowest first, through the
    engine's offloading (swap or soft reset), as many as it needs and only if that lets it in; stalled
    requests' victims go lowest first too. Starvation is bounded by aging: a request's rank is its
    priority minus the seconds it has waited divided by `priority_aging`, which comes down to the fixed
    key `priority + arrival / priority_aging`, so nothing that arrives more than (p - q) x
    `priority_aging` seconds after a request of priority p overtakes it with priority q
    (docs/design/scheduler.md)."""

    default_safety_margin = 0.15  # as FIFO: decodes first, new prefills wait below 15% free cache

    def __init__(self, config: SchedulingLimits, allocator: CacheAllocator, proposer: Proposer | None = None) -> None:
        super().__init__(config, allocator, proposer)
        self.keys: dict[str, tuple[float, int]] = {}  # request id -> its rank (lower runs first), fixed at arrival
        self.arrivals = itertools.count()
        self.epoch = time.monotonic()  # arrival times relative to it: small numbers beside priorities

    def rank(self, request: Request) -> tuple[float, int]:
        return self.keys[request.request_id]

    def add_request(self, request: Request) -> None:
        aging = self.config.priority_aging
        priority = request.params.priority
        key = priority + (request.metrics.arrival_time - self.epoch) / aging if aging else priority
        self.keys[request.request_id] = (key, next(self.arrivals))
        bisect.insort(self.waiting, request, key=self.rank)

    def requeue_front(self, request: Request) -> None:
        """An offloaded request waits again in its rank's place (ahead of later arrivals of its priority)."""
        self.active.remove(request)
        bisect.insort(self.waiting, request, key=self.rank)

    def remove(self, request: Request, free: bool = True) -> int:
        freed = super().remove(request, free)
        self.keys.pop(request.request_id, None)
        return freed

    def _activate(self, request: Request) -> None:
        bisect.insort(self.active, request, key=self.rank)

    def active_order(self) -> list[Request]:
        decoding = [r for r in self.active if r.state is RequestState.DECODING]
        prefilling = [r for r in self.active if r.state is RequestState.PREFILLING]
        return decoding + prefilling

    def schedule(self) -> SchedulerOutput:
        victims = self._preemptions()
        if victims:  # nothing runs until the engine has offloaded them (it schedules again at once)
            return SchedulerOutput(preempted=victims)
        return super().schedule()

    def _preemptions(self) -> list[Request]:
        """The running requests, lowest first, whose slots and blocks the best waiting request needs to be
        admitted and which rank below it; none unless taking them lets it in."""
        if not self.waiting or not self.active:
            return []
        head = self.waiting[0]
        need = self.allocator.blocks_for_tokens(min(head.num_tokens,
                                                    head.num_computed_tokens + self.config.max_batch_tokens))
        margin = (self.config.safety_margin or 0.0) * self.allocator.num_total_blocks
        slots = self.config.max_requests_per_batch - len(self.active)
        free, remaining = self.allocator.num_free_blocks, len(self.active)

        def fits() -> bool:
            return slots > 0 and free >= need and (free >= margin or remaining == 0)

        victims: list[Request] = []
        for request in reversed(self.active):
            if fits() or self.rank(request) <= self.rank(head):
                break
            victims.append(request)
            slots, remaining = slots + 1, remaining - 1
            free += self.allocator.exclusive_blocks(request.request_id)
        return victims if victims and fits() else []


SCHEDULERS: dict[str, type[Scheduler]] = {"fifo": FIFOScheduler, "prefill_first": PrefillFirstScheduler,
                                          "priority": PriorityScheduler}


def make_scheduler(config: SchedulingLimits, allocator: CacheAllocator, proposer: Proposer | None = None) -> Scheduler:
    """The scheduler of `config.scheduler_type`, a name in `SCHEDULERS` (the config validated it)."""
    return SCHEDULERS[config.scheduler_type](config, allocator, proposer)
