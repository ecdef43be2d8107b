"""vLLM's `thinking_token_budget`: at most N tokens of reasoning in a reply, then its end forced.

A request with a budget follows its reasoning blocks token by token: it is inside one where the prompt
opened it (the last start marker after the last end marker: a thinking template's generation prompt),
or, for formats whose reply begins inside the block unmarked (DeepSeek-R1's), where the prompt has
neither; later, where its output writes a start marker. Inside a block each token counts, unless it
completes an end marker, which leaves the block. Once the count reaches the budget the next tokens are
forced, one a step, to the markers' `forced` ids (the end marker, or vLLM's `reasoning_end_str` with a
phrase before it), after which the reply goes on as the answer. The count is over the whole reply, so
a second block gets only what the first left. Markers are token ids, matched as the model writes them
(a marker that is one special token, as Qwen3's `<think>`, always matches).

The sampler reads `forced_token` (the token this step must give, or None); the engine's output
processor calls `advance` with every token appended, and steps of such requests run synchronously, as
a grammar's do, since the next step's forced token depends on the token just sampled.
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
    """Where the last of `markers` in `tokens` ends (one past its last token), or -1."""
    for end in range(len(tokens), 0, -1):
        if any(end >= len(m) and tuple(tokens[end - len(m):end]) == m for m in markers):
            return end
    return -1


class ThinkingBudget:
    """One request's reasoning count and its forced end (see the module)."""

    def __init__(self, markers: ReasoningMarkers, budget: int, prompt_token_ids: Sequence[int]) -> None:
        self.markers, self.budget = markers, budget
        self.used = 0  # reasoning tokens so far
        self.queue: list[int] = []  # forced tokens still to give, in order
        self.tail: list[int] = []  # the output's last tokens, as long as the longest marker
        self.keep = max(len(m) for m in markers.starts + markers.ends)
        opened, closed = last_index(prompt_token_ids, markers.starts), last_index(prompt_token_ids, markers.ends)
        self.thinking = opened > closed if opened >= 0 else markers.opens_unmarked and closed < 0
        self._check_budget()

    @property
    def forced_token(self) -> int | None:
        return self.queue[0] if self.queue else None

    def advance(self, token: int) -> None:
        """The token the request just generated (the forced one, while any is due)."""
        self.tail = (self.tail + [token])[-self.keep:]
        if self.queue:
            self.queue.pop(0)
            self.thinking = bool(self.queue)
            return
        if not self.thinking:
            self.thinking = ends_with(self.tail, self.markers.starts)
        elif ends_with(self.tail, self.markers.ends):
            self.thinking = False
            return
        else:
            self.used += 1
        self._check_budget()

    def _check_budget(self) -> None:
        if self.thinking and self.used >= self.budget:
            self.queue = list(self.markers.forced)
