"""POST /v1/chat/completions: messages rendered with the model's chat template, streamed or whole.

With `tools`, the reply goes through a `ToolReply` per choice (tools.py): tool calls come back as
`tool_calls` (streamed as OpenAI's deltas) and `finish_reason: "tool_calls"`.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ...request import RequestOutput
from ..openapi import STREAMED, error_responses
from ..protocol import APIError, ChatCompletionRequest
from ..request_fields import check_fields, token_limit
from ..serving import new_id, usage
from ..streaming import collect, stream_response
from ..tools import plan_tools
from .deps import AUTH, ServingDep

router = APIRouter()


@router.post("/v1/chat/completions", dependencies=AUTH,
             responses=STREAMED | error_responses(400, 401, 404, 413, 500, 503))
async def chat_completions(body: ChatCompletionRequest, raw: Request, serving: ServingDep) -> Response:
    serving.check_model(body.model)
    check_fields(body, "/v1/chat/completions", serving.ignored_fields)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    n_lp = (body.top_logprobs or 0) if body.logprobs else None
    plan = plan_tools(body.tools, body.tool_choice, serving.tool_parser, serving.settings.enable_auto_tool_choice,
                      body.parallel_tool_calls)
    prompt = await serving.prepare(serving.render_chat, body.messages, plan)
    rid, created = new_id("chatcmpl"), int(time.time())
    requests = await serving.prepare(serving.build_requests, rid, [prompt], body, token_limit(body), n_lp, "messages",
                                     constraint=(plan.constraint, "tools"),
                                     keep_special=plan.mode == "auto" and serving.keep_special)
    sub = serving.submit(requests)
    head = {"id": rid, "object": "chat.completion", "created": created, "model": serving.model_name}

    if body.stream:
        replies = [plan.reply() for _ in requests] if plan.active else None

        def chat_choice(i: int, out: RequestOutput, start: int) -> dict[str, Any] | None:
            lp = None
            if n_lp is not None:
                lp = {"content": serving.logprobs.chat(out.token_ids[start:], out.logprobs[start:], n_lp)}
            reason = out.finish_reason if out.finished else None
            if replies is None:
                delta = {"content": out.delta_text} if out.delta_text or not out.finished else {}
            else:
                delta = replies[i].feed(out.text, out.finished)
                reason = replies[i].finish_reason(reason)
                if not delta and not out.finished and lp is None:
                    return None
            return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}

        roles = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None} for i in range(len(requests))]
        return stream_response(sub, head | {"object": "chat.completion.chunk"}, [prompt], body, n_lp,
                               chat_choice, first_choices=roles)

    finals = await collect(sub, raw)
    choices = []
    for i, out in enumerate(finals):
        lp = None if n_lp is None else {"content": serving.logprobs.chat(out.token_ids, out.logprobs, n_lp)}
        message, reason = {"role": "assistant", "content": out.text}, out.finish_reason
        if plan.active:
            reply = plan.reply()
            message = reply.message(out.text)
            reason = reply.finish_reason(reason)
        choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": reason})
    return JSONResponse(head | {"choices": choices, "usage": usage([prompt], finals)})
