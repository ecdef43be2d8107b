"""Every error the server answers is OpenAI's error object (see conveyor/server/__init__.py), except on
Anthropic's Messages routes, which answer Anthropic's (`anthropic_protocol.anthropic_error`)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .anthropic_protocol import anthropic_error, anthropic_path
from .protocol import APIError, error_body
from .streaming import ClientGone


def answer(request: Request, status: int, message: str, kind: str, param: str | None = None,
           code: str | int | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    """The error in the shape of the route's API: Anthropic's on the Messages routes, else OpenAI's."""
    if anthropic_path(request.url.path):
        status, body = anthropic_error(status, message)
        return JSONResponse(body, status, headers=headers)
    return JSONResponse(error_body(message, kind, param, code), status, headers=headers)


async def api_error(request: Request, exc: APIError) -> JSONResponse:
    return answer(request, exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)


async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 as a 400 naming the fields (the first one as `param`); bad JSON as its own message."""
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = next(e for e in errors if e.get("type") == "json_invalid").get("ctx", {}).get("error", "")
        return answer(request, 400, f"the request body is not valid JSON: {detail}".rstrip(": "),
                      "invalid_request_error")
    locs = [".".join(str(p) for p in e.get("loc", ())[1:]) for e in errors]  # loc[0] is "body"
    message = "; ".join(f"{loc or 'body'}: {e.get('msg')}" for loc, e in zip(locs, errors)) or "invalid request"
    param = locs[0].split(".")[0] if locs and locs[0] else None
    return answer(request, 400, message, "invalid_request_error", param)


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return answer(request, exc.status_code, str(exc.detail), kind, headers=exc.headers)


async def client_gone(_: Request, exc: ClientGone) -> Response:
    return Response(status_code=499)  # nobody reads it


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, http_error)  # type: ignore[arg-type]
    app.add_exception_handler(ClientGone, client_gone)  # type: ignore[arg-type]
