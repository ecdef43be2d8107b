"""What route handlers depend on: the shared `Serving` (on the app's state) and the API key checks."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, Request

from ..protocol import APIError
from ..serving import Serving


def get_serving(request: Request) -> Serving:
    return request.app.state.serving


ServingDep = Annotated[Serving, Depends(get_serving)]


def bearer_matches(request: Request, key: str) -> bool:
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(given.strip().encode(), key.encode())


async def authorize(request: Request, serving: ServingDep) -> None:
    key = serving.settings.api_key
    if key is not None and not bearer_matches(request, key):
        raise APIError(401, "Incorrect or missing API key (send `Authorization: Bearer KEY`).",
                       code="invalid_api_key")


async def authorize_anthropic(request: Request, serving: ServingDep) -> None:
    """Anthropic's clients send the key as `x-api-key` (some as a bearer token): either is accepted."""
    key = serving.settings.api_key
    if key is None or bearer_matches(request, key):
        return
    if not secrets.compare_digest(request.headers.get("x-api-key", "").strip().encode(), key.encode()):
        raise APIError(401, "invalid x-api-key (send `x-api-key: KEY` or `Authorization: Bearer KEY`)",
                       code="invalid_api_key")


AUTH = [Depends(authorize)]
ANTHROPIC_AUTH = [Depends(authorize_anthropic)]
