"""Request lifecycle: PENDING -> PREFILLING -> DECODING -> FINISHED (or FAILED / CANCELLED):
docs/design/request-lifecycle.md.
An offloaded request goes back to PENDING (soft reset) or SWAPPED (its blocks in host memory), then on.

A request's token sequence is `prompt + generated`; `num_computed_tokens` of it have K/V in the
cache. Each step processes the next slice of that sequence: a prefill chunk, or (once only the
last generated token is missing from the cache) a single decode token. A soft reset just sets
`num_computed_tokens` back to 0, so the generated tokens are re-prefilled as if they were prompt.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from .lora_request import LoRARequest
from .pooling_params import PoolingParams
from .sampling_params import SamplingParams
from .reasoning_state import ReasoningState

# Text, token ids, or vLLM's prompt dicts ({"prompt": text} / {"prompt_token_ids": ids}).
Prompt = str | list[int] | dict[str, Any]
Pooled = list[float] | list[list[float]]  # a pooling result: one vector, or one a token (the token tasks)


def prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt or several, as a list (a list of ints is one prompt of token ids)."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]

if TYPE_CHECKING:
    import llguidance


class RequestState(enum.Enum):
    PENDING = "pending"
    SWAPPED = "swapped"  # offloaded with its KV blocks in the host swap pool, waiting to be copied back
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"


FINAL_STATES = (RequestState.FINISHED, RequestState.FAILED, RequestState.CANCELLED)


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.monotonic) of the request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


class Logprob(float):
    """A token's log-probability as vLLM's `Logprob` (`.logprob`, `.rank`: its 1-based place among the
    vocabulary's, `.decoded_token`: its text, which `LLM`'s results fill in) that is also the float itself,
    so that `{token id: logprob}` entries add, compare and serialize as numbers."""

    __slots__ = ("rank", "decoded_token")

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None) -> Logprob:
        value = super().__new__(cls, logprob)
        value.rank, value.decoded_token = rank, decoded_token
        return value

    @property
    def logprob(self) -> float:
        return float(self)

    def __reduce__(self) -> tuple[type, tuple[float, int | None, str | None]]:
        return Logprob, (float(self), self.rank, self.decoded_token)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"


def ranked_entry(top_ids: list[int], top_values: list[float], token: int, value: float,
                 rank: int) -> dict[int, float]:
    """A token's logprobs entry: the top-n alternatives (ranked 1..n), then `token` (ranked `rank`) where it is
    not among them."""
    entry: dict[int, float] = {t: Logprob(v, i + 1) for i, (t, v) in enumerate(zip(top_ids, top_values))}
    entry[token] = Logprob(value, rank)
    return entry


@dataclass(frozen=True)
class CompletionOutput:
    """vLLM's per-sequence view of a result (`out.outputs[0].text`); this engine makes one sequence per
    request. Its logprobs' values are `Logprob`s: floats with vLLM's `.logprob`, `.rank`, `.decoded_token`."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: str | int | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        """vLLM's: the generated tokens' log-probabilities summed, where logprobs were asked for (else None)."""
        if self.logprobs is None:
            return None
        return sum(float(entry[token]) for token, entry in zip(self.token_ids, self.logprobs))

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What a user receives: the whole result so far, plus the delta since the previous output."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    # vLLM's: the stop string or stop token id (not an EOS) that finished it, else None
    stop_reason: str | int | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None  # [None, {id: logprob}, ...], one per prompt token
    error: str | None = None
    metrics: RequestMetrics | None = None
    pooled: Pooled | None = None  # a pooling request's result: the embedding, or the classifier's scores
    num_cached_tokens: int = 0  # vLLM's: prompt tokens found in the prefix cache when it was first scheduled
    samples: list[CompletionOutput] | None = None  # `SamplingParams.n` > 1: all n (the first is the one above)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM's shape of the same result, so `out.outputs[0].text` works as it does there (n of them for a
        prompt sampled n times)."""
        if self.samples is not None:
            return self.samples
        return [CompletionOutput(0, self.text, self.token_ids, self.logprobs, self.finish_reason, self.stop_reason)]


