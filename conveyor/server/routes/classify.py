"""vLLM's POST /classify (each input's label and class probabilities, from a classifier) and POST /pooling
(each input's pooled vector as the model's head leaves it: an embedding model's embedding, a classifier's
scores, one a token for the token tasks; what reward models are read through)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from ...request import RequestOutput
from .. import pooling
from ..openapi import error_responses
from ..pooling_protocol import ClassifyRequest, PoolRequest
from ..protocol import APIError
from ..serving import Serving, new_id
from .deps import AUTH, ServingDep
from .score import activation

router = APIRouter()
ERRORS = error_responses(400, 401, 404, 413, 500, 503)


@router.post("/classify", dependencies=AUTH, responses=ERRORS)
async def classify(body: ClassifyRequest, raw: Request, serving: ServingDep) -> dict[str, Any]:
    serving.check_model(body.model)
    pooling.require_task(serving, "/classify", "classify")
    outs = await pool(body, raw, serving, "classify")
    labels = serving.llm.class_labels
    data = [{"index": i, "label": labels[max(range(len(probs)), key=probs.__getitem__)], "probs": probs,
             "num_classes": len(probs)} for i, probs in enumerate(o.pooled or [] for o in outs)]
    return pooling.head(serving, "classify") | {"data": data, "usage": pooling.usage(outs)}


@router.post("/pooling", dependencies=AUTH, responses=ERRORS)
async def pool_route(body: PoolRequest, raw: Request, serving: ServingDep) -> dict[str, Any]:
    serving.check_model(body.model)
    task = pooling.require_task(serving, "/pooling", "embed", "classify", "token_embed", "token_classify")
    if body.task is not None and body.task != task:
        raise APIError(400, f"task {body.task!r}: this server's model runs {task!r} (a server runs the task it was "
                       "started with: --pooler-config '{\"task\": ...}')", param="task")
    outs = await pool(body, raw, serving, "pool")
    data = [{"index": i, "object": "pooling", "data": pooling.encode(o.pooled or [], body.encoding_format)}
            for i, o in enumerate(outs)]
    return pooling.head(serving, "pool") | {"data": data, "usage": pooling.usage(outs)}


async def pool(body: ClassifyRequest | PoolRequest, raw: Request, serving: Serving, kind: str) -> list[RequestOutput]:
    """The body's inputs pooled through the shared engine, its activation switch applied."""
    params = pooling.pooling_params(body, activation(body))
    inputs = pooling.embedding_inputs(serving, body)
    prompts = await serving.prepare(pooling.tokenize, serving, inputs, body.add_special_tokens)
    return await pooling.run(serving, raw, new_id(kind), prompts, params, "input")
