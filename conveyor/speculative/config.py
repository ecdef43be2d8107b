"""`speculative_config` with vLLM's field names, validated once at start."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from ..layers.quantization.registry import self_draft_quantizations

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """method: "ngram" (prompt lookup: proposals copied from the request's own prompt and output) or
    "draft_model" (a smaller model with the same tokenizer at `model`; without `model`, the target's
    own weights in the low-bit `quantization` serve as the draft). num_speculative_tokens: tokens
    proposed per step (k). prompt_lookup_max / prompt_lookup_min: the longest and shortest suffix
    n-gram looked up (ngram). disable_by_batch_size: speculation is off while more requests than
    this are running (a big batch leaves no compute idle to verify with)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    quantization: str | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, got {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError("speculative_config.num_speculative_tokens must be an integer >= 1, "
                             f"got {self.num_speculative_tokens!r}")
        if self.method == "ngram":
            for name in ("model", "quantization"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config.{name} applies to method 'draft_model', not 'ngram'")
            hi = self.prompt_lookup_max if self.prompt_lookup_max is not None else self.prompt_lookup_min or 3
            lo = self.prompt_lookup_min if self.prompt_lookup_min is not None else min(hi, 1)
            for name, value in (("prompt_lookup_max", hi), ("prompt_lookup_min", lo)):
                if not isinstance(value, int) or value < 1:
                    raise ValueError(f"speculative_config.{name} must be an integer >= 1, got {value!r}")
            if lo > hi:
                raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must not exceed "
                                 f"prompt_lookup_max ({hi})")
            object.__setattr__(self, "prompt_lookup_max", hi)
            object.__setattr__(self, "prompt_lookup_min", lo)
        else:
            for name in ("prompt_lookup_max", "prompt_lookup_min"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config.{name} applies to method 'ngram', not 'draft_model'")
            if self.model is None and self.quantization is None:
                raise ValueError("speculative_config for 'draft_model' needs a 'model' path, or a 'quantization' "
                                 f"({', '.join(self_draft_quantizations())}) for the target's own weights as draft")
            if self.quantization is not None and self.quantization not in self_draft_quantizations():
                raise ValueError(f"speculative_config.quantization must be one of {self_draft_quantizations()}, "
                                 f"got {self.quantization!r}")
        if self.disable_by_batch_size is not None and (not isinstance(self.disable_by_batch_size, int)
                                                       or self.disable_by_batch_size < 1):
            raise ValueError("speculative_config.disable_by_batch_size must be an integer >= 1, "
                             f"got {self.disable_by_batch_size!r}")

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: the fields that are set."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @property
    def self_draft(self) -> bool:
        return self.method == "draft_model" and self.model is None

    @classmethod
    def from_dict(cls, value: "dict[str, Any] | str | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """From vLLM's JSON form (a dict, or its JSON text); unknown keys are an error naming the known ones."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {unknown}; known: {sorted(known)}")
        if "method" not in value or "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs 'method' and 'num_speculative_tokens'")
        return cls(**value)
