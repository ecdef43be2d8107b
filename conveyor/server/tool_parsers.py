"""Tool calls written by the model itself (`tool_choice: "auto"`), parsed per model family.

Most open chat models (Hermes, Qwen 2.5/3, SmolLM2's tool-use tunes, ...) emit a call as a
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block; that is the default parser.
Parsing is incremental (`feed(text_so_far, finished)`) so a stream sends content as it comes, holds
back what may be the start of a block, and sends each call once its block closes; the whole-text
`parse` runs the same code once, so a streamed reply reassembles to exactly the non-streamed one.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def call_from_json(text: str) -> ToolCall | None:
    """`{"name": ..., "arguments": {...}}` (or "parameters", as Llama 3's format) as a call; None if it is not one."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string already
        return ToolCall(value["name"], arguments)
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


class HermesToolParser:
    """Incremental parser of one reply: content outside the blocks (stripped, as a whole), and the calls."""

    start, end = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self.pos = 0  # characters of the text consumed
        self.started = False  # some content already sent (leading whitespace is dropped)
        self.spaces = ""  # whitespace held back: sent only if more content follows
        self.calls: list[ToolCall] = []

    def feed(self, text: str, finished: bool) -> tuple[str, list[ToolCall]]:
        """The content delta and the calls completed since the last feed of this (growing) text."""
        content, calls = [], []
        while True:
            at = text.find(self.start, self.pos)
            if at < 0:
                stop = len(text) if finished else len(text) - self._partial_start(text)
                content.append(self._content(text[self.pos:max(stop, self.pos)]))
                self.pos = max(stop, self.pos)
                break
            content.append(self._content(text[self.pos:at]))
            close = text.find(self.end, at)
            if close < 0 and not finished:
                self.pos = at
                break
            body = text[at + len(self.start):close if close >= 0 else len(text)]
            call = call_from_json(body.strip())
            if call is None:  # not a call after all: it is content
                content.append(self._content(text[at:close + len(self.end) if close >= 0 else len(text)]))
            else:
                calls.append(call)
            self.pos = close + len(self.end) if close >= 0 else len(text)
        self.calls += calls
        return "".join(content), calls

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole reply: (content or None, calls)."""
        content, calls = self.feed(text, finished=True)
        return content or None, calls

    def _content(self, piece: str) -> str:
        """Content with strip() semantics across pieces: leading whitespace dropped, trailing held back."""
        if not piece:
            return ""
        if not self.started:
            piece = piece.lstrip()
            if not piece:
                return ""
            self.started = True
        body = piece.rstrip()
        if not body:
            self.spaces += piece
            return ""
        out, self.spaces = self.spaces + body, piece[len(body):]
        return out

    def _partial_start(self, text: str) -> int:
        """Length of the longest tail of `text` that could begin a start tag (held back while streaming)."""
        for n in range(min(len(self.start) - 1, len(text) - self.pos), 0, -1):
            if self.start.startswith(text[-n:]):
                return n
        return 0


# model_type -> parser, for the families whose tool calls are not Hermes blocks (none supported yet).
FAMILIES: dict[str, type[HermesToolParser]] = {}


def parser_for(model_type: str | None) -> type[HermesToolParser]:
    """The tool parser of the model's family; Hermes blocks by default."""
    return FAMILIES.get(model_type or "", HermesToolParser)
