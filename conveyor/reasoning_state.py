"""Where a reply stands against its reasoning block, token by token: vLLM's `thinking_token_budget` (at most
N reasoning tokens, then the end marker forced) and its structured outputs after the reasoning.

A reply is in its block where the prompt opened it (the last start marker after the last end marker: a
thinking template's generation prompt), or, for formats whose reply begins inside the block unmarked
(DeepSeek-R1's), where the prompt has neither. A prompt whose last marker is an end closed it: the reply
is the answer. Otherwise the reply opens a block where it writes a start marker. Inside a block each
token counts, unless it completes an end marker, which leaves the block; the count is over the whole
reply. Once it reaches the budget the next tokens are forced, one a step, to the markers' `forced` ids
(the end marker, or vLLM's `reasoning_end_str` with a phrase before it). Markers are token ids, matched
as the model writes them (a marker that is one special token, as Qwen3's `<think>`, always matches).

A request with an output constraint (`gated`) has its grammar applied only to the answer: not inside
the block, and not to the markers. Its reply may open a block only at its first token: that step may
take the first token of the start marker besides what the grammar allows (`opening_token`), and the
rest of the marker is then forced; any other first token begins the answer.

The engine's output processor calls `advance` with every token appended; the sampler reads
`forced_token` (the token this step must give), `grammar_applies` and `opening_token`. Steps of such
requests run synchronously, as a grammar's do: the next step depends on the token just sampled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

Marker = tuple[int, ...]


@dataclass(frozen=True)
class ReasoningMarkers:
    """A model's reasoning markers as token ids: `starts` open a block, `ends` close it, `forced` is
    written when a budget runs out; `opens_unmarked`: a reply begins inside the block unless the
    prompt says otherwise (DeepSeek-R1)."""

    starts: tuple[Marker, ...]
    ends: tuple[Marker, ...]
    forced: Marker
    opens_unmarked: bool = False

    def __post_init__(self) -> None:
        if not self.starts or not self.ends or not self.forced or not all(self.starts) or not all(self.ends):
            raise ValueError("reasoning markers need a start, an end and the tokens forced at the budget's end")


def ends_with(tokens: Sequence[int], markers: tuple[Marker, ...]) -> bool:
    return any(len(tokens) >= len(m) and tuple(tokens[len(tokens) - len(m):]) == m for m in markers)


def last_index(tokens: Sequence[int], markers: tuple[Marker, ...]) -> int:
    """Where the last of `markers` in `tokens` ends (one past its last token), or -1. The scans for a
    marker's last token run in `list.index` (a long prompt without markers costs C speed, not a Python
    loop a token)."""
    backwards = list(tokens)[::-1]
    best = -1
    for m in markers:
        at = 0
        while True:
            try:
                at = backwards.index(m[-1], at)
            except ValueError:
                break
            end = len(tokens) - at
            if end >= len(m) and tuple(tokens[end - len(m):end]) == m:
                best = max(best, end)
                break
            at += 1
    return best


class ReasoningState:
    """One reply's place against its reasoning (see the module): `budget` None counts without a cap;
    `gated`: its grammar applies to the answer only."""

    def __init__(self, markers: ReasoningMarkers, prompt_token_ids: Sequence[int], budget: int | None = None,
                 gated: bool = False) -> None:
        self.markers, self.budget, self.gated = markers, budget, gated
        self.used = 0  # reasoning tokens so far
        self.queue: list[int] = []  # forced tokens still to give, in order
        self.opens_after_queue = False  # the forced tokens open the block (a start marker's rest), else end it
        self.tail: list[int] = []  # the output's last tokens, as long as the longest marker
        self.keep = max(len(m) for m in markers.starts + markers.ends)
        opened, closed = last_index(prompt_token_ids, markers.starts), last_index(prompt_token_ids, markers.ends)
        self.thinking = opened > closed if opened >= 0 else markers.opens_unmarked and closed < 0
        # a gated reply may open its block at its first token, unless the prompt closed one
        self.may_open = gated and not self.thinking and closed <= opened
        self._check_budget()

    @property
    def forced_token(self) -> int | None:
        return self.queue[0] if self.queue else None

    @property
    def grammar_applies(self) -> bool:
        """Whether this step's token is the answer's (a gated request's grammar masks it)."""
        return not self.thinking and not self.queue

    @property
    def opening_token(self) -> int | None:
        """The start marker's first token, where this step may take it besides the grammar's tokens."""
        return self.markers.starts[0][0] if self.may_open else None

    def advance(self, token: int) -> bool:
        """The token the request just generated (the forced one, while any is due); True when it is the
        answer's (a gated request's grammar consumes it)."""
        self.tail = (self.tail + [token])[-self.keep:]
        may_open, self.may_open = self.may_open, False
        if self.queue:
            self.queue.pop(0)
            if not self.queue:
                self.thinking = self.opens_after_queue
                self._check_budget()
            return False
        if self.thinking:
            if ends_with(self.tail, self.markers.ends):
                self.thinking = False
            else:
                self.used += 1
                self._check_budget()
            return False
        if may_open and token == self.markers.starts[0][0]:
            rest = self.markers.starts[0][1:]
            if rest:
                self.queue, self.opens_after_queue = list(rest), True
            else:
                self.thinking = True
                self._check_budget()
            return False
        if not self.gated and ends_with(self.tail, self.markers.starts):
            self.thinking = True
            self._check_budget()
            return False
        return True

    def _check_budget(self) -> None:
        if self.thinking and self.budget is not None and self.used >= self.budget:
            self.queue, self.opens_after_queue = list(self.markers.forced), False
