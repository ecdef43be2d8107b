"""Tools in chat completions: the constraint a `tool_choice` imposes, how tools and tool messages
reach the chat template, and how a reply becomes OpenAI's `tool_calls`, whole or streamed.

"required" and a named function constrain the output by the tools' parameter schemas, closed as
OpenAI's strict function calling reads them (`structured.strict`): named, the arguments object
itself; required, a list of `{"name": ..., "arguments": ...}` (one option per tool; at least one
call, at most one with `parallel_tool_calls: false`), so the arguments always parse and a small
model stops. "auto" lets the model write its own format, read by the server's tool parser
(`tool_parsers`), and needs `--enable-auto-tool-choice` as in vLLM. A template that does not know
tools (no `tools` in its source) gets them the way Qwen's template writes them: a system preamble,
calls as `<tool_call>` blocks, results as `<tool_response>`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from ..sampling_params import StructuredOutputsParams
from ..structured.strict import close_schema
from .protocol import APIError, ChatMessage
from ..tool_parsers import ToolCall, ToolParser
from ..tool_parsers.base import json_end
from ..tool_parsers.json_formats import HermesParser

PREAMBLE = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
            "function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function "
            "call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
            "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")
# One element of the "required" list, in the compact layout grammars write.
REQUIRED_HEAD = re.compile(r'\s*,?\s*\{"name": "((?:[^"\\]|\\.)*)", "arguments": ')
# The fields an assistant message's reasoning reaches a template under (Qwen3's reads `reasoning_content`).
REASONING_FIELDS = ("reasoning_content", "reasoning")
AUTO_NEEDS_FLAG = ('"auto" tool choice requires the server to be started with --enable-auto-tool-choice (its parser: '
                   '--tool-call-parser, by default read off the chat template)')


@dataclass
class ToolPlan:
    """What the request's `tools` and `tool_choice` ask for. mode: "none" | "auto" | "required" | "named"."""

    mode: str = "none"
    functions: list[dict[str, Any]] = field(default_factory=list)
    name: str | None = None
    parser: type[ToolParser] = HermesParser
    parallel: bool = True

    @property
    def active(self) -> bool:
        return self.mode != "none"

    @property
    def constraint(self) -> StructuredOutputsParams | None:
        schemas = {f["name"]: close_schema(f.get("parameters") or {"type": "object"}) for f in self.functions}
        if self.mode == "named":
            assert self.name is not None
            return StructuredOutputsParams(json=schemas[self.name])
        if self.mode != "required":
            return None
        definitions = hoist_definitions(schemas)
        calls: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"const": n}, "arguments": s},
             "required": ["name", "arguments"], "additionalProperties": False} for n, s in schemas.items()]}}
        if not self.parallel:
            calls["maxItems"] = 1
        return StructuredOutputsParams(json=calls | definitions)

    def reply(self) -> ToolReply:
        return ToolReply(self)


def hoist_definitions(schemas: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The tools' `$defs` / `definitions`, moved to the root of the "required" schema (where their
    `#/$defs/...` references point); two tools defining one name differently is a 400."""
    hoisted: dict[str, dict[str, Any]] = {}
    for name, schema in schemas.items():
        for key in ("$defs", "definitions"):
            defs = schema.pop(key, None)
            if defs is None:
                continue
            if not isinstance(defs, dict):
                raise APIError(400, f"tool {name!r}: {key} must be an object", param="tools")
            for def_name, definition in defs.items():
                if hoisted.setdefault(key, {}).setdefault(def_name, definition) != definition:
                    raise APIError(400, f"tools define {key}/{def_name} differently; tool_choice \"required\" "
                                   "needs one meaning per name", param="tools")
    return hoisted


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: Any, parser: type[ToolParser] = HermesParser,
               auto_enabled: bool = True, parallel: bool | None = True) -> ToolPlan:
    """Validate `tools` / `tool_choice` (400s naming the field) into a plan. `auto_enabled`: the server
    runs with --enable-auto-tool-choice (vLLM's rule: "auto", also as the default when tools are
    given, is refused without it)."""
    functions = []
    for i, tool in enumerate(tools or []):
        fn = _function(tool)
        if tool.get("type", "function") != "function" or not isinstance(fn.get("name"), str):
            raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                           "\"parameters\": {...}}}}", param="tools")
        if not isinstance(fn.get("parameters", {}), dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
        functions.append(fn)
    choice = tool_choice if tool_choice is not None else ("auto" if functions else "none")
    parallel = parallel is not False
    if isinstance(choice, dict):
        name = _function(choice).get("name") if choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise APIError(400, "tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                           "\"function\": {\"name\": ...}}", param="tool_choice")
        if name not in {f["name"] for f in functions}:
            raise APIError(400, f"tool_choice names function {name!r}, which is not in tools", param="tool_choice")
        return ToolPlan("named", functions, name, parser, parallel)
    if choice not in ("none", "auto", "required"):
        raise APIError(400, f"tool_choice must be \"none\", \"auto\", \"required\" or a named function, got {choice!r}",
                       param="tool_choice")
    if choice != "none" and not functions:
        raise APIError(400, f"tool_choice {choice!r} needs tools", param="tool_choice")
    if choice == "auto" and not auto_enabled:
        raise APIError(400, AUTO_NEEDS_FLAG, param="tool_choice")
    return ToolPlan(choice, functions, None, parser, parallel)


def required_calls(text: str) -> list[tuple[str, str]]:
    """(name, arguments so far) of each call in a "required" reply, `[{"name": ..., "arguments": ...}, ...]`
    as its grammar writes it; the last one's arguments may still be growing."""
    calls, pos = [], 1
    while head := REQUIRED_HEAD.match(text, pos):
        name, start = json.loads(f'"{head.group(1)}"'), head.end()
        end = json_end(text, start)
        calls.append((name, text[start:end]))
        if end is None:
            break
        pos = end + 1  # past the call object's closing brace
    return calls


