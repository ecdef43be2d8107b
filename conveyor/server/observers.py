"""What watches the server's requests: the request log (`request_log`) and the traces (`tracing`), when an
operator turns them on. Each is told when an HTTP request's engine requests are submitted (in the route handler, so in that
HTTP request's context) and, on the event loop, when each of them ends, with its final output. With
none on, this costs an empty loop per submission and per finished request."""

from __future__ import annotations

from typing import Any, Protocol

from ..request import Request, RequestOutput
from .request_log import RequestLog
from .settings import ServerSettings
from .tracing import RequestTracer


class RequestObserver(Protocol):
    def submitted(self, requests: list[Request]) -> None:
        """`requests` (one HTTP request's) were submitted; called in the route handler's context."""
        ...

    def finished(self, request: Request, out: RequestOutput) -> None:
        """`request` ended with `out`, its final output."""
        ...

    def close(self) -> None:
        """The server stops: write out what is pending."""
        ...


class RequestObservers:
    def __init__(self, observers: list[RequestObserver]) -> None:
        self.observers = observers

    @classmethod
    def from_settings(cls, settings: ServerSettings, tokenizer: Any, model_name: str) -> RequestObservers:
        observers: list[RequestObserver] = []
        if settings.enable_log_requests:
            observers.append(RequestLog(settings.log_prompts, settings.max_log_len,
                                        lambda ids: tokenizer.decode(ids), settings.enable_log_outputs))
        if settings.tracing is not None:
            observers.append(RequestTracer(settings.tracing, model_name))
        return cls(observers)

    def submitted(self, requests: list[Request]) -> None:
        for observer in self.observers:
            observer.submitted(requests)

    def finished(self, request: Request, out: RequestOutput) -> None:
        for observer in self.observers:
            observer.finished(request, out)

    def close(self) -> None:
        for observer in self.observers:
            observer.close()
