"""A submission: the engine requests of one HTTP request (its choices, or one), submitted to the shared
engine's manager, their outputs handed over from the engine thread to the event loop (`Handoff`) and
merged for the one consumer that answers the request (a stream or a whole response); the server's
in-flight count, the request observers and the metrics follow each request to its end."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Protocol

from ..llm import LLM
from ..manager import EngineDeadError
from ..request import Request, RequestOutput
from .handoff import Handoff
from .metrics import ServerMetrics
from .observers import RequestObservers


class Host(Protocol):
    """What a submission reads and keeps count in of the server that made it (`serving.Serving` is one)."""

    llm: LLM
    handoff: Handoff | None
    metrics: ServerMetrics
    observers: RequestObservers
    in_flight: int  # engine requests accepted and not yet finished
    active: set[Submission]


class Submission:
    """The engine requests of one HTTP request, their outputs merged for one consumer: outputs of a request
    that arrive before the consumer takes them are coalesced into one (one SSE event for the tokens ready
    since the last send)."""

    def __init__(self, serving: Host, requests: list[Request]) -> None:
        self.serving = serving
        self.requests = requests
        self.index = {r.request_id: i for i, r in enumerate(requests)}
        self.unfinished = set(self.index)
        self.ready: dict[int, RequestOutput] = {}  # choice index -> output not yet taken (coalesced)
        self.arrived = asyncio.Event()
        self.started = asyncio.Event()  # set by the first output

    def start(self) -> None:
        serving, handoff = self.serving, self.serving.handoff
        assert handoff is not None, "the server's lifespan has not started"

        def deliver(out: RequestOutput) -> None:  # on the engine thread
            if out.finished:
                serving.metrics.observe_finished(out)
            handoff.put(self._arrive, out)

        serving.in_flight += len(self.requests)
        serving.active.add(self)
        serving.observers.submitted(self.requests)
        for k, request in enumerate(self.requests):
            try:
                serving.llm.manager.submit(request, on_output=deliver)
            except EngineDeadError:  # died since the admission check: the unsent ones will never finish
                for unsent in self.requests[k:]:
                    self._finished(unsent.request_id)
                raise

    def _finished(self, request_id: str) -> None:
        self.unfinished.discard(request_id)
        self.serving.in_flight -= 1
        if not self.unfinished:
            self.serving.active.discard(self)

    def _arrive(self, out: RequestOutput) -> None:
        i = self.index[out.request_id]
        if out.finished and out.request_id in self.unfinished:
            self._finished(out.request_id)
            self.serving.observers.finished(self.requests[i], out)
        earlier = self.ready.get(i)
        self.ready[i] = out if earlier is None else coalesce(earlier, out)
        self.arrived.set()
        self.started.set()

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) as they arrive, until every request has finished."""
        remaining = len(self.requests)
        while remaining:
            await self.arrived.wait()
            self.arrived.clear()
            taken, self.ready = self.ready, {}
            for i, out in taken.items():
                remaining -= out.finished
                yield i, out

    def cancel(self) -> None:
        """Cancel the requests still running (idempotent; their final "abort" outputs follow)."""
        for request_id in self.unfinished:
            self.serving.llm.manager.cancel_request(request_id)


def coalesce(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Two outputs of one request as one: the later snapshot with both deltas."""
    return dataclasses.replace(later, delta_text=earlier.delta_text + later.delta_text,
                               delta_token_ids=earlier.delta_token_ids + later.delta_token_ids)
