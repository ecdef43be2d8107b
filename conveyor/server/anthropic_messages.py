"""Anthropic's Messages API over the chat machinery: a request becomes chat messages, a `ToolPlan` and
sampling fields (rendered, constrained and sampled as chat completions are), and the reply becomes
Anthropic's content blocks, whole or as the stream's events.

- Conversation: `system` (a string or text blocks) is the system message; a user's `tool_result`
  blocks become tool messages (before the user's text), an assistant's `tool_use` blocks its tool
  calls and its `thinking` blocks its reasoning (`reasoning_content`, which a template may render:
  Qwen3's does after the last user message); text blocks are joined with newlines. A final assistant
  message is a prefill: the reply continues its text, which is appended to the rendered prompt and
  not repeated in the reply. `thinking` sets the template's thinking switch (`thinking_kwargs`).
- Tools: `tool_choice` `auto` / `any` / `tool` / `none` are chat's "auto" / "required" / a named
  function / "none" (`tools.plan_tools`; "auto", also the default with tools, needs
  `--enable-auto-tool-choice`); `disable_parallel_tool_use` is `parallel_tool_calls: false`.
- Reply: with `--reasoning-parser`, the reasoning first as a `thinking` block (an empty `signature`:
  nothing signs it), then text blocks and `tool_use` blocks read from the answer only (`input` the
  parsed arguments); `stop_reason` is `max_tokens` (length), `tool_use` (a call was made),
  `stop_sequence` (with the string that matched) or `end_turn`.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from ..request import RequestOutput
from ..tool_parsers import ToolParser
from .anthropic_protocol import AssistantMessage, CountTokensRequest, MessagesRequest, ToolChoiceTool, UserMessage
from .protocol import APIError, ChatMessage, SamplingFields
from .replies import ReasoningPlan, switch_kwargs
from .tools import ToolPlan, plan_tools

CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # Anthropic's tool_choice -> chat's


def new_id(kind: str) -> str:
    """An id as Anthropic writes them: `msg_...`, `toolu_...`."""
    return f"{kind}_{uuid.uuid4().hex[:24]}"


def chat_messages(body: CountTokensRequest) -> tuple[list[ChatMessage], str]:
    """(the chat messages the template renders, the prefill: a final assistant message's text)."""
    out = []
    system = body.system if isinstance(body.system, str) or body.system is None else "\n".join(
        b.text for b in body.system)
    if system:
        out.append(ChatMessage(role="system", content=system))
    prefill = ""
    for i, message in enumerate(body.messages):
        texts, calls, results, thoughts = _blocks(message, i)
        if message.role == "user":
            out += results
            if texts or not results:
                out.append(ChatMessage(role="user", content="\n".join(texts)))
        elif i == len(body.messages) - 1 and not calls:
            prefill = "\n".join(texts)
        else:
            out.append(ChatMessage(role="assistant", content="\n".join(texts) or None, tool_calls=calls or None,
                                   reasoning_content="\n".join(thoughts) or None))
    if not any(m.role != "system" for m in out):
        raise APIError(400, "messages: the conversation needs a user message before a prefill", param="messages")
    return out, prefill


def _blocks(message: UserMessage | AssistantMessage,
            i: int) -> tuple[list[str], list[dict[str, Any]], list[ChatMessage], list[str]]:
    """A message's (texts, tool calls, tool result messages, thinking); 400 for what the served model
    cannot read."""
    if isinstance(message.content, str):
        return [message.content], [], [], []
    texts, calls, results, thoughts = [], [], [], []
    for j, block in enumerate(message.content):
        where = f"messages[{i}].content[{j}]"
        if block.type == "text":
            texts.append(block.text)
        elif block.type == "thinking":
            thoughts.append(block.thinking)
        elif block.type in ("image", "document"):
            raise APIError(400, f"{where}: {block.type} blocks are not supported (the served model reads text only)",
                           param="messages")
        elif block.type == "tool_use":
            calls.append({"id": block.id, "type": "function", "function": {"name": block.name,
                                                                            "arguments": block.input}})
        elif block.type == "tool_result":
            content = block.content
            if not isinstance(content, str):
                if any(part.type != "text" for part in content):
                    raise APIError(400, f"{where}: tool results may hold text only (the served model reads text "
                                   "only)", param="messages")
                content = "\n".join(part.text for part in content)  # type: ignore[union-attr]
            results.append(ChatMessage(role="tool", content=content, tool_call_id=block.tool_use_id))
    return texts, calls, results, thoughts


def thinking_kwargs(body: CountTokensRequest, template: str) -> dict[str, Any]:
    """`thinking` as the template's thinking switch (`replies.switch_kwargs`): `enabled` on, `disabled`
    off; `adaptive`, or no `thinking`, leaves the template's default."""
    kind = body.thinking.type if body.thinking is not None else "adaptive"
    return switch_kwargs(template, None if kind == "adaptive" else kind == "enabled")


def tool_plan(body: CountTokensRequest, parser: type[ToolParser], auto_enabled: bool) -> ToolPlan:
    """The chat tool plan of the body's `tools` and `tool_choice` (400s naming the field)."""
    tools = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema.model_dump()}
              | ({"description": t.description} if t.description is not None else {})} for t in body.tools or []]
    choice, parallel = body.tool_choice, True
    openai_choice: Any = None
    if choice is not None:
        if choice.type != "none" and not tools:
            raise APIError(400, f"tool_choice {choice.type!r} needs tools", param="tool_choice")
        openai_choice = ({"type": "function", "function": {"name": choice.name}} if isinstance(choice, ToolChoiceTool)
                         else CHOICES[choice.type])
        parallel = not choice.disable_parallel_tool_use
    return plan_tools(tools, openai_choice, parser, auto_enabled, parallel)


