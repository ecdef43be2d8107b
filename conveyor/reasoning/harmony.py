"""gpt-oss's harmony format: a reply is a sequence of messages, each a header up to `<|message|>`
(`<|start|>assistant`, `<|channel|>NAME`, maybe ` to=RECIPIENT` and `<|constrain|>TYPE`) and a body up
to `<|end|>`, `<|call|>` or `<|return|>`:

    <|channel|>analysis<|message|>reasoning<|end|><|start|>assistant<|channel|>final<|message|>answer

The analysis channel is reasoning (several analysis messages join with a newline), the final and
commentary channels are the answer. A message addressed to a recipient (a tool call) is passed to
the answer whole, markup included, once it ends: tool calls are not parsed from harmony here. A
reply that does not begin with harmony markup is all answer.
"""

from __future__ import annotations

import re

from .base import ReasoningParser, find_first, held

BEGIN, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
BOUNDS = (*ENDS, BEGIN, CHANNEL)  # where a body ends: its end marker, or a new header without one
HEADS = ("<|", "to=")  # what the reply's part of a header begins with (a recipient may follow the role)
HEADER, BODY, RAW = "header", "body", "raw"  # the parser's modes
CHANNEL_NAME = re.compile(r"<\|channel\|>\s*(\w+)")
RECIPIENT = re.compile(r"\bto=([^\s<]+)")


class GptOssParser(ReasoningParser):
    name = "openai_gptoss"
    families = "gpt-oss (harmony channels)"
    example = "<|channel|>analysis<|message|>reasoning<|end|><|start|>assistant<|channel|>final<|message|>answer"
    special = (BEGIN, CHANNEL, MESSAGE, "<|constrain|>", *ENDS)

    def __init__(self, prompt: str = "", thinking: bool | None = None) -> None:
        super().__init__(prompt, thinking)
        self.mode, self.header, self.header_at = HEADER, "", 0
        self.channel, self.recipient = "", None
        # The generation prompt may leave a message open (`<|start|>assistant`, or a forced channel):
        # the reply continues its header or its body.
        at = prompt.rfind(BEGIN)
        tail = prompt[at + len(BEGIN):] if at >= 0 else ""
        if tail and find_first(tail, 0, ENDS)[0] < 0:
            header, opened, _ = tail.partition(MESSAGE)
            if opened:
                self.begin_body(header)
            else:
                self.header = header

    def begin_body(self, header: str) -> None:
        name = CHANNEL_NAME.search(header)
        recipient = RECIPIENT.search(header)
        self.mode, self.channel = BODY, name.group(1) if name else ""
        self.recipient = recipient.group(1) if recipient else None

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        thoughts, answer = [], []
        while True:
            if self.mode == RAW:
                answer.append(self.answer.add(text[self.pos:]))
                self.pos = len(text)
                break
            if self.mode == HEADER:
                at = text.find(MESSAGE, self.pos)
                if at < 0:
                    rest = text[self.pos:].lstrip()
                    if not any(rest.startswith(h) or h.startswith(rest) for h in HEADS):
                        self.mode = RAW
                        continue
                    break  # a header still coming (dropped if the reply ends inside it)
                self.header_at = self.pos
                self.begin_body(self.header + text[self.pos:at])
                self.header, self.pos = "", at + len(MESSAGE)
                continue
            # A body ends at its end marker, or where a new header starts without one.
            at, marker = find_first(text, self.pos, BOUNDS)
            if self.recipient is not None:  # a tool call: whole, markup included, once it ends
                if at < 0 and not finished:
                    break
                stop = len(text) if at < 0 else at + len(marker) if marker in ENDS else at
                answer.append(self.answer.add(text[self.header_at:stop]))
                self.pos, self.mode = stop, HEADER
                if at < 0:
                    break
                continue
            stop = at if at >= 0 else len(text) if finished else len(text) - held(text, self.pos, BOUNDS)
            out, parts = (self.thoughts, thoughts) if self.channel == "analysis" else (self.answer, answer)
            parts.append(out.add(text[self.pos:max(stop, self.pos)]))
            if at < 0:
                self.pos = max(stop, self.pos)
                break
            self.pos, self.mode = at + len(marker) if marker in ENDS else at, HEADER
            if self.channel == "analysis":
                self.thoughts.separate("\n")
        return "".join(thoughts), "".join(answer)
