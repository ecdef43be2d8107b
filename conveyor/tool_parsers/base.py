"""What every tool-call format shares: the incremental reading of a reply into content and calls.

A format names the texts that open a tool region (`starts`) and reads one region (`region`); the
base class walks the growing text: content is sent as it comes (with `strip()` semantics across
pieces), a tail that may be the beginning of a start marker is held back, and a region's calls are
sent once the region is complete. A region that turns out not to be a call is content. Feeding the
whole reply at once runs the same code, so the streamed deltas concatenate to exactly the whole
reply's content and calls, however the text was cut.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Region:
    """A tool region read: where it ends, and its calls as (name, arguments JSON); calls None: not a
    call after all (the region's text is content); [] : markup that is dropped."""

    end: int
    calls: list[tuple[str, str]] | None


def incomplete(text: str, finished: bool) -> Region | None:
    """A region the text ends inside: wait for more, or (the reply is over) it is content."""
    return Region(len(text), None) if finished else None


class ToolParser:
    """Incremental parser of one reply. Subclasses set `name`, `families`, `starts` and `region`."""

    name: ClassVar[str] = ""
    families: ClassVar[str] = ""  # the models that write this format (the docs' table)
    example: ClassVar[str] = ""  # one call as those models write it
    starts: ClassVar[tuple[str, ...]] = ()
    # Markers that some tokenizers of the family hold as special tokens: the reply is decoded with
    # skip_special_tokens=False when the served tokenizer would drop one of them.
    special: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.schemas = {f["name"]: f.get("parameters") or {} for f in tools or []}  # name -> parameters
        self.pos = 0  # characters of the text consumed
        self.started = False  # some content already sent (leading whitespace is dropped)
        self.spaces = ""  # whitespace held back: sent only if more content follows

    @staticmethod
    def new_id() -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def region(self, text: str, at: int, marker: str, finished: bool) -> Region | None:
        """The region that `marker` opens at `at`; None while more text may change it (never when finished)."""
        raise NotImplementedError

    def find_start(self, text: str, pos: int) -> tuple[int, str]:
        """The first start marker at or after `pos`: (index, marker), or (-1, "")."""
        best, found = -1, ""
        for marker in self.starts:
            at = text.find(marker, pos)
            if at >= 0 and (best < 0 or at < best):
                best, found = at, marker
        return best, found

    def feed(self, text: str, finished: bool) -> tuple[str, list[ToolCall]]:
        """The content delta and the calls completed since the last feed of this (growing) text."""
        pieces = self.pieces(text, finished)
        return "".join(p for p in pieces if isinstance(p, str)), [p for p in pieces if isinstance(p, ToolCall)]

    def pieces(self, text: str, finished: bool) -> list[str | ToolCall]:
        """`feed`'s content and calls in the order the reply has them (for APIs whose content blocks keep
        that order: Anthropic's)."""
        pieces: list[str | ToolCall] = []
        while True:
            at, marker = self.find_start(text, self.pos)
            if at < 0:
                stop = max(len(text) if finished else len(text) - self.held(text), self.pos)
                pieces.append(self._content(text[self.pos:stop]))
                self.pos = stop
                break
            pieces.append(self._content(text[self.pos:at]))
            region = self.region(text, at, marker, finished)
            if region is None:
                self.pos = at
                break
            if region.calls is None:
                pieces.append(self._content(text[at:region.end]))
            else:
                pieces += [ToolCall(name, arguments, self.new_id()) for name, arguments in region.calls]
            assert region.end > at, f"{self.name}: a region must consume its marker"
            self.pos = region.end
        return [p for p in pieces if p != ""]

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole reply: (content or None, calls)."""
        content, calls = self.feed(text, finished=True)
        return content or None, calls

    def held(self, text: str) -> int:
        """Length of the longest tail of `text` that could begin a start marker (held back while streaming)."""
        longest = 0
        for marker in self.starts:
            for n in range(min(len(marker) - 1, len(text) - self.pos), longest, -1):
                if marker.startswith(text[-n:]):
                    longest = n
                    break
        return longest

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


# -- JSON pieces the formats share ------------------------------------------------------------
SCALAR = re.compile(r'-?[0-9][0-9.eE+\-]*|true|false|null')
CLOSING = {"{": "}", "[": "]"}


def skip_spaces(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def json_end(text: str, start: int) -> int | None:
    """Index just past the JSON value starting at `start` (objects, arrays, strings, scalars), or None
    when the text ends first. It tracks strings and nesting only: json.loads judges validity; a value
    that cannot be JSON ends at its first character."""
    if start >= len(text):
        return None
    first = text[start]
    if first in CLOSING or first == '"':
        depth, in_string, escaped = 0, False, False
        for i in range(start, len(text)):
            c = text[i]
            if in_string:
                if escaped:
                    escaped = False
                elif c == "\\":
                    escaped = True
                elif c == '"':
                    in_string = False
                    if depth == 0:
                        return i + 1
            elif c == '"':
                in_string = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
        return None
    match = SCALAR.match(text, start)
    if match is None:
        return start + 1
    return None if match.end() == len(text) else match.end()


def load_json(text: str) -> tuple[bool, Any]:
    """(parsed, value)."""
    try:
        return True, json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return False, None


def arguments_text(value: Any) -> str:
    """Arguments as OpenAI sends them: JSON text (a model that wrote them as a string already keeps it)."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def call_from_object(value: Any, require_arguments: bool = False) -> tuple[str, str] | None:
    """`{"name": ..., "arguments": {...}}` (or "parameters", Llama 3's key) as (name, arguments JSON);
    None when it is not a call."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    key = "arguments" if "arguments" in value else "parameters"
    if require_arguments and key not in value:
        return None
    return value["name"], arguments_text(value.get(key, {}))


def calls_from_json(text: str, require_arguments: bool = False) -> list[tuple[str, str]] | None:
    """A call object or a list of them, as JSON text; None unless every element is a call."""
    ok, value = load_json(text)
    values = value if isinstance(value, list) else [value]
    calls = [call_from_object(v, require_arguments) for v in values]
    if not ok or not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]
