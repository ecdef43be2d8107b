"""OpenAI's Responses API: POST /v1/responses (whole, streamed or in the background), GET and DELETE
/v1/responses/{id}, POST /v1/responses/{id}/cancel.

A request is a chat completion underneath: its input items become chat turns, after the previous
response's conversation (`previous_response_id`) if any, with `instructions` as a system turn first;
tools, tool_choice and text.format go through the chat route's plan and constraints, and the reply is
read as chat's is: reasoning (with `--reasoning-parser`), then the answer's message and calls
(`responses.items`); `reasoning.effort` sets the template's thinking switch, over the server's
`--default-chat-template-kwargs`. The response runs on its own task (`responses.run`) and, unless
`store: false`, stays in the server's memory (`responses.store`) for GET, cancel and the next turn.
Cancelling or deleting a response in progress, or a client leaving, cancels its engine request, so
its KV blocks return to the pool within a step.
"""

from __future__ import annotations

import functools
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from ..openapi import STREAMED, ErrorResponse, error_responses
from ..protocol import APIError, ChatMessage
from ..replies import effort_kwargs, plan_reasoning, template_options
from ..request_fields import check_logprobs
from ..responses.items import input_turns, sampling_fields, text_constraint, tool_plan
from ..responses.protocol import ResponsesRequest
from ..responses.run import ResponseRun, response_object
from ..responses.store import ResponseStore, StoredResponse
from ..serving import ChatPrompt, Serving
from ..streaming import SSEResponse, unless_disconnected
from ..tools import ToolPlan
from .deps import AUTH, ServingDep

router = APIRouter()
NOT_FOUND = {404: {"model": ErrorResponse, "description": "no stored response with that id"}}


def get_store(request: Request) -> ResponseStore:
    return request.app.state.responses


StoreDep = Annotated[ResponseStore, Depends(get_store)]


@router.post("/v1/responses", dependencies=AUTH,
             responses=STREAMED | error_responses(400, 401, 404, 413, 500, 503, 504))