class ToolReply:
    """One choice's reply under a tool plan, fed its growing text: OpenAI deltas, then the whole message."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.parser = plan.parser(plan.functions)
        self.content = ""
        self.calls: list[ToolCall] = []
        self.sent: list[int] = []  # constrained modes: characters of each call's arguments already sent

    def feed(self, text: str, finished: bool) -> dict[str, Any]:
        """The delta since the last feed of this growing text."""
        if self.plan.mode == "auto":
            content, calls = self.parser.feed(text, finished)
            if not self.plan.parallel:  # as vLLM: only the first call
                calls = calls[:max(0, 1 - len(self.calls))]
            self.content += content
            start = len(self.calls)
            self.calls += calls
            delta: dict[str, Any] = {"content": content} if content else {}
            if calls:
                delta["tool_calls"] = [{"index": start + k} | c.to_openai() for k, c in enumerate(calls)]
            return delta
        found = [(self.plan.name, text)] if self.plan.mode == "named" else required_calls(text)
        pieces = []
        for i, (name, arguments) in enumerate(found):
            piece: dict[str, Any] = {"index": i, "function": {"arguments": arguments[self.sent[i]:] if i < len(
                self.sent) else arguments}}
            if i == len(self.calls):
                assert name is not None
                self.calls.append(ToolCall(name, "", self.plan.parser.new_id()))
                self.sent.append(0)
                piece |= {"id": self.calls[i].id, "type": "function"}
                piece["function"]["name"] = name
            self.calls[i].arguments, self.sent[i] = arguments, len(arguments)
            if piece["function"]["arguments"] or "id" in piece:
                pieces.append(piece)
        return {"tool_calls": pieces} if pieces else {}

    def message(self, text: str) -> dict[str, Any]:
        """The whole reply as a chat message (after no feed: it parses `text` itself)."""
        self.feed(text, True)
        if not self.calls:
            return {"role": "assistant", "content": self.content if self.plan.mode == "auto" else text}
        return {"role": "assistant", "content": self.content or None, "tool_calls": [c.to_openai() for c in self.calls]}

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.calls and reason == "stop" else reason


def _function(entry: Any) -> dict[str, Any]:
    """`entry["function"]` when both are objects, else {} (odd shapes then fail validation, not the server)."""
    fn = entry.get("function") if isinstance(entry, dict) else None
    return fn if isinstance(fn, dict) else {}


def _arguments(call: dict[str, Any]) -> Any:
    args = _function(call).get("arguments", {})
    if isinstance(args, str):
        try:
            return json.loads(args)
        except json.JSONDecodeError:
            return args
    return args


def conversation(messages: list[ChatMessage], plan: ToolPlan, template: str, roles: dict[str, str],
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages for the template, tools for it or None). Tool calls and results go through the template
    when it knows tools; otherwise they are written into the messages as Qwen's template would. An
    assistant's reasoning goes to a template that reads it (as a message field), and nowhere else."""
    native = "tools" in template or "tool_calls" in template
    thought_fields = [f for f in REASONING_FIELDS if re.search(rf"[.'\"]{f}\b", template)]
    out: list[dict[str, Any]] = []
    for m in messages:
        role = "tool" if m.role == "tool" else roles.get(m.role)
        if role is None:
            raise APIError(400, f"unsupported message role {m.role!r} (supported: {', '.join(roles)}, tool)",
                           param="messages")
        content = m.content
        if isinstance(content, list):
            if any(p.type != "text" for p in content):
                raise APIError(400, "only text content parts are supported", param="messages")
            content = "\n".join(p.text or "" for p in content)
        entry: dict[str, Any] = {"role": role, "content": content or ""}
        if role == "assistant" and m.reasoning_content:
            entry |= dict.fromkeys(thought_fields, m.reasoning_content)
        calls = m.tool_calls or []
        if native:
            if calls:
                entry["tool_calls"] = [{"type": "function", "id": c.get("id"), "function": {
                    "name": _function(c).get("name"), "arguments": _arguments(c)}} for c in calls]
            if m.tool_call_id is not None:
                entry["tool_call_id"] = m.tool_call_id
        elif role == "tool":
            entry = {"role": "user", "content": f"<tool_response>\n{entry['content']}\n</tool_response>"}
        elif calls:
            blocks = [json.dumps({"name": _function(c).get("name"), "arguments": _arguments(c)}) for c in calls]
            entry["content"] = "\n".join(([entry["content"]] if entry["content"] else [])
                                         + [f"<tool_call>\n{b}\n</tool_call>" for b in blocks])
        out.append(entry)
    if not plan.active:
        return out, None
    if native:
        return out, [{"type": "function", "function": f} for f in plan.functions]
    preamble = PREAMBLE.format(tools="\n".join(json.dumps({"type": "function", "function": f}) for f in plan.functions))
    if out and out[0]["role"] == "system":
        out[0] = out[0] | {"content": f"{out[0]['content']}\n\n{preamble}"}
    else:
        out.insert(0, {"role": "system", "content": preamble})
    return out, None
