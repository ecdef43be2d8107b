"""Per-request decoding parameters, validated before a request is queued."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field, fields, replace
from typing import Any

STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """json: a JSON schema (dict or JSON text); regex: a regular expression the whole output matches;
    choice: one of these strings exactly; grammar: a grammar in GBNF/EBNF (`root ::= ...`) or Lark
    syntax; json_object: any JSON object (OpenAI's `{"type": "json_object"}`); structural_tag: vLLM's
    `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}` (dict or JSON text): free text, where
    each trigger starts one of its structures, whose body between `begin` and `end` follows the schema."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"structured_outputs.{name} must be a string")
        if self.json_object not in (None, True, False):
            raise ValueError("structured_outputs.json_object must be a boolean")
        for name in ("json", "structural_tag"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), (dict, str)):
                raise ValueError(f"structured_outputs.{name} must be a JSON object or its JSON text")

    @property
    def kind(self) -> str:
        return next(f.name for f in fields(self) if getattr(self, f.name) not in (None, False))

    def key(self) -> str:
        """A canonical text of the constraint: the grammar cache's key."""
        value: Any = getattr(self, self.kind)
        if self.kind in ("json", "structural_tag") and isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs.{self.kind} is not valid JSON: {exc}") from exc
        return f"{self.kind}:{json.dumps(value, sort_keys=True)}"


class SamplingParamsError(ValueError):
    """A sampling parameter is outside its allowed range."""


