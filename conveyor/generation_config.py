"""The sampling defaults a model ships in its `generation_config.json`, applied as vLLM applies them
(`--generation-config auto`, its default): to the fields a request leaves unset, offline through
`LLM.get_default_sampling_params()`, on the server for an OpenAI request's missing fields.
`--generation-config vllm` ignores the file; a directory reads that directory's file instead.

vLLM takes temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens (as max_tokens).
Here `max_length` counts too where it can mean what it means in transformers, the whole sequence:
a server request without max_tokens generates up to it (prompt included) when it is shorter than the
context and longer than the prompt. `do_sample` is ignored, as vLLM does.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .sampling_params import SamplingParams

FILE = "generation_config.json"
# generation_config.json's names, which are SamplingParams fields too
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
INTEGERS = ("top_k", "max_new_tokens", "max_length")


@dataclass(frozen=True)
class GenerationDefaults:
    """What a model's generation config changes: `values` (SamplingParams fields), `max_length`, and
    where they came from (`source`, for the start-up log)."""

    values: dict[str, Any] = field(default_factory=dict)
    max_length: int | None = None
    source: str = "none"

    @classmethod
    def load(cls, setting: str | os.PathLike[str], model_path: Path | None,
             overrides: dict[str, Any] | None = None) -> GenerationDefaults:
        """`setting`: "auto" (the model directory's file, when it has one; a GGUF file has none), "vllm"
        (none) or a directory; `overrides` (vLLM's `override_generation_config`) go over either."""
        if str(setting) == "vllm":
            raw, source = {}, "generation_config='vllm'"
        elif str(setting) == "auto":
            file = model_path / FILE if model_path is not None and model_path.is_dir() else None
            raw, source = (read(file), str(file)) if file is not None and file.is_file() else ({}, f"no {FILE}")
        else:
            directory = Path(setting).expanduser()
            if not (directory / FILE).is_file():
                raise ValueError(f"generation_config {setting!r} is neither 'auto', 'vllm' nor a directory with "
                                 f"a {FILE}")
            raw, source = read(directory / FILE), str(directory / FILE)
        if overrides:
            unknown = set(overrides) - set(SAMPLING_FIELDS) - {"max_length"}
            if unknown:
                raise ValueError(f"override_generation_config takes {', '.join(SAMPLING_FIELDS)} and max_length; "
                                 f"got {sorted(unknown)}")
            raw, source = raw | overrides, f"{source} + overrides"
        values = {k: raw[k] for k in SAMPLING_FIELDS if raw.get(k) is not None}
        for name in INTEGERS:
            value, least = raw.get(name), 0 if name == "top_k" else 1  # top_k 0: off
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
                raise ValueError(f"{source}: {name} must be an integer >= {least}, got {value!r}")
        defaults = cls(values, raw.get("max_length"), source)
        try:
            defaults.sampling_params()
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from exc
        return defaults

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.values)

    def max_tokens(self, prompt_tokens: int, context: int) -> int:
        """What a request that sets no limit may generate: the rest of the context, or of `max_length`
        when that is shorter and the prompt fits in it, capped by `max_new_tokens` (may be < 1: no room)."""
        shorter = self.max_length is not None and prompt_tokens < self.max_length < context
        total = self.max_length if shorter else context
        return min(total - prompt_tokens, self.values.get("max_new_tokens", total))

    def describe(self) -> str:
        applied = [f"{k}={v}" for k, v in self.values.items()]
        if self.max_length is not None:
            applied.append(f"max_length={self.max_length} (requests without max_tokens)")
        return f"{', '.join(applied)} (from {self.source})" if applied else f"none ({self.source})"


def read(file: Path) -> dict[str, Any]:
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {file}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{file} is not a JSON object")
    return raw
