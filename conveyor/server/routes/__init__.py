"""The server's routes, one module per family: `admin` (/health, /ping, /version, /metrics, /v1/models),
`tokens` (/tokenize, /detokenize, /tokenizer_info), `completions` (/v1/completions), `chat`
(/v1/chat/completions), `messages` (Anthropic's /v1/messages, /v1/messages/count_tokens), `responses`
(/v1/responses, /v1/responses/{id}), `dashboard` (/dashboard, /dashboard/data), `lora`
(/v1/load_lora_adapter, /v1/unload_lora_adapter), and the pooling models' `embeddings` (/v1/embeddings),
`score` (/v1/score, /v1/rerank) and `classify` (/classify, /pooling); a pooling server puts
`pooling_server` ahead of the generation routes, which it refuses. Each handler reaches the shared
`Serving` through `deps.get_serving`."""

from __future__ import annotations

from fastapi import FastAPI

from . import (admin, chat, classify, completions, dashboard, embeddings, lora, messages, pooling_server, responses,
               score, tokens)


def include_routes(app: FastAPI, pooling: bool = False) -> None:
    first = (pooling_server,) if pooling else ()
    for module in (*first, admin, tokens, completions, chat, messages, responses, embeddings, score, classify, lora,
                   dashboard):
        app.include_router(module.router)