def is_token_id(value: Any) -> bool:
    """An integer >= 0 (not a bool): what a token id field takes."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


GREEDY_BELOW = 1e-5  # temperatures below this decode greedily (vLLM's _SAMPLING_EPS)


@dataclass
class SamplingParams:
    """How one request decodes. `temperature=0` is greedy (as is any below `GREEDY_BELOW`, vLLM's rule: dividing
    by it would overflow); the other filters then do nothing.

    top_k: keep the k most likely tokens (0 = off; vLLM's -1 too). top_p: nucleus mass in (0, 1].
    min_p: drop tokens below min_p x the top probability. repetition_penalty: > 1 discourages
    tokens already in the prompt or output (as in transformers). presence_penalty /
    frequency_penalty: OpenAI's additive penalties on tokens already generated (once, and per
    occurrence). min_tokens: EOS, stop tokens and stop strings are ignored until this many tokens
    have been generated. seed: per-request generator, so
    the same seed gives the same tokens whatever else is in the batch. stop: strings that end
    generation (not included in the text, unless include_stop_str_in_output, vLLM's). logprobs: return
    the top-n log-probabilities of each generated token (computed from the raw model logits).
    prompt_logprobs: the log-probability of every prompt token after the first given the tokens before
    it, plus the top-n alternatives, as vLLM's (for perplexity and scoring; such a request computes its
    whole prompt, no prefix cache).
    structured_outputs: a constraint (JSON schema, regex, choice, grammar) the output must match, as
    vLLM's. logit_bias: {token id: bias in [-100, 100]} added to the logits before sampling (OpenAI's rule).
    allowed_token_ids (vLLM's): only these tokens may be generated. bad_words (vLLM's): words never
    generated: each word's last token is banned where the tokens before it were just generated (the word
    tokenized alone and after a space).
    skip_special_tokens: special tokens are left out of the text (vLLM's default); a tool-call format
    whose markers are special tokens (Mistral's `[TOOL_CALLS]`) needs them kept. detokenize (vLLM's):
    False leaves the text empty (token ids only, no decoding per token); stop strings then cannot apply.
    truncate_prompt_tokens (vLLM's): keep only the prompt's last N tokens; -1 keeps the most that fit in the
    context beside `max_new_tokens`; None: a prompt over the context is an error. request_timeout: seconds from arrival
    after which a request still waiting or running ends with finish reason "timeout" and its blocks go
    back (the server's `--request-timeout` default); None: no deadline. priority (vLLM's): with priority
    scheduling, lower runs first, ties by arrival (any value but 0 needs it). thinking_token_budget (vLLM's): at
    most this many tokens of reasoning, then the end of the block is forced (`reasoning_state`; needs the
    engine's reasoning markers: `LLM(reasoning_parser=...)`); -1 or None: no limit.

    n (vLLM's): samples per prompt, for `LLM.generate` and `LLM.chat`, each its own request (with a seed,
    sample j uses seed + j), returned as one `RequestOutput` whose `outputs` holds the n; a request given to
    the manager or the engine directly is one sample (n=1).

    `max_tokens` is vLLM's name for `max_new_tokens`: `SamplingParams(max_tokens=32)` and `params.max_tokens`
    work as in vLLM (the default stays 64, not vLLM's 16).
    """

    max_new_tokens: int = 64
    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True
    truncate_prompt_tokens: int | None = None
    request_timeout: float | None = None
    priority: int = 0
    thinking_token_budget: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise SamplingParamsError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise SamplingParamsError(f"n must be an integer >= 1 (samples per prompt), got {self.n!r}")
        if self.temperature < 0:
            raise SamplingParamsError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise SamplingParamsError(f"top_k must be an integer >= 0 (0 or vLLM's -1 disables it), got {self.top_k!r}")
        self.top_k = max(self.top_k, 0)
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise SamplingParamsError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise SamplingParamsError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise SamplingParamsError(f"min_tokens must be an integer in [0, max_new_tokens={self.max_new_tokens}], "
                                      f"got {self.min_tokens!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise SamplingParamsError(f"logprobs must be an integer >= 0, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0):
            raise SamplingParamsError(f"prompt_logprobs must be an integer >= 0, got {self.prompt_logprobs!r}")
        if not all(map(is_token_id, self.stop_token_ids)):
            raise SamplingParamsError(f"stop_token_ids must be integers >= 0, got {self.stop_token_ids[:5]!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise SamplingParamsError("stop strings must be non-empty strings")
        if self.stop and not self.detokenize:
            raise SamplingParamsError("stop strings are found in the text: they need detokenize=True")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise SamplingParamsError("structured_outputs must be a StructuredOutputsParams, got "
                                      f"{type(self.structured_outputs).__name__}")
        if self.truncate_prompt_tokens is not None and (
                not isinstance(self.truncate_prompt_tokens, int) or isinstance(self.truncate_prompt_tokens, bool)
                or not (self.truncate_prompt_tokens == -1 or self.truncate_prompt_tokens >= 1)):
            raise SamplingParamsError("truncate_prompt_tokens must be -1 (the most that fit) or an integer >= 1, got "
                                      f"{self.truncate_prompt_tokens!r}")
        budget = self.thinking_token_budget
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < -1):
            raise SamplingParamsError(f"thinking_token_budget must be an integer >= 0, or -1 for no limit, got "
                                      f"{budget!r}")
        if budget == -1:
            self.thinking_token_budget = None
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise SamplingParamsError(f"priority must be an integer (lower runs first), got {self.priority!r}")
        timeout = self.request_timeout
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not 0 < timeout < float("inf")):
            raise SamplingParamsError(f"request_timeout must be a number of seconds > 0, got {timeout!r}")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            if not self.allowed_token_ids or not all(map(is_token_id, self.allowed_token_ids)):
                raise SamplingParamsError("allowed_token_ids must be a non-empty list of token ids (integers >= 0), "
                                          f"got {self.allowed_token_ids[:5]!r}")
        self.bad_words = list(self.bad_words or [])
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise SamplingParamsError("bad_words must be non-empty strings")
        self.logit_bias = dict(self.logit_bias or {})
        for token, bias in self.logit_bias.items():
            if not is_token_id(token):
                raise SamplingParamsError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
            if not isinstance(bias, (int, float)) or not -100.0 <= bias <= 100.0:
                raise SamplingParamsError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {token}")

    def for_sample(self, j: int) -> SamplingParams:
        """The parameters of sample j of `n`: one request (n=1), seeded seed + j where a seed is given."""
        return replace(self, n=1, seed=None if self.seed is None else self.seed + j)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def max_tokens(self) -> int:
        """vLLM's name for `max_new_tokens`."""
        return self.max_new_tokens

    @max_tokens.setter
    def max_tokens(self, value: int) -> None:
        self.max_new_tokens = value


def _accept_vllm_max_tokens(init: Any) -> Any:
    """The dataclass's `__init__`, also taking vLLM's `max_tokens=` (a property, not a second field, so
    `dataclasses.replace` and `fields` see one length setting)."""

    @functools.wraps(init)
    def __init__(self: SamplingParams, *args: Any, max_tokens: int | None = None, **kwargs: Any) -> None:
        if max_tokens is not None:
            if kwargs.setdefault("max_new_tokens", max_tokens) != max_tokens:
                raise SamplingParamsError(f"max_tokens={max_tokens!r} and max_new_tokens={kwargs['max_new_tokens']!r} "
                                          "disagree (they are the same setting: give one)")
        init(self, *args, **kwargs)

    return __init__


SamplingParams.__init__ = _accept_vllm_max_tokens(SamplingParams.__init__)  # type: ignore[method-assign]


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's beam search settings (`LLM.beam_search`, the server's `use_beam_search`): keep the
    `beam_width` sequences of highest score, score = cumulative log-probability / length ** length_penalty
    (the length counts the prompt and not a final EOS, as vLLM's), for up to `max_tokens` tokens; a beam
    that reaches an EOS is complete unless `ignore_eos`. `temperature` only picks the one sampled token each
    step adds to a beam's 2 x beam_width most likely candidates (0, the default: none beyond them)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # vLLM's field; beam search has no stop strings to keep

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SamplingParamsError(f"{name} must be an integer >= 1, got {value!r}")
        if self.temperature < 0:
            raise SamplingParamsError(f"temperature must be >= 0, got {self.temperature}")
        penalty = self.length_penalty
        if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not -10 <= penalty <= 10:
            raise SamplingParamsError(f"length_penalty must be a number in [-10, 10], got {penalty!r}")

    def step_params(self) -> SamplingParams:
        """One step of every beam: a token, with the 2 x beam_width most likely next tokens' log-probabilities."""
        return SamplingParams(max_new_tokens=1, temperature=self.temperature, ignore_eos=True,
                              logprobs=2 * self.beam_width)
