"""The FastAPI app: OpenAI-compatible routes over one shared engine (see conveyor/server/__init__.py)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI

from ..llm import LLM
from .cors import add_cors
from .errors import add_error_handlers
from .limits import BodyLimit
from .openapi import instance_schema
from .request_id import add_request_id_headers
from .responses.store import ResponseStore
from .routes import include_routes
from .serving import Serving
from .settings import ServerSettings
from .tracing import add_trace_headers


def build_app(llm: LLM, settings: ServerSettings | None = None) -> FastAPI:
    """The app over `llm`: its `Serving` lives on `app.state.serving`, where the route handlers find it."""
    serving = Serving(llm, settings or ServerSettings())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        serving.startup()
        try:
            yield
        finally:
            await serving.shutdown()

    settings = serving.settings
    docs = {} if not settings.disable_fastapi_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="Conveyor", lifespan=lifespan, **docs)
    app.add_middleware(BodyLimit, max_bytes=serving.max_request_bytes)
    add_trace_headers(app, settings.tracing)
    add_request_id_headers(app, settings.enable_request_id_headers)
    add_cors(app, serving.settings.cors)  # outermost: preflights answered first, errors get its headers
    app.state.serving = serving
    app.state.responses = ResponseStore(serving.settings.max_stored_responses)
    add_error_handlers(app)
    include_routes(app, pooling=llm.pooling_task is not None)
    names = None if llm.lora_enabled else serving.names  # (adapters come and go: then any name)
    app.openapi = lambda: instance_schema(app, names, llm.vocab_size,  # type: ignore[method-assign]
                                          serving.max_model_len, llm.priority_scheduling, serving.max_logprobs)
    return app
