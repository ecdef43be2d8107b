"""Request deadlines (`SamplingParams.request_timeout`, the server's `--request-timeout`): a request still
waiting or running that long after its arrival ends with finish reason "timeout" and an error naming the
timeout, and its KV blocks go back to the pool (`Engine.finish_request`).

The deadlines sit in a heap of (deadline, arrival number, request id); each step pops the ones past
due, so a step costs O(1) when none is (plus O(log n) per expired one). A request that ended before
its deadline stays in the heap as a stale entry until the deadline passes or the heap is compacted
(when stale entries outnumber live ones), so it costs a few bytes, never its tokens."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Mapping

from ..request import Request, RequestState


class Deadlines:
    def __init__(self) -> None:
        self.heap: list[tuple[float, int, str]] = []
        self.order = itertools.count()

    def add(self, request: Request) -> None:
        timeout = request.params.request_timeout
        if timeout is not None:
            heapq.heappush(self.heap, (request.metrics.arrival_time + timeout, next(self.order), request.request_id))

    def expired(self, now: float, live: Mapping[str, Request]) -> list[Request]:
        """The requests of `live` (the engine's unfinished ones) whose deadline is `now` or earlier, taken
        out of the heap."""
        heap = self.heap
        if len(heap) > 64 and len(heap) > 2 * len(live):  # mostly stale: keep the live entries only
            heap[:] = [entry for entry in heap if entry[2] in live]
            heapq.heapify(heap)
        overdue = []
        while heap and heap[0][0] <= now:
            request = live.get(heapq.heappop(heap)[2])
            if request is not None:
                overdue.append(request)
        return overdue


def timeout_message(request: Request, now: float) -> str:
    """The error a request past its deadline ends with: its timeout, and where it was when it passed."""
    m, generated = request.metrics, len(request.output_token_ids)
    if m.first_scheduled_time is None:
        where = f"waiting in the queue for {now - m.arrival_time:.2f} s"
    elif request.state in (RequestState.PENDING, RequestState.SWAPPED):
        where = f"preempted and waiting again, {generated} tokens generated"
    else:
        where = f"running, {generated} tokens generated (queued {m.queue_time:.2f} s)"
    return f"the request did not finish within its request_timeout of {request.params.request_timeout:g} s ({where})"
