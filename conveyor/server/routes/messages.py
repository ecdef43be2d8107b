"""POST /v1/messages and POST /v1/messages/count_tokens: Anthropic's Messages API (the `anthropic` SDK,
Claude Code) over the chat machinery (`anthropic_messages`), whole or as Anthropic's server-sent
events: `message_start`, then per content block `content_block_start`, `content_block_delta`
(`thinking_delta` then one `signature_delta`, `text_delta`, `input_json_delta`) and
`content_block_stop`, then `message_delta` (stop reason, output tokens) and `message_stop`; a request
that fails midway ends with an `error` event. Errors are Anthropic's error objects (`errors.answer`);
the key may come as `x-api-key`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..anthropic_messages import (MessageReply, chat_messages, new_id, sampling_fields, thinking_kwargs, tool_plan,
                                  usage)
from ..anthropic_protocol import AnthropicErrorResponse, CountTokensRequest, MessagesRequest, anthropic_error
from ..outcomes import failure
from ..replies import plan_reasoning, template_options
from ..serving import ChatPrompt, Serving
from ..streaming import SSEResponse, collect, dumps
from ..submission import Submission
from ..tools import ToolPlan
from .deps import ANTHROPIC_AUTH, ServingDep

router = APIRouter()

ERRORS = {400: "invalid_request_error: validation, context length, unsupported field or block",
          401: "authentication_error: missing or wrong API key (when the server has one)",
          404: "not_found_error: model not served", 413: "request_too_large: body over --max-request-bytes",
          500: "api_error: the request failed inside the engine",
          504: "timeout_error: the request was still waiting or running at its request_timeout",
          529: "overloaded_error: queue full, shutting down, or the engine is dead"}
STREAMED = {200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
                  "description": "the message; with `stream: true`, Anthropic's server-sent events"}}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a route answering these statuses with Anthropic's error object."""
    return {code: {"model": AnthropicErrorResponse, "description": ERRORS[code]} for code in codes}


def render(serving: Serving, body: CountTokensRequest, plan: ToolPlan) -> tuple[ChatPrompt, dict[str, Any]]:
    """The prompt: the conversation through the chat template (`thinking` as its switch, over the server's
    default template kwargs), then the prefill; and the template options it was rendered with (call it
    off the event loop: `prepare`)."""
    messages, prefill = chat_messages(body)
    options = template_options(thinking_kwargs(body, serving.chat_template),
                               serving.settings.default_chat_template_kwargs)
    prompt = serving.render_chat_prompt(messages, plan, **options)
    if not prefill:
        return prompt, options
    serving.check_length(prefill, "messages")
    return ChatPrompt(prompt.text + prefill,
                      prompt.ids + serving.tokenizer.encode(prefill, add_special_tokens=False)), options


@router.post("/v1/messages", dependencies=ANTHROPIC_AUTH,
             responses=STREAMED | error_responses(400, 401, 404, 413, 500, 504, 529))
async def messages(body: MessagesRequest, raw: Request, serving: ServingDep) -> Response:
    adapter = serving.check_model(body.model)
    plan = tool_plan(body, serving.tool_parser, serving.settings.enable_auto_tool_choice)
    prompt, options = await serving.prepare(render, serving, body, plan)
    shown = body.thinking is None or body.thinking.display != "omitted"
    reasoning = plan_reasoning(serving.reasoning_parser, prompt.text, options["chat_template_kwargs"],
                               plan.mode in ("named", "required") and not serving.constraints_after_reasoning,
                               include=shown)
    message_id = new_id("msg")
    budgets = reasoning.parser is not None and serving.thinking_budgets
    requests = await serving.prepare(serving.build_requests, message_id, [prompt.ids], sampling_fields(body, budgets),
                                     body.max_tokens, None, "messages", constraint=(plan.constraint, "tools"),
                                     keep_special=(plan.mode == "auto" and serving.keep_special)
                                     or (reasoning.parser is not None and serving.keep_reasoning_special),
                                     lora_request=adapter)
    sub = serving.submit(requests)
    head = {"id": message_id, "type": "message", "role": "assistant", "model": serving.reply_model(adapter)}
    reply = MessageReply(plan, reasoning)
    if body.stream:
        return SSEResponse(events(sub, head, len(prompt.ids), reply), sub)
    [out] = await collect(sub, raw)
    reply.feed(out.text, True)
    reason, sequence = reply.stop_reason(out)
    return JSONResponse(head | {"content": reply.content(), "stop_reason": reason, "stop_sequence": sequence,
                                "usage": usage(len(prompt.ids), out.num_output_tokens, out.num_cached_tokens)})


def event(data: dict[str, Any]) -> str:
    return f"event: {data['type']}\ndata: {dumps(data)}\n\n"


async def events(sub: Submission, head: dict[str, Any], prompt_tokens: int, reply: MessageReply) -> AsyncIterator[str]:
    """Anthropic's event sequence for one streamed reply (see the module docstring); it starts with the first
    output, which knows the prompt tokens the cache held (the response sends nothing before it anyway)."""
    started = False
    async for _, out in sub.outputs():
        if not started:
            started = True
            yield event({"type": "message_start", "message": head | {
                "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": usage(prompt_tokens, 0, out.num_cached_tokens)}})
        if (err := failure(out)) is not None:
            yield event(anthropic_error(err.status, err.message)[1])
            return
        for data in reply.feed(out.text, out.finished):
            yield event(data)
        if out.finished:
            reason, sequence = reply.stop_reason(out)
            yield event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                         "usage": {"output_tokens": out.num_output_tokens}})
            yield event({"type": "message_stop"})


@router.post("/v1/messages/count_tokens", dependencies=ANTHROPIC_AUTH, responses=error_responses(400, 401, 404, 413))
async def count_tokens(body: CountTokensRequest, serving: ServingDep) -> dict[str, int]:
    """The prompt's tokens: `usage.input_tokens` + `cache_read_input_tokens` of the same request (tools count
    whether or not the server takes `tool_choice` "auto")."""
    serving.check_model(body.model)
    plan = tool_plan(body, serving.tool_parser, auto_enabled=True)
    prompt, _ = await serving.prepare(render, serving, body, plan)
    return {"input_tokens": len(prompt.ids)}