def sampling_fields(body: MessagesRequest, budgets: bool = False) -> SamplingFields:
    """The body's sampling options as the fields chat completions build requests from; `budgets`: the
    engine enforces thinking budgets (it knows the reasoning markers), so that
    `thinking.budget_tokens` caps its thinking (`thinking_token_budget`)."""
    thinking = body.thinking
    budget = thinking.budget_tokens if budgets and thinking is not None and thinking.type == "enabled" else None
    return SamplingFields(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                          stop=body.stop_sequences or None, request_timeout=body.request_timeout,
                          priority=body.priority, thinking_token_budget=budget)


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, int]:
    """Anthropic's split of the prompt: `input_tokens` are those computed, `cache_read_input_tokens` those
    the prefix cache held (automatic here, so nothing counts as a cache write)."""
    return {"input_tokens": prompt_tokens - cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached_tokens, "output_tokens": output_tokens}


class MessageReply:
    """One reply, fed its growing text, as Anthropic content blocks: the stream's events as it grows,
    the whole content and stop reason at the end. Streamed or not, the same code reads the reply, so a
    stream's blocks add up to the whole answer's. `reasoning`: how the server's reasoning parser splits
    the reply (`replies.plan_reasoning`; `include` false: thinking blocks without their text)."""

    def __init__(self, plan: ToolPlan, reasoning: ReasoningPlan | None = None) -> None:
        self.plan = plan
        reasoning = reasoning or ReasoningPlan()
        self.split, self.include = reasoning.reply(), reasoning.include
        self.answer = ""  # with a split: the answer so far, what the rest reads
        # "auto": the model's own format, read in order (text may come before and after calls);
        # "named" / "required": the constrained calls, nothing else
        self.parser = plan.parser(plan.functions) if plan.mode == "auto" else None
        self.constrained = plan.reply() if plan.mode in ("named", "required") else None
        self.seen = 0  # characters of a plain answer already read
        self.blocks: list[dict[str, Any]] = []  # tool_use blocks hold their arguments' JSON text in "json"
        self.calls: dict[int, int] = {}  # call number -> its block's index
        self.open = False  # the last block still takes deltas

    def parts(self, text: str, finished: bool) -> list[dict[str, Any]]:
        """What the reply adds since the last feed, in its order: `{"thinking": ...}` (the reasoning, split off
        first), then from the answer only `{"text": ...}` or `{"call": n, "name": ..., "arguments": ...}` (a
        call's arguments may come in several parts). The one place the reply is read."""
        parts: list[dict[str, Any]] = []
        if self.split is not None:
            thought, answer = self.split.feed(text, finished)
            if thought:
                parts.append({"thinking": thought})
            self.answer += answer
            text = self.answer
        if self.parser is not None:
            for piece in self.parser.pieces(text, finished):
                if isinstance(piece, str):
                    parts.append({"text": piece})
                elif self.plan.parallel or not self.calls:  # as chat: the first call only, unless parallel
                    parts.append({"call": len(self.calls), "name": piece.name, "arguments": piece.arguments})
            return parts
        if self.constrained is not None:
            return parts + [{"call": p["index"], "name": p["function"].get("name"),
                             "arguments": p["function"]["arguments"]}
                            for p in self.constrained.feed(text, finished).get("tool_calls", [])]
        new, self.seen = text[self.seen:], len(text)
        return parts + ([{"text": new}] if new else [])

    def feed(self, text: str, finished: bool) -> list[dict[str, Any]]:
        """The stream events (content_block_start / _delta / _stop) for the reply's growing text."""
        events = []
        for part in self.parts(text, finished):
            kind = "thinking" if "thinking" in part else "text" if "text" in part else None
            if kind is not None:
                if not (self.open and self.blocks[-1]["type"] == kind):
                    events += self._start({"type": kind, kind: ""} | ({"signature": ""} if kind == "thinking" else {}))
                if kind == "text" or self.include:
                    self.blocks[-1][kind] += part[kind]
                    events.append(self._delta(len(self.blocks) - 1, {"type": f"{kind}_delta", kind: part[kind]}))
                continue
            if part["call"] not in self.calls:
                events += self._start({"type": "tool_use", "id": new_id("toolu"), "name": part["name"], "input": {}})
                self.calls[part["call"]] = len(self.blocks) - 1
            index = self.calls[part["call"]]
            if part["arguments"]:
                self.blocks[index]["json"] = self.blocks[index].get("json", "") + part["arguments"]
                events.append(self._delta(index, {"type": "input_json_delta", "partial_json": part["arguments"]}))
        if finished and self.open:
            events += self._stop()
        return events

    def _stop(self) -> list[dict[str, Any]]:
        """The open block's end; a thinking block's signature just before it, as Anthropic's stream sends it."""
        index, self.open = len(self.blocks) - 1, False
        signed = self.blocks[index]["type"] == "thinking"
        return ([self._delta(index, {"type": "signature_delta", "signature": ""})] if signed else []) + [
            {"type": "content_block_stop", "index": index}]

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._stop() if self.open else []
        self.blocks.append(block)
        self.open = True
        return events + [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)}]

    @staticmethod
    def _delta(index: int, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": index, "delta": delta}

    def content(self) -> list[dict[str, Any]]:
        """The content blocks so far; a tool_use's `input` is its arguments parsed ({} while they do not
        parse: the reply was cut inside them)."""
        out = []
        for block in self.blocks:
            if block["type"] == "tool_use":
                block = {k: v for k, v in block.items() if k != "json"} | {"input": _parsed(block.get("json", ""))}
            out.append(block)
        return out

    def stop_reason(self, out: RequestOutput) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) of the finished reply."""
        if out.finish_reason == "length":
            return "max_tokens", None
        if any(b["type"] == "tool_use" for b in self.blocks):
            return "tool_use", None
        if isinstance(out.stop_reason, str):
            return "stop_sequence", out.stop_reason
        return "end_turn", None


def _parsed(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}
