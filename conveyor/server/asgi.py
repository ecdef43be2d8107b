"""The server's pure ASGI middleware share one shape: they act on HTTP requests (`handle`) and let every
other scope (the lifespan) through untouched. Pure ASGI rather than Starlette's `BaseHTTPMiddleware`, so
streamed answers pass through as they are sent."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send


class HTTPMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.handle(scope, receive, send)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """One HTTP request, through to `self.app`."""
        raise NotImplementedError
