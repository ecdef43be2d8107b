"""A pooling server's answer on the generation routes: registered ahead of them (the first route that matches
answers), it says the server pools and how to start one that generates. A generating server leaves it out;
its pooling routes say the reverse themselves (`pooling.require_task`)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ..pooling import ROUTES
from ..protocol import APIError
from .deps import AUTH

router = APIRouter(include_in_schema=False)
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")


async def refuse(raw: Request) -> None:
    raise APIError(404, f"{raw.url.path} generates text; this server runs a pooling model (--runner pooling) and "
                   f"serves {ROUTES}: start it without --runner pooling to generate")


for path in GENERATION_ROUTES:
    router.add_api_route(path, refuse, methods=["POST"], dependencies=AUTH)