async def create_response(body: ResponsesRequest, raw: Request, serving: ServingDep, store: StoreDep) -> Response:
    adapter = serving.check_model(body.model)
    if body.background and (body.stream or not body.store or not store.capacity):
        raise APIError(400, "background responses need store: true on a server that stores responses "
                       "(--max-stored-responses above 0), and are not streamed (poll GET /v1/responses/{id})",
                       param="background")
    history: list[ChatMessage] = []
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id)
        if previous is None:
            raise APIError(404, f"Previous response with id '{body.previous_response_id}' not found.",
                           param="previous_response_id", code="previous_response_not_found")
        if previous.running:
            raise APIError(400, f"previous response '{body.previous_response_id}' is still in progress",
                           param="previous_response_id")
        history = previous.history
    plan = tool_plan(body, serving.tool_parser, serving.settings.enable_auto_tool_choice)
    forced, text = plan.constraint, text_constraint(body)
    if forced is not None and text is not None:
        raise APIError(400, "tool_choice constrains the output; it cannot be combined with text.format",
                       param="tool_choice")
    if text is not None and body.structured_outputs is not None:
        raise APIError(400, "text.format and structured_outputs both constrain the output: give one",
                       param="structured_outputs")
    check_logprobs(serving.max_logprobs, top_logprobs=body.top_logprobs)
    conversation = history + input_turns(body)
    if not conversation:
        raise APIError(400, "input is empty: no message to answer", param="input")
    instructions = [ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    effort = body.reasoning.effort if body.reasoning is not None else None
    options = template_options(effort_kwargs(serving.chat_template, effort) | (body.chat_template_kwargs or {}),
                               serving.settings.default_chat_template_kwargs)
    prompt = await fitting_prompt(serving, body, instructions, conversation, plan, options)
    reasoning = plan_reasoning(serving.reasoning_parser, prompt.text, options["chat_template_kwargs"],
                               (forced is not None or text is not None or body.structured_outputs is not None)
                               and not serving.constraints_after_reasoning, body.include_reasoning)
    response_id = f"resp_{uuid.uuid4().hex}"
    logprobs = (body.top_logprobs or 0) if body.wants_logprobs() else None
    requests = await serving.prepare(serving.build_requests, response_id, [prompt.ids], sampling_fields(body),
                                     body.max_output_tokens, logprobs, "input",
                                     constraint=(forced, "tools") if forced else (text, "text"),
                                     keep_special=(plan.mode == "auto" and serving.keep_special)
                                     or (reasoning.parser is not None and serving.keep_reasoning_special),
                                     lora_request=adapter)
    sub = serving.submit(requests)
    run = ResponseRun(response_object(response_id, body, serving.reply_model(adapter), requests[0].params), plan,
                      reasoning, sub, len(prompt.ids), conversation, body.stream,
                      None if logprobs is None else functools.partial(
                          serving.logprobs.chat, n=logprobs, as_ids=serving.settings.return_tokens_as_token_ids))
    if body.store:
        store.put(response_id, run.record)
    run.start()
    if body.background:
        return JSONResponse(run.response)
    if body.stream:
        return SSEResponse(run.events(), sub)
    try:
        await unless_disconnected(raw.receive, run.record.done.wait())
    finally:
        sub.cancel()
    if run.failure is not None:
        raise run.failure
    return JSONResponse(run.response)


def render(serving: Serving, messages: list[ChatMessage], plan: ToolPlan, options: dict[str, Any],
           truncating: bool = False) -> ChatPrompt:
    """The conversation rendered, its errors naming `input` (call it off the event loop)."""
    try:
        return serving.render_chat_prompt(messages, plan, truncating=truncating, **options)
    except APIError as exc:
        exc.param = "input"
        raise


async def fitting_prompt(serving: Serving, body: ResponsesRequest, instructions: list[ChatMessage],
                         conversation: list[ChatMessage], plan: ToolPlan, options: dict[str, Any]) -> ChatPrompt:
    """The request rendered; with `truncation: "auto"`, where the whole conversation leaves no room for
    max_output_tokens (or one token), without its oldest turns: it starts at the earliest user turn
    from which it fits (OpenAI drops the first items; a cut before a user turn keeps the roles as
    templates expect them). When no cut fits, the whole one, which is then refused as too long."""
    auto = body.truncation == "auto"
    prompt = await serving.prepare(render, serving, instructions + conversation, plan, options, auto)
    room = serving.max_model_len - (body.max_output_tokens or 1)
    if not auto or len(prompt.ids) <= room:
        return prompt
    cuts = [i for i, turn in enumerate(conversation) if i > 0 and turn.role == "user"]
    lo, hi, best = 0, len(cuts) - 1, prompt  # the fewest turns dropped that fit: a shorter tail never grows
    while lo <= hi:
        mid = (lo + hi) // 2
        tail = await serving.prepare(render, serving, instructions + conversation[cuts[mid]:], plan, options, auto)
        if len(tail.ids) <= room:
            best, hi = tail, mid - 1
        else:
            lo = mid + 1
    return best


def stored(store: ResponseStore, response_id: str) -> StoredResponse:
    entry = store.get(response_id)
    if entry is None:
        raise APIError(404, f"Response with id '{response_id}' not found.", param="response_id",
                       code="response_not_found")
    return entry


@router.get("/v1/responses/{response_id}", dependencies=AUTH, responses=error_responses(400, 401) | NOT_FOUND)
async def retrieve_response(response_id: str, store: StoreDep, stream: bool = False) -> dict[str, Any]:
    if stream:
        raise APIError(400, "streaming a stored response again is not supported", param="stream")
    return stored(store, response_id).response


@router.delete("/v1/responses/{response_id}", dependencies=AUTH, responses=error_responses(401) | NOT_FOUND)
async def delete_response(response_id: str, store: StoreDep) -> dict[str, Any]:
    entry = stored(store, response_id)
    store.pop(response_id)
    if entry.cancel is not None:
        entry.cancel()
    return {"id": response_id, "object": "response", "deleted": True}


@router.post("/v1/responses/{response_id}/cancel", dependencies=AUTH,
             responses=error_responses(400, 401) | NOT_FOUND)
async def cancel_response(response_id: str, store: StoreDep) -> dict[str, Any]:
    """Cancels a response in progress (background or not) and answers it as it ended; cancelling a
    cancelled one answers it again."""
    entry = stored(store, response_id)
    if entry.cancel is not None:
        entry.cancel()
        await entry.done.wait()
    elif entry.response["status"] != "cancelled":
        raise APIError(400, f"response '{response_id}' is {entry.response['status']}: only a response in "
                       "progress can be cancelled", param="response_id")
    return entry.response
