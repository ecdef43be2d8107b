"""What every reasoning format shares: one reply split into reasoning and answer as its text grows.

A parser is made per reply, from the prompt the reply continues (a chat template may end its
generation prompt inside the think block, or close it to turn thinking off) and the request's
thinking switch; `feed(text, finished)` takes the whole text so far and returns what is new of the
reasoning and of the answer. A tail that may be the beginning of a marker is held back until the
next feed decides it, so feeding the whole reply at once gives exactly the concatenation of the
deltas of any split. The reasoning is stripped of surrounding whitespace (the newlines models write
around their markers), and so is the start of an answer that follows it; an answer alone is the
reply as written.

`BlockParser` reads the formats that write the reasoning as one block between markers (`<think>`
... `</think>`, Mistral's `[THINK]`, Granite's sentences); `harmony` reads gpt-oss's channels.
"""

from __future__ import annotations

from typing import ClassVar

START, OPEN, ANSWER = "start", "open", "answer"  # BlockParser's modes: before the block, in it, after it


class Stripped:
    """Text sent piece by piece with `strip()` semantics across the pieces: leading whitespace dropped
    (until `started`), trailing whitespace held back until more text follows it (never sent if none
    does; `trail=False` sends it as it comes)."""

    def __init__(self, started: bool = False, trail: bool = True) -> None:
        self.started, self.trail = started, trail
        self.spaces = ""

    def add(self, piece: str) -> str:
        if not self.started:
            piece = piece.lstrip()
            if not piece:
                return ""
            self.started = True
        if not self.trail:
            return piece
        body = piece.rstrip()
        if not body:
            self.spaces += piece
            return ""
        out, self.spaces = self.spaces + body, piece[len(body):]
        return out

    def separate(self, separator: str) -> None:
        """A whitespace separator between two parts, sent only if more text follows."""
        if self.started:
            self.spaces += separator


def skip_spaces(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def find_first(text: str, pos: int, markers: tuple[str, ...]) -> tuple[int, str]:
    """The first of `markers` at or after `pos`: (index, marker), or (-1, "")."""
    best, found = -1, ""
    for marker in markers:
        at = text.find(marker, pos)
        if at >= 0 and (best < 0 or at < best):
            best, found = at, marker
    return best, found


def held(text: str, pos: int, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of `text[pos:]` that could begin one of `markers`."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text) - pos), longest, -1):
            if marker.startswith(text[-n:]):
                longest = n
                break
    return longest


def marker_at(text: str, pos: int, markers: tuple[str, ...]) -> str | None:
    """The marker `text` holds at `pos`; "" while the text there could still become one (it ends
    inside one, or is empty); None when it cannot."""
    rest = text[pos:]
    for marker in markers:
        if rest.startswith(marker):
            return marker
    return "" if any(marker.startswith(rest) for marker in markers) else None


class ReasoningParser:
    """One reply's incremental split into (reasoning, answer). Subclasses set `name`, `families`,
    `example` and `feed`; `special` lists the markers a tokenizer of the family may hold as special
    tokens, which decoding with skip_special_tokens would drop (the server keeps them then)."""

    name: ClassVar[str] = ""
    families: ClassVar[str] = ""  # the models that write this format (the docs' table)
    example: ClassVar[str] = ""  # a reply as those models write it
    special: ClassVar[tuple[str, ...]] = ()

    def __init__(self, prompt: str = "", thinking: bool | None = None) -> None:
        """prompt: the text the reply continues (the rendered chat), which says whether the reply begins
        inside the reasoning; thinking: the request's switch (`thinking_switch`), None when unset."""
        self.thoughts = Stripped()
        self.answer = Stripped(started=True, trail=False)  # as written, unless a block ends before it
        self.pos = 0  # characters of the text consumed

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        """(reasoning delta, answer delta) since the last feed of this growing text."""
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """A whole reply: (reasoning or None, answer or None)."""
        reasoning, answer = self.feed(text, finished=True)
        return reasoning or None, answer or None


class BlockParser(ReasoningParser):
    """Reasoning as one block: from a start marker (where the reply begins, or already in the prompt)
    to an end marker; the answer follows. Subclasses set `starts` and `ends`; `markup` is dropped from
    the answer; `assume_open`: a reply whose prompt shows no marker begins inside the block (the
    format's models may leave the start marker out)."""

    starts: ClassVar[tuple[str, ...]] = ()
    ends: ClassVar[tuple[str, ...]] = ()
    markup: ClassVar[tuple[str, ...]] = ()
    assume_open: ClassVar[bool] = False

    def __init__(self, prompt: str = "", thinking: bool | None = None) -> None:
        super().__init__(prompt, thinking)
        state = self.prompt_state(prompt)
        opened = state == "open" or (state is None and self.assume_open and thinking is not False)
        self.mode = OPEN if opened else START
        self.fresh = opened  # at the block's beginning: a start marker there is the model's own, dropped

    @classmethod
    def prompt_state(cls, prompt: str) -> str | None:
        """"open" when the prompt ends inside the block (a template that opens it), "closed" when it ends
        just after one (a template that turns thinking off), else None. Only the prompt's end counts:
        markers earlier in the conversation are text."""
        tail = prompt.rstrip()
        if tail.endswith(cls.starts):
            return "open"
        if tail.endswith(cls.ends):
            return "closed"
        return None

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        thoughts, answer = [], []
        while True:
            if self.mode == START or (self.mode == OPEN and self.fresh):
                lead = skip_spaces(text, self.pos)
                marker = marker_at(text, lead, self.starts)
                if marker:
                    self.pos, self.mode, self.fresh = lead + len(marker), OPEN, False
                    continue
                if marker == "" and not finished:
                    break
                self.mode, self.fresh = (ANSWER if self.mode == START else OPEN), False
                continue
            markers, out = (self.ends, self.thoughts) if self.mode == OPEN else (self.markup, self.answer)
            at, marker = find_first(text, self.pos, markers)
            stop = at if at >= 0 else len(text) if finished else len(text) - held(text, self.pos, markers)
            (thoughts if self.mode == OPEN else answer).append(out.add(text[self.pos:max(stop, self.pos)]))
            if at < 0:
                self.pos = max(stop, self.pos)
                break
            if self.mode == OPEN:
                self.answer.started = False  # the whitespace after the end marker separates: dropped
            self.pos, self.mode = at + len(marker), ANSWER
        return "".join(thoughts), "".join(answer)
