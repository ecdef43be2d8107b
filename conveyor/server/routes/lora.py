"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: LoRA adapters loaded and unloaded while serving,
vLLM's bodies and plain-text answers (docs/lora.md). As in vLLM they answer only with
VLLM_ALLOW_RUNTIME_LORA_UPDATING set (a client that may load adapters reads files on the server's disk);
without it they are 404s saying so. Unloading an adapter that requests are using lets them finish: only
new requests can no longer name it."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from ...lora_request import LoRARequest
from ..openapi import error_responses
from ..protocol import APIError
from ..serving import Serving
from .deps import AUTH, ServingDep

router = APIRouter()

# Plain-text successes, JSON errors (the route's response class would document the errors as text too).
RESPONSES = {200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "done, in words"},
             **error_responses(400, 401, 404)}


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str = ""
    lora_path: str = ""


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str = ""
    lora_int_id: int | None = None


def check_updating(serving: Serving) -> None:
    if not serving.settings.allow_runtime_lora_updating:
        raise APIError(404, "loading and unloading LoRA adapters at run time is off: start the server with "
                       "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True", type="NotFoundError")
    if not serving.llm.lora_enabled:
        raise APIError(400, "LoRA is off: start the server with --enable-lora", type="InvalidUserInput")


@router.post("/v1/load_lora_adapter", dependencies=AUTH, responses=RESPONSES)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, serving: ServingDep) -> PlainTextResponse:
    check_updating(serving)
    name = body.lora_name
    if not name or not body.lora_path:
        raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.", type="InvalidUserInput")
    if name in serving.names or serving.llm.get_lora(name) is not None:
        raise APIError(400, f"The lora adapter '{name}' has already been loaded.", type="InvalidUserInput")
    adapter = LoRARequest(name, next(serving.lora_ids), body.lora_path)
    try:  # read and checked against the model off the event loop
        added = await serving.prepare(serving.llm.add_lora, adapter)
    except ValueError as exc:  # ConfigError: not a directory, rank over the limit, modules the model lacks
        raise APIError(400, str(exc), type="BadRequestError", param="lora_path") from exc
    if not added:
        raise APIError(400, f"The lora adapter '{name}' has already been loaded.", type="InvalidUserInput")
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter", dependencies=AUTH, responses=RESPONSES)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, serving: ServingDep) -> PlainTextResponse:
    check_updating(serving)
    name = body.lora_name
    if not name and body.lora_int_id is not None:
        name = next((a.lora_name for a in serving.llm.list_loras() if a.lora_int_id == body.lora_int_id), "")
    if not name and body.lora_int_id is None:
        raise APIError(400, "either 'lora_name' and 'lora_int_id' needs to be provided.", type="InvalidUserInput")
    if not serving.llm.remove_lora(name):
        raise APIError(404, f"The lora adapter '{name or body.lora_int_id}' cannot be found.", type="NotFoundError")
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
