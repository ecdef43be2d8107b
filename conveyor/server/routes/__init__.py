"""The server's routes, one module per family: `admin` (/health, /metrics, /v1/models), `tokens`
(/tokenize, /detokenize), `completions` (/v1/completions), `chat` (/v1/chat/completions), `messages` (Anthropic's
/v1/messages, /v1/messages/count_tokens), `responses` (/v1/responses, /v1/responses/{id}) and `dashboard`
(/dashboard, /dashboard/data).
Each handler reaches the shared `Serving` through `deps.get_serving`."""

from __future__ import annotations

from fastapi import FastAPI

from . import admin, chat, completions, dashboard, messages, responses, tokens


def include_routes(app: FastAPI) -> None:
    for module in (admin, tokens, completions, chat, messages, responses, dashboard):
        app.include_router(module.router)
