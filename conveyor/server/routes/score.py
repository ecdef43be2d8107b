"""vLLM's scoring routes: POST /v1/score (and /score) scores text pairs; POST /v1/rerank (and /rerank,
/v2/rerank: Jina's and Cohere's shape as vLLM serves it) orders documents by their relevance to a query.
A classifier (a `*ForSequenceClassification` checkpoint, or an LLM reranker set up with hf_overrides)
scores each pair as one prompt; an embedding model by the embeddings' cosine similarity."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from .. import pooling
from ..openapi import error_responses
from ..pooling_protocol import ActivationFields, RerankRequest, ScoreRequest
from ..protocol import APIError
from ..serving import new_id
from .deps import AUTH, ServingDep

router = APIRouter()
ERRORS = error_responses(400, 401, 404, 413, 500, 503)


def activation(body: ActivationFields) -> bool | None:
    try:
        return body.activation_switch
    except ValueError as exc:
        raise APIError(400, str(exc), param="use_activation") from exc


@router.post("/v1/score", dependencies=AUTH, responses=ERRORS)
@router.post("/score", dependencies=AUTH, responses=ERRORS, include_in_schema=False)
async def score(body: ScoreRequest, raw: Request, serving: ServingDep) -> dict[str, Any]:
    serving.check_model(body.model)
    names, first, second = body.pair
    pairs = pooling.pair_up(first, second, names)
    scores, used = await pooling.pair_scores(serving, raw, body, pairs, activation(body), names[1])
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    return pooling.head(serving, "score") | {"data": data, "usage": used}


@router.post("/v1/rerank", dependencies=AUTH, responses=ERRORS)
@router.post("/rerank", dependencies=AUTH, responses=ERRORS, include_in_schema=False)
@router.post("/v2/rerank", dependencies=AUTH, responses=ERRORS, include_in_schema=False)
async def rerank(body: RerankRequest, raw: Request, serving: ServingDep) -> dict[str, Any]:
    serving.check_model(body.model)
    pairs = [(body.query, document) for document in body.documents]
    scores, used = await pooling.pair_scores(serving, raw, body, pairs, activation(body), "documents")
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    top = order[:body.top_n] if body.top_n else order
    results = [{"index": i, "document": {"text": body.documents[i]}, "relevance_score": scores[i]} for i in top]
    return {"id": new_id("rerank"), "model": serving.model_name, "usage": {"prompt_tokens": used["prompt_tokens"],
                                                                          "total_tokens": used["total_tokens"]},
            "results": results}
