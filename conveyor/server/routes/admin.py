"""Operations routes, open without the API key except /v1/models: health (and vLLM's /ping, as SageMaker
probes it), the version, vLLM's /load, Prometheus metrics, models (the base model's names, then the LoRA adapters, each
with the base as its `parent`, as vLLM lists them); and vLLM's development endpoint /reset_prefix_cache
(VLLM_SERVER_DEV_MODE=1), behind the key."""

from __future__ import annotations

import asyncio
import importlib.metadata
from typing import Any

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST

from ...manager import death_message
from ..openapi import error_responses
from ..protocol import APIError
from ..serving import Serving
from .deps import AUTH, ServingDep

router = APIRouter()


class PrometheusResponse(Response):
    media_type = CONTENT_TYPE_LATEST


@router.get("/health", response_class=Response, responses={200: {"description": "serving", "content": {}}}
            | error_responses(503))
@router.get("/ping", response_class=Response, responses={200: {"description": "serving", "content": {}}}
            | error_responses(503))
@router.post("/ping", response_class=Response, responses={200: {"description": "serving", "content": {}}}
             | error_responses(503))
async def health(serving: ServingDep) -> Response:
    if serving.dead_error is not None:
        raise APIError(503, f"not serving: {death_message(serving.dead_error)}", type="service_unavailable_error",
                       code="engine_dead")
    if serving.draining or not serving.llm.manager.is_running():
        raise APIError(503, "not serving (shutting down or engine stopped)", type="service_unavailable_error")
    return Response(status_code=200)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": importlib.metadata.version("conveyor")}


@router.get("/load")
async def load(serving: ServingDep) -> dict[str, int]:
    """vLLM's server load, for load-aware routers: the engine requests accepted and not yet finished (a
    request with `n` choices counts n)."""
    return {"server_load": serving.in_flight}


@router.get("/metrics", response_class=PrometheusResponse)
async def metrics(serving: ServingDep) -> PrometheusResponse:
    return PrometheusResponse(serving.metrics.render())


@router.get("/v1/models", dependencies=AUTH, responses=error_responses(401))
async def models(serving: ServingDep) -> dict[str, Any]:
    return {"object": "list", "data": model_cards(serving)}


@router.get("/v1/models/{model:path}", dependencies=AUTH, responses=error_responses(401, 404))
async def model(model: str, serving: ServingDep) -> dict[str, Any]:
    """OpenAI's `client.models.retrieve(name)`: that name's card, as /v1/models lists it (a Hub id's slash
    included)."""
    cards = model_cards(serving)
    card = next((c for c in cards if c["id"] == model), None)
    if card is None:
        raise APIError(404, f"The model `{model}` does not exist. Served: {', '.join(c['id'] for c in cards)}.",
                       param="model", code="model_not_found")
    return card


def model_cards(serving: Serving) -> list[dict[str, Any]]:
    """The served names, then the LoRA adapters (each with the base as its `parent`)."""
    base = [{"id": name, "object": "model", "created": serving.created, "owned_by": "conveyor",
             "root": str(serving.llm.model_path), "parent": None, "max_model_len": serving.max_model_len}
            for name in serving.names]
    adapters = [{"id": a.lora_name, "object": "model", "created": serving.created, "owned_by": "conveyor",
                 "root": a.lora_path, "parent": a.base_model_name or serving.model_name,
                 "max_model_len": serving.max_model_len} for a in serving.llm.list_loras()]
    return base + adapters


@router.post("/reset_prefix_cache", response_class=Response, dependencies=AUTH,
             responses={200: {"description": "reset", "content": {}}} | error_responses(401, 404, 409))
async def reset_prefix_cache(serving: ServingDep) -> Response:
    """vLLM's development endpoint: forget every cached prefix, so that the next prompts are computed in full
    (a benchmark's rounds that must not hit the cache); on only with VLLM_SERVER_DEV_MODE=1, and refused
    (409) while requests are in flight, whose blocks it cannot take."""
    if not serving.settings.dev_mode:
        raise APIError(404, "/reset_prefix_cache is a development endpoint: start the server with "
                       "VLLM_SERVER_DEV_MODE=1")
    if not await asyncio.to_thread(serving.llm.reset_prefix_cache):
        raise APIError(409, "requests in flight hold cached blocks: reset when the server is idle",
                       code="requests_in_flight")
    return Response(status_code=200)
