"""POST /v1/embeddings (OpenAI's shape; vLLM's extra fields): texts or token ids in, one embedding each out, as
floats or base64; `dimensions` only for a Matryoshka model (else a 400 naming it)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from .. import pooling
from ..openapi import error_responses
from ..pooling_protocol import EmbeddingRequest
from ..protocol import APIError
from ..serving import new_id
from .deps import AUTH, ServingDep

router = APIRouter()


@router.post("/v1/embeddings", dependencies=AUTH, responses=error_responses(400, 401, 404, 413, 500, 503))
async def embeddings(body: EmbeddingRequest, raw: Request, serving: ServingDep) -> dict[str, Any]:
    serving.check_model(body.model)
    pooling.require_task(serving, "/v1/embeddings", "embed")
    if None not in (body.normalize, body.use_activation) and body.normalize != body.use_activation:
        raise APIError(400, "normalize and use_activation are one switch: they disagree", param="normalize")
    activation = body.use_activation if body.use_activation is not None else body.normalize
    params = pooling.pooling_params(body, activation, body.dimensions)
    inputs = pooling.embedding_inputs(serving, body)
    prompts = await serving.prepare(pooling.tokenize, serving, inputs, body.add_special_tokens)
    outs = await pooling.run(serving, raw, new_id("embd"), prompts, params, "input")
    data = [{"index": i, "object": "embedding", "embedding": pooling.encode(o.pooled or [], body.encoding_format)}
            for i, o in enumerate(outs)]
    return pooling.head(serving, "embd") | {"data": data, "usage": pooling.usage(outs)}
