"""POST /v1/chat/completions: messages rendered with the model's chat template, streamed or whole."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ...request import RequestOutput
from ..openapi import STREAMED, error_responses
from ..protocol import APIError, ChatCompletionRequest
from ..serving import new_id, usage
from ..streaming import collect, stream_response
from .deps import AUTH, ServingDep

router = APIRouter()


@router.post("/v1/chat/completions", dependencies=AUTH,
             responses=STREAMED | error_responses(400, 401, 404, 500, 503))
async def chat_completions(body: ChatCompletionRequest, raw: Request, serving: ServingDep) -> Response:
    serving.check_model(body.model)
    if body.tools:
        raise APIError(400, "tools are not supported", param="tools")
    if body.response_format and body.response_format.get("type", "text") != "text":
        raise APIError(400, "only response_format {\"type\": \"text\"} is supported", param="response_format")
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    n_lp = (body.top_logprobs or 0) if body.logprobs else None
    prompt = serving.render_chat(body.messages)
    rid, created = new_id("chatcmpl"), int(time.time())
    max_tokens = body.max_completion_tokens or body.max_tokens
    requests = serving.build_requests(rid, [prompt], body, max_tokens, n_lp, "messages")
    sub = serving.submit(requests)
    head = {"id": rid, "object": "chat.completion", "created": created, "model": serving.model_name}

    if body.stream:
        def chat_choice(i: int, out: RequestOutput, start: int) -> dict[str, Any]:
            lp = None
            if n_lp is not None:
                lp = {"content": serving.chat_logprobs(out.token_ids[start:], out.logprobs[start:], n_lp)}
            delta = {"content": out.delta_text} if out.delta_text or not out.finished else {}
            return {"index": i, "delta": delta, "logprobs": lp,
                    "finish_reason": out.finish_reason if out.finished else None}

        roles = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None} for i in range(len(requests))]
        return stream_response(sub, head | {"object": "chat.completion.chunk"}, [prompt], body, n_lp,
                               chat_choice, first_choices=roles)

    finals = await collect(sub, raw)
    choices = []
    for i, out in enumerate(finals):
        lp = None if n_lp is None else {"content": serving.chat_logprobs(out.token_ids, out.logprobs, n_lp)}
        choices.append({"index": i, "message": {"role": "assistant", "content": out.text}, "logprobs": lp,
                        "finish_reason": out.finish_reason})
    return JSONResponse(head | {"choices": choices, "usage": usage([prompt], finals)})
