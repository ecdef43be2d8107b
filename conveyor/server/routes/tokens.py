"""vLLM's /tokenize and /detokenize: the served model's tokenizer and chat template, over HTTP."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from ..openapi import error_responses
from ..protocol import APIError, DetokenizeRequest, TokenizeRequest
from .deps import AUTH, ServingDep

router = APIRouter()


@router.post("/tokenize", dependencies=AUTH, responses=error_responses(400, 401, 404, 413))
async def tokenize(body: TokenizeRequest, serving: ServingDep) -> dict[str, Any]:
    serving.check_model(body.model)
    if body.messages is not None:
        tokens = await serving.prepare(serving.render_chat, body.messages)
    else:
        serving.check_length(body.prompt, "prompt")
        tokens = await serving.prepare(serving.tokenizer.encode, body.prompt,
                                       add_special_tokens=body.add_special_tokens)
    return {"count": len(tokens), "max_model_len": serving.max_model_len, "tokens": tokens, "token_strs": None}


@router.post("/detokenize", dependencies=AUTH, responses=error_responses(400, 401, 404, 413))
async def detokenize(body: DetokenizeRequest, serving: ServingDep) -> dict[str, Any]:
    serving.check_model(body.model)
    vocab = serving.llm.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token ids must be in [0, {vocab}), got {bad[:5]}", param="tokens")
    return {"prompt": serving.tokenizer.decode(body.tokens)}
