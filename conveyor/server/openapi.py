"""The server's OpenAPI schema (`/openapi.json`) as this server answers: FastAPI's, with

- the error answers each route gives (400, 401, 404, 413, 500, 503 as OpenAI's error object; Anthropic's,
  with 529 for 503, on the Messages routes) in place of FastAPI's 422, which the server never sends
  (validation errors are 400s);
- `text/event-stream` beside JSON for the routes that stream;
- the bounds only the running server knows, marked in `protocol` (`x-conveyor-bound`): the served
  model names, token ids below the vocabulary size, max_tokens below the context length.

Schemathesis fuzzes against it (a checkout's `python -m tools.fuzz`, tests/tools/test_fuzz.py).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

ERRORS = {400: "invalid request (validation, context length, unsupported field)",
          401: "missing or wrong API key (when the server has one)", 404: "model not served",
          409: "the server is busy with what the request would change (requests in flight)",
          413: "request body over the server's --max-request-bytes",
          500: "the request failed inside the engine", 503: "queue full, shutting down, or the engine is dead",
          504: "the request was still waiting or running at its request_timeout (or the server's --request-timeout)"}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a route answering these error statuses."""
    return {code: {"model": ErrorResponse, "description": ERRORS[code]} for code in codes}


STREAMED = {200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
                  "description": "the answer; with `stream: true`, server-sent events ending in `data: [DONE]`"}}


def instance_schema(app: FastAPI, names: list[str] | None, vocab_size: int, max_model_len: int,
                    priority_scheduling: bool, max_logprobs: int) -> dict[str, Any]:
    """The schema with this server's bounds filled in (built once, then cached on the app): without priority
    scheduling, `priority` is 0 only; `names` None (LoRA adapters served, loaded at run time): any model name."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        for unused in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(unused, None)
        bounds = {"served_name": {"enum": [*names, ""]} if names is not None else {},
                  "token_id": {"maximum": vocab_size - 1},
                  "max_new_tokens": {"maximum": max_model_len - 1},
                  "priority": {} if priority_scheduling else {"minimum": 0, "maximum": 0},
                  "max_logprobs": {"maximum": max_logprobs}}
        _fill(schema, bounds)
        app.openapi_schema = schema
    return app.openapi_schema


def _fill(node: Any, bounds: dict[str, dict[str, Any]]) -> None:
    """Resolve every `x-conveyor-bound` marker: on the node's non-null branch (`anyOf`) or on the node."""
    if isinstance(node, list):
        for item in node:
            _fill(item, bounds)
        return
    if not isinstance(node, dict):
        return
    kind = node.pop("x-conveyor-bound", None)
    if kind is not None:
        branches = [b for b in node.get("anyOf", [node]) if b.get("type") != "null"]
        for branch in branches:
            if "enum" in bounds[kind]:
                branch.pop("type", None)
            branch.update(bounds[kind])
    for value in node.values():
        _fill(value, bounds)
