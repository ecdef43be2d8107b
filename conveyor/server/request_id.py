"""vLLM's `--enable-request-id-headers`: every answer carries an `X-Request-Id` header, the request's own
when it sent one (so a gateway's id follows the request through), else a new one. Pure ASGI, so streams
pass through untouched."""

from __future__ import annotations

import uuid

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"x-request-id"


class RequestIdHeaders:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
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
