"""vLLM's `--enable-request-id-headers`: every answer carries an `X-Request-Id` header, the request's own
when it sent one (so a gateway's id follows the request through), else a new one (`asgi.HTTPMiddleware`:
streams pass through untouched)."""

from __future__ import annotations

import uuid

from fastapi import FastAPI
from starlette.types import Message, Receive, Scope, Send

from .asgi import HTTPMiddleware

HEADER = b"x-request-id"


class RequestIdHeaders(HTTPMiddleware):
    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        given = dict(scope.get("headers") or []).get(HEADER)
        value = given or uuid.uuid4().hex.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
                message = message | {"headers": [*headers, (HEADER, value)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def add_request_id_headers(app: FastAPI, enabled: bool) -> None:
    if enabled:
        app.add_middleware(RequestIdHeaders)