def decode_logprob_tokens(outputs: Sequence[RequestOutput], decode: Callable[[list[int]], str]) -> None:
    """Each `Logprob` of the outputs' logprobs and prompt logprobs gets its `decoded_token` (vLLM's), every
    token id decoded once."""
    texts: dict[int, str] = {}
    for out in outputs:
        for entry in itertools.chain(out.logprobs or (), out.prompt_logprobs or ()):
            for token, value in (entry or {}).items():
                if isinstance(value, Logprob) and value.decoded_token is None:
                    if token not in texts:
                        texts[token] = decode([token])
                    value.decoded_token = texts[token]


def per_prompt_samples(outputs: list[RequestOutput], counts: list[int]) -> list[RequestOutput]:
    """The outputs of consecutive requests, `counts[i]` samples of prompt i, as one output per prompt: the
    first sample's, with every sample in `outputs` (vLLM's `SamplingParams.n`)."""
    merged, at = [], 0
    for n in counts:
        group, at = outputs[at:at + n], at + n
        merged.append(group[0] if n == 1 else replace(
            group[0], samples=[replace(o.outputs[0], index=j) for j, o in enumerate(group)]))
    return merged


@dataclass(frozen=True)
class EmbeddingOutput:
    """vLLM's `outputs` of an embedding request."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(frozen=True)
class ClassificationOutput:
    """vLLM's `outputs` of a classification request: one score per class (after the activation, if on)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(frozen=True)
class PoolingOutput:
    """vLLM's `outputs` of `LLM.encode`: the pooled values (an embedding, or a classifier's scores) as a tensor;
    `[tokens, values]` for the token tasks."""

    data: torch.Tensor


@dataclass(frozen=True)
class ScoringOutput:
    """vLLM's `outputs` of a scoring request: the pair's relevance (classifier) or cosine similarity (embeddings)."""

    score: float


@dataclass
class PoolingRequestOutput:
    """vLLM's result of a pooling request (`LLM.embed`, `classify`, `score`); `outputs` is the task's."""

    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput):
    outputs: EmbeddingOutput


@dataclass
class ClassificationRequestOutput(PoolingRequestOutput):
    outputs: ClassificationOutput


@dataclass
class ScoringRequestOutput(PoolingRequestOutput):
    outputs: ScoringOutput


