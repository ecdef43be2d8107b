"""Between the Responses API and the chat machinery: input items become chat turns (rendered by the
model's chat template as chat completions are), `tools` / `tool_choice` / `text.format` become the
chat route's tool plan and output constraint, `reasoning.effort` the template's thinking switch, and
a reply becomes output items, whole or as the stream events that build them.

A reply is read as chat completions read it (`replies.ChatReply`): the reasoning the server's
reasoning parser splits off becomes a `reasoning` item (one `reasoning_text` part, an empty
`summary`) ahead of the answer; the answer's content goes into a `message` item (one `output_text`
part, no annotations), each tool call read from the answer into a `function_call` item, in the order
the reply makes them. A reasoning item sent back as input is the reasoning of the assistant turn
that follows it, which the template renders if it reads an assistant's reasoning.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import TypeAdapter

from ...sampling_params import StructuredOutputsParams
from ...tool_parsers import ToolParser
from ..protocol import APIError, ChatMessage, SamplerFields, SamplingFields
from ..replies import ChatReply, ReasoningPlan
from ..response_format import body_constraint
from ..tools import ToolPlan, plan_tools
from .protocol import (ContentPart, FunctionCallItem, FunctionCallOutputItem, InputItem, JSONObjectFormat,
                       JSONSchemaFormat, MessageItem, NamedFunction, ReasoningItem, ResponsesRequest)

TEXT_PARTS = ("input_text", "output_text")
# The items whose text comes in one content part: (the part's type, the id's prefix, the part's fields)
TEXT_ITEMS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "message": ("output_text", "msg", {"annotations": []}), "reasoning": ("reasoning_text", "rs", {})}
ITEMS = TypeAdapter(list[InputItem])
Event = dict[str, Any]
Logprob = dict[str, Any]  # a token's entry: token, logprob, bytes, top_logprobs (as chat's)


# -- the request, as chat turns and a tool plan ---------------------------------------------------
def input_turns(body: ResponsesRequest) -> list[ChatMessage]:
    """The chat turns of the request's own input (a text is one user turn)."""
    if isinstance(body.input, str):
        return [ChatMessage(role="user", content=body.input)]
    return item_turns(body.input)


def item_turns(items: Sequence[InputItem]) -> list[ChatMessage]:
    """Chat turns of input items (or of earlier output items): function calls join the assistant turn
    just before them, as one chat message carries a reply's text and its calls; a reasoning item's text
    is the reasoning of the assistant turn that follows it (dropped when no assistant turn does)."""
    turns: list[ChatMessage] = []
    thoughts: list[str] = []  # reasoning items' text, for the next assistant turn
    for i, item in enumerate(items):
        if isinstance(item, ReasoningItem):
            thoughts += [part.text for part in item.content or []]
            continue
        thought = "\n".join(thoughts) or None
        thoughts = []
        if isinstance(item, MessageItem):
            turns.append(ChatMessage(role=item.role, content=text_of(item.content, f"input[{i}].content"),
                                     reasoning_content=thought if item.role == "assistant" else None))
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if turns and turns[-1].role == "assistant" and thought is None:
                turns[-1] = turns[-1].model_copy(update={"tool_calls": [*(turns[-1].tool_calls or []), call]})
            else:
                turns.append(ChatMessage(role="assistant", content=None, tool_calls=[call], reasoning_content=thought))
        elif isinstance(item, FunctionCallOutputItem):
            turns.append(ChatMessage(role="tool", tool_call_id=item.call_id,
                                     content=text_of(item.output, f"input[{i}].output")))
    return turns


def output_turns(items: list[dict[str, Any]]) -> list[ChatMessage]:
    """The chat turns of a response's output items, for the response that continues it."""
    return item_turns(ITEMS.validate_python(items))


def text_of(content: str | list[ContentPart], where: str) -> str:
    """The text of a message's content; a part that is not text (an image, a file, audio) is a 400."""
    if isinstance(content, str):
        return content
    for j, part in enumerate(content):
        if part.type not in TEXT_PARTS:
            raise APIError(400, f"{where}[{j}] is {part.type}: this server's models read text only "
                           f"({' and '.join(TEXT_PARTS)} parts)", param="input")
    return "\n".join(part.text for part in content)


def tool_plan(body: ResponsesRequest, parser: type[ToolParser], auto_enabled: bool) -> ToolPlan:
    """The chat route's plan for the request's function tools and tool_choice (the same rules: a
    named function or "required" forced through a grammar, "auto" read by the tool parser)."""
    tools = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
             for tool in body.tools or []]
    choice: Any = body.tool_choice
    if isinstance(choice, NamedFunction):
        choice = {"type": "function", "function": {"name": choice.name}}
    return plan_tools(tools, choice, parser, auto_enabled, body.parallel_tool_calls)


def sampling_fields(body: ResponsesRequest) -> SamplingFields:
    """The request's sampling fields as chat's (`Serving.build_requests` reads them)."""
    return SamplingFields(**body.model_dump(include={"temperature", "top_p", *SamplerFields.model_fields},
                                            exclude_unset=True))


