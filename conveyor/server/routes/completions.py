"""POST /v1/completions: prompts (text or token ids) in, choices out, streamed or whole."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ...request import RequestOutput
from ..openapi import STREAMED, error_responses
from ..protocol import APIError, CompletionRequest
from ..request_fields import check_fields, token_limit, truncated
from ..serving import new_id, usage
from ..streaming import collect, stream_response
from .deps import AUTH, ServingDep

router = APIRouter()


@router.post("/v1/completions", dependencies=AUTH,
             responses=STREAMED | error_responses(400, 401, 404, 413, 500, 503, 504))
async def completions(body: CompletionRequest, raw: Request, serving: ServingDep) -> Response:
    adapter = serving.check_model(body.model)
    check_fields(body, "/v1/completions", serving.ignored_fields)
    if body.best_of not in (None, body.n):
        raise APIError(400, "best_of is not supported (other than = n)", param="best_of")
    if body.stream and body.prompt_logprobs is not None:  # as vLLM
        raise APIError(400, "prompt_logprobs is not available with stream: true", param="prompt_logprobs")
    texts = serving.completion_prompts(body)  # a prompt too long to fit is refused here, untokenized
    limit = token_limit(body)
    prompts = truncated(body, await serving.prepare(serving.tokenize, texts), limit, serving.max_model_len, "prompt")
    rid, created = new_id("cmpl"), int(time.time())
    requests = await serving.prepare(serving.build_requests, rid, prompts, body, limit, body.logprobs,
                                     "prompt", prompt_logprobs=body.prompt_logprobs, lora_request=adapter)
    sub = serving.submit(requests)
    head = {"id": rid, "object": "text_completion", "created": created, "model": serving.reply_model(adapter)}
    n_lp = body.logprobs

    if body.stream:
        offsets = [0] * len(requests)  # characters of text sent per choice, for logprob text offsets

        def completion_choice(i: int, out: RequestOutput, start: int) -> dict[str, Any]:
            lp = None
            if n_lp is not None:
                lp = serving.logprobs.completion(out.token_ids[start:], out.logprobs[start:], n_lp, offsets[i])
            offsets[i] += len(out.delta_text)
            return {"index": i, "text": out.delta_text, "logprobs": lp,
                    "finish_reason": out.finish_reason if out.finished else None, "stop_reason": None}

        return stream_response(sub, head, prompts, body, n_lp, completion_choice)

    finals = await collect(sub, raw)
    choices = []
    for i, out in enumerate(finals):
        lp = None if n_lp is None else serving.logprobs.completion(out.token_ids, out.logprobs, n_lp, 0)
        plp = None if out.prompt_logprobs is None else serving.logprobs.prompt(out.prompt_logprobs,
                                                                               body.prompt_logprobs or 0)
        choices.append({"index": i, "text": out.text, "logprobs": lp, "finish_reason": out.finish_reason,
                        "stop_reason": None, "prompt_logprobs": plp})
    return JSONResponse(head | {"choices": choices, "usage": usage(prompts, finals)})