class Request:
    """Engine-side state of one request (generation, or pooling with `pooling` set); touched only by the engine
    loop's thread."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 prompt: str | None = None, eos_token_ids: tuple[int, ...] = (),
                 pooling: PoolingParams | None = None, lora_request: LoRARequest | None = None) -> None:
        self.request_id = request_id
        self.lora_request = lora_request  # its adapter (None: the base model), `engine.lora_manager`
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.state = RequestState.PENDING
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens the prefix cache held at its first admission
        # The length RoPE rotates every token for at least, where the rotation depends on it (LongRoPE, dynamic
        # NTK: `layers.rotary`): the prompt's; the whole sequence's once a LongRoPE switch recomputed it.
        self.rope_length = len(self.prompt_token_ids)
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None  # the stop string or stop token id that finished it
        self.error: str | None = None
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        # Filled as prefill chunks pass: entry i scores prompt token i (the first has nothing before it).
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        self.metrics = RequestMetrics(arrival_time=time.monotonic())
        self.stop_token_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset(eos_token_ids))
        self.generator: torch.Generator | None = None  # set by the engine, on the model's device, for seeds
        # Structured outputs: the constraint's matcher (set by the engine; None = unconstrained). It has
        # consumed exactly `output_token_ids`, which offloading never changes, so it stays valid across
        # soft resets and swaps (a reset recomputes K/V, it does not resample).
        self.grammar: llguidance.LLMatcher | None = None
        # Where its reply stands against its reasoning block (`reasoning_state`; set by the engine for a thinking
        # budget, or a grammar that applies after the reasoning; None = neither).
        self.reasoning: ReasoningState | None = None
        # `params.bad_words` as token sequences (set by the engine, which has the tokenizer).
        self.bad_words_token_ids: list[list[int]] = []
        self.cache_salt: str | None = None  # vLLM's: cached blocks are shared only between equal salts
        # Detokenization: output text so far, how much of it the user has been sent.
        self.text = ""
        self.sent_text_len = 0
        self.sent_token_len = 0
        self.detok_ids: list[int] = self.prompt_token_ids[-5:]
        self.detok_prefix_offset = 0
        self.detok_read_offset = len(self.detok_ids)
        # A pooling request: prefill only, its hidden states pooled (`engine/pooling.py`). What its earlier
        # chunks pooled (the mean's running sum, the first token's row, the token tasks' rows), then its result.
        self.pooling = pooling
        self.pools_every_row = False  # its pooling reads rows before the last (MEAN, CLS, ALL): no prefix reuse
        self.whole_prompt = False  # an encoder's: its prompt computed in one pass, never chunked nor reused
        self.pooling_state: torch.Tensor | None = None
        self.pooled: Pooled | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_remaining_tokens(self) -> int:
        """Tokens not yet in the cache: the rest of the prompt, or the last generated token."""
        return self.num_tokens - self.num_computed_tokens

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without concatenating the whole sequence."""
        n_prompt = len(self.prompt_token_ids)
        head = self.prompt_token_ids[start:end] if start < n_prompt else []
        tail = self.output_token_ids[max(start - n_prompt, 0):end - n_prompt] if end > n_prompt else []
        return head + tail

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all recorded yet: its prompt must be computed, not reused."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def reuses_prefix(self) -> bool:
        """Whether cached blocks may stand in for its prompt's first tokens (prefix caching): not when every
        prompt position's output is needed (prompt logprobs; pooling over more than the last token), nor for
        an encoder's prompt, whose every token attends to every other."""
        return not self.needs_prompt_logprobs and not self.pools_every_row and not self.whole_prompt

    @property
    def forced_token(self) -> int | None:
        """The token this step must give (a reasoning marker's, forced), or None."""
        return self.reasoning.forced_token if self.reasoning is not None else None

    @property
    def active_grammar(self) -> llguidance.LLMatcher | None:
        """The grammar that masks this step's token: None inside the reasoning and its markers."""
        if self.grammar is None or (self.reasoning is not None and not self.reasoning.grammar_applies):
            return None
        return self.grammar

    @property
    def opening_token(self) -> int | None:
        """A token this step may take besides its grammar's (the reasoning's start, at the reply's start)."""
        return self.reasoning.opening_token if self.reasoning is not None else None

    @property
    def runs_synchronously(self) -> bool:
        """Whether its next step's sampling depends on the token just sampled (a grammar, reasoning followed):
        its steps do not run ahead (async batching waits)."""
        return self.grammar is not None or self.reasoning is not None

    @property
    def restricts_tokens(self) -> bool:
        """Whether sampling masks tokens besides a grammar's (`allowed_token_ids`, `bad_words`)."""
        return self.params.allowed_token_ids is not None or bool(self.bad_words_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.state in FINAL_STATES

    def to_output(self, delta: bool = True) -> RequestOutput:
        """Snapshot for the user; the held-back tail of text (a possible stop string) is not sent."""
        visible = self.text if self.is_finished else self.text[: self._sendable_text_len()]
        delta_text = visible[self.sent_text_len:]
        delta_ids = self.output_token_ids[self.sent_token_len:]
        if delta:
            self.sent_text_len = len(visible)
            self.sent_token_len = len(self.output_token_ids)
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
            text=visible, token_ids=list(self.output_token_ids), finished=self.is_finished,
            finish_reason=self.finish_reason, stop_reason=self.stop_reason, delta_text=delta_text,
            delta_token_ids=list(delta_ids),
            logprobs=None if self.logprobs is None else list(self.logprobs),
            prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs), error=self.error,
            metrics=self.metrics, pooled=self.pooled, num_cached_tokens=self.num_cached_tokens)

    def _sendable_text_len(self) -> int:
        hold = max((len(s) for s in self.params.stop), default=1) - 1
        return max(len(self.text) - hold, self.sent_text_len)
