"""What route handlers depend on: the shared `Serving` (on the app's state) and the API key check."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, Request

from ..protocol import APIError
from ..serving import Serving


def get_serving(request: Request) -> Serving:
    return request.app.state.serving


ServingDep = Annotated[Serving, Depends(get_serving)]


async def authorize(request: Request, serving: ServingDep) -> None:
    key = serving.settings.api_key
    if key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), key.encode()):
        raise APIError(401, "Incorrect or missing API key (send `Authorization: Bearer KEY`).",
                       code="invalid_api_key")


AUTH = [Depends(authorize)]
