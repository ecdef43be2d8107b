"""POST /v1/chat/completions: messages rendered with the model's chat template, streamed or whole.

Each choice's reply goes through a `ChatReply` (replies.py): the reasoning split off by the server's
reasoning parser (`reasoning_content`), then, with `tools`, tool calls read from the answer as
OpenAI's `tool_calls` (streamed as OpenAI's deltas) and `finish_reason: "tool_calls"`. With vLLM's
`use_beam_search`, the choices are the n best beams (beam_search.py), each read the same way.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ...request import RequestOutput
from ..beam_search import beam_search, check_beam_search
from ..openapi import STREAMED, error_responses
from ..protocol import APIError, ChatCompletionRequest
from ..replies import ChatReply, effort_kwargs, plan_reasoning, role_and_echo, template_options
from ..request_fields import (cached_tokens, check_fields, check_logprobs, stream_usage, token_limit, tokens_as_ids,
                              truncated)
from ..response_format import body_constraint
from ..serving import new_id, usage
from ..streaming import collect, stream_response
from ..tools import plan_tools
from .deps import AUTH, ServingDep

router = APIRouter()


@router.post("/v1/chat/completions", dependencies=AUTH,
             responses=STREAMED | error_responses(400, 401, 404, 413, 500, 503, 504))
async def chat_completions(body: ChatCompletionRequest, raw: Request, serving: ServingDep) -> Response:
    adapter = serving.check_model(body.model)
    check_fields(body, "/v1/chat/completions", serving.ignored_fields)
    check_logprobs(serving.max_logprobs, top_logprobs=body.top_logprobs, prompt_logprobs=body.prompt_logprobs)
    if body.stream and body.prompt_logprobs is not None:  # as vLLM
        raise APIError(400, "prompt_logprobs is not available with stream: true", param="prompt_logprobs")
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    n_lp = (body.top_logprobs or 0) if body.logprobs else None
    if body.use_beam_search:
        check_beam_search(body, n_lp)
    plan = plan_tools(body.tools, body.tool_choice, serving.tool_parser, serving.settings.enable_auto_tool_choice,
                      body.parallel_tool_calls)
    own = effort_kwargs(serving.chat_template, body.reasoning_effort) | (body.chat_template_kwargs or {})
    options = template_options(own, serving.settings.default_chat_template_kwargs, body.add_generation_prompt,
                               body.continue_final_message)
    prompt = await serving.prepare(serving.render_chat_prompt, body.messages, plan,
                                   truncating=body.truncate_prompt_tokens is not None,
                                   add_special_tokens=body.add_special_tokens, documents=body.documents, **options)
    limit = token_limit(body)
    ids = truncated(body, [prompt.ids], limit, serving.max_model_len, "messages")[0]  # the template applied first
    constraint = plan.constraint
    constrained = constraint is not None or body_constraint(body)[0] is not None
    reasoning = plan_reasoning(None if body.reasoning_format == "none" else serving.reasoning_parser, prompt.text,
                               options["chat_template_kwargs"],
                               constrained and not serving.constraints_after_reasoning, body.include_reasoning)
    rid, created = new_id("chatcmpl"), int(time.time())
    head = {"id": rid, "object": "chat.completion", "created": created, "model": serving.reply_model(adapter)}
    replies = [ChatReply(reasoning, plan, *role_and_echo(body, serving.settings.response_role)) for _ in range(body.n)]

    as_ids = tokens_as_ids(body, serving.settings)

    def token_ids(ids: list[int]) -> dict[str, Any]:
        """vLLM's return_token_ids: a choice's token ids (in a stream, each chunk's new ones)."""
        return {"token_ids": ids} if body.return_token_ids else {}

    def whole(finals: list[RequestOutput]) -> JSONResponse:
        """The response of the final outputs, the choices in order."""
        choices = []
        for i, (out, reply) in enumerate(zip(finals, replies)):
            lp = None if n_lp is None else {"content": serving.logprobs.chat(out.token_ids, out.logprobs, n_lp,
                                                                             as_ids)}
            choices.append({"index": i, "message": reply.message(out.text), "logprobs": lp,
                            "finish_reason": reply.finish_reason(out.finish_reason), "stop_reason": out.stop_reason}
                           | token_ids(out.token_ids))
        extra = {"prompt_token_ids": ids} if body.return_token_ids else {}
        if body.prompt_logprobs is not None:  # vLLM's: the conversation's, once for all choices
            extra["prompt_logprobs"] = serving.logprobs.prompt(finals[0].prompt_logprobs or [], body.prompt_logprobs)
        used = usage([ids], finals, cached_tokens(finals, 1, serving.settings))
        return JSONResponse(head | {"choices": choices, "usage": used} | extra)

    keep_special = (plan.mode == "auto" and serving.keep_special) or (reasoning.parser is not None
                                                                      and serving.keep_reasoning_special)
    if body.use_beam_search:
        if constraint is not None:
            raise APIError(400, "a tool_choice that forces a call is not available with use_beam_search",
                           param="tool_choice")
        return whole(await beam_search(serving, rid, [ids], body, limit, adapter, raw, "messages", keep_special))
    requests = await serving.prepare(serving.build_requests, rid, [ids], body, limit, n_lp, "messages",
                                     prompt_logprobs=body.prompt_logprobs, constraint=(constraint, "tools"),
                                     keep_special=keep_special, lora_request=adapter)
    sub = serving.submit(requests)
    if body.stream:
        def chat_choice(i: int, out: RequestOutput, start: int) -> dict[str, Any] | None:
            lp = None
            if n_lp is not None:
                lp = {"content": serving.logprobs.chat(out.token_ids[start:], out.logprobs[start:], n_lp, as_ids)}
            delta = replies[i].feed(out.text, out.finished)
            if not delta and not out.finished and lp is None:
                return None  # its tokens go with the next chunk (`start` stays)
            return {"index": i, "delta": delta, "logprobs": lp,
                    "finish_reason": replies[i].finish_reason(out.finish_reason if out.finished else None),
                    "stop_reason": out.stop_reason if out.finished else None} | token_ids(out.token_ids[start:])

        openings = [{"index": i, "delta": reply.opening(), "logprobs": None, "finish_reason": None}
                    for i, reply in enumerate(replies)]
        return stream_response(sub, head | {"object": "chat.completion.chunk"}, [ids], body, n_lp,
                               chat_choice, first_choices=openings, **stream_usage(serving.settings))

    return whole(await collect(sub, raw))