def text_constraint(body: ResponsesRequest) -> StructuredOutputsParams | None:
    """`text.format`'s constraint, built as chat's `response_format` (a strict schema closed first)."""
    fmt = body.text.format if body.text is not None else None
    if isinstance(fmt, JSONObjectFormat):
        return StructuredOutputsParams(json_object=True)
    if not isinstance(fmt, JSONSchemaFormat):
        return None
    spec = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}
    constraint, _ = body_constraint(SamplingFields(response_format={"type": "json_schema", "json_schema": spec}))
    return constraint


# -- the reply, as output items -------------------------------------------------------------------
def reasoning_text(items: list[dict[str, Any]]) -> str:
    """The text of the reasoning items among output items (what `reasoning_tokens` counts)."""
    return "".join(part["text"] for item in items if item["type"] == "reasoning" for part in item["content"])


class OutputBuilder:
    """The output items of one reply, built as its text grows, each change announced to `emit` as a
    stream event. The events hold the live items: `emit` serializes each one before returning.

    Logprobs (the request's `include`) go to the message text that a feed adds: the entries of every
    token since the last text, reasoning and calls made in the same feed included (as vLLM, whose
    message carries all the reply's tokens); a feed that adds only reasoning or calls drops them."""

    def __init__(self, plan: ToolPlan, reasoning: ReasoningPlan | None = None,
                 emit: Callable[[Event], None] = lambda event: None) -> None:
        self.reply = ChatReply(reasoning or ReasoningPlan(), plan)
        self.emit = emit
        self.items: list[dict[str, Any]] = []
        self.calls: dict[int, dict[str, Any]] = {}  # the reply's call index -> its item
        self.open: dict[str, Any] | None = None  # the item the next change extends (the last one)
        self.pending: list[Logprob] = []  # the logprobs of tokens no message text has taken yet

    def feed(self, text: str, finished: bool, logprobs: Sequence[Logprob] = ()) -> None:
        """The reply so far: its reasoning, content and calls since the last feed, as chat's deltas;
        `logprobs`: the entries of the tokens since the last feed."""
        self.pending += logprobs
        change = self.reply.feed(text, finished)
        if change.get("reasoning_content"):
            self.add_text("reasoning", change["reasoning_content"])
        if change.get("content"):
            self.add_text("message", change["content"])
        elif change.get("reasoning_content") or change.get("tool_calls"):
            self.pending = []
        for piece in change.get("tool_calls", []):
            self.add_call(piece)

    def close(self, status: str) -> None:
        """End the open item: "completed", or "incomplete" for a reply cut short."""
        item = self.open
        if item is None:
            return
        self.open = None
        item["status"] = status
        where = self.where(item)
        if item["type"] in TEXT_ITEMS:
            part = item["content"][0]
            logprobs = {"logprobs": part["logprobs"]} if item["type"] == "message" else {}
            self.emit({"type": f"response.{part['type']}.done", **where, "content_index": 0, "text": part["text"]}
                      | logprobs)
            self.emit({"type": "response.content_part.done", **where, "content_index": 0, "part": part})
        else:
            self.emit({"type": "response.function_call_arguments.done", **where, "arguments": item["arguments"]})
        self.emit({"type": "response.output_item.done", "output_index": where["output_index"], "item": item})

    def add_text(self, kind: str, delta: str) -> None:
        """Text for a `message` or a `reasoning` item: the open one if it is of that kind, else a new one."""
        part_type, prefix, fields = TEXT_ITEMS[kind]
        item = self.open
        if item is None or item["type"] != kind:
            item = self.start({"id": f"{prefix}_{uuid.uuid4().hex}", "type": kind, "status": "in_progress"}
                              | ({"role": "assistant"} if kind == "message" else {"summary": []}) | {"content": []})
            part = {"type": part_type, "text": ""} | fields | ({"logprobs": []} if kind == "message" else {})
            item["content"].append(part)
            self.emit({"type": "response.content_part.added", **self.where(item), "content_index": 0, "part": part})
        part = item["content"][0]
        part["text"] += delta
        logprobs = {}
        if kind == "message":
            logprobs, self.pending = {"logprobs": self.pending}, []
            part["logprobs"] += logprobs["logprobs"]
        self.emit({"type": f"response.{part_type}.delta", **self.where(item), "content_index": 0, "delta": delta}
                  | logprobs)

    def add_call(self, piece: dict[str, Any]) -> None:
        """One call's change, as `ToolReply.feed` gives it: a new call carries its id and name."""
        function = piece.get("function", {})
        if "id" in piece:
            self.calls[piece["index"]] = self.start({
                "id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress",
                "call_id": piece["id"], "name": function["name"], "arguments": ""})
        item = self.calls[piece["index"]]
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            self.emit({"type": "response.function_call_arguments.delta", **self.where(item),
                       "delta": function["arguments"]})

    def start(self, item: dict[str, Any]) -> dict[str, Any]:
        """A new item after the open one, which ends complete."""
        self.close("completed")
        self.items.append(item)
        self.open = item
        self.emit({"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": item})
        return item

    def where(self, item: dict[str, Any]) -> dict[str, Any]:
        index = next(i for i, it in enumerate(self.items) if it is item)
        return {"item_id": item["id"], "output_index": index}
