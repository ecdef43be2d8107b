"""What a pooling model computes (vLLM's names): `PoolerConfig`, how the engine pools every request
(`--pooler-config`), and `PoolingParams`, what one request asks on top (Matryoshka dimensions,
normalization or the classifier's activation on or off, prompt truncation).

A pooling request is a prompt run through the model once (prefill only, no LM head and no sampler);
its hidden states are pooled into one vector (the last token's, the first token's, or their mean) and
turned into the output by the task's head: an embedding (L2-normalized by default) or a classifier's
scores (sigmoid or softmax). vLLM's token tasks keep every token's row instead ("ALL"): one embedding
per token (`token_embed`, multi-vector retrieval) or one classification per token (`token_classify`).
docs/design/pooling.md has the engine's side.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

POOLING_TYPES = ("LAST", "MEAN", "CLS")  # vLLM's sequence pooling types
TOKEN_POOLING_TYPES = ("ALL",)  # vLLM's token pooling type we run (its "STEP" is not)
POOLING_TASKS = ("embed", "classify")
TOKEN_TASKS = ("token_embed", "token_classify")  # the same heads over every token's row


class PoolingParamsError(ValueError):
    """A pooling parameter outside its allowed range (`InvalidRequestError` is for what the model refuses)."""


@dataclass(frozen=True)
class PoolerConfig:
    """How the engine pools (vLLM's `--pooler-config` / `LLM(pooler_config=...)`); None = the checkpoint's
    own (its sentence-transformers files or GGUF metadata), else vLLM's defaults for a decoder: the last
    token's hidden state, L2-normalized (embeddings) or through the activation (classifiers).

    pooling_type: "LAST", "MEAN" or "CLS" (the first token), or "ALL" (every token's row: the token
    tasks); `seq_pooling_type` and `tok_pooling_type` are vLLM's newer names.
    normalize: L2-normalize embeddings; `use_activation` is vLLM's newer name (for classifiers: the
    sigmoid or softmax over the scores).
    task: vLLM's `task`: "embed" or "classify" (the model's own), or "token_embed" / "token_classify" for
    an embedding model / a classifier whose outputs are per token; None: the model's."""

    pooling_type: str | None = None
    normalize: bool | None = None
    task: str | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES + TOKEN_POOLING_TYPES:
            raise PoolingParamsError(f"pooler_config pooling_type must be one of "
                                     f"{', '.join(POOLING_TYPES + TOKEN_POOLING_TYPES)}, got {self.pooling_type!r}")
        if self.task is not None and self.task not in POOLING_TASKS + TOKEN_TASKS:
            raise PoolingParamsError(f"pooler_config task must be one of {', '.join(POOLING_TASKS + TOKEN_TASKS)}, "
                                     f"got {self.task!r}")
        if self.task is not None and self.pooling_type is not None and (
                (self.task in TOKEN_TASKS) != (self.pooling_type in TOKEN_POOLING_TYPES)):
            raise PoolingParamsError(f"pooler_config task {self.task!r} does not pool with {self.pooling_type!r}: "
                                     f"the token tasks pool ALL, the others {', '.join(POOLING_TYPES)}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise PoolingParamsError(f"pooler_config normalize must be true or false, got {self.normalize!r}")

    @classmethod
    def parse(cls, value: PoolerConfig | dict[str, Any] | str | None) -> PoolerConfig:
        """From vLLM's forms: the object, a dict, or its JSON text (`--pooler-config '{"pooling_type": "MEAN"}'`)."""
        if value is None or isinstance(value, PoolerConfig):
            return value or cls()
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise PoolingParamsError(f"pooler_config is not valid JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise PoolingParamsError(f"pooler_config must be a JSON object, e.g. '{{\"pooling_type\": \"MEAN\"}}', "
                                     f"got {value!r}")
        given = dict(value)
        for alias, name in (("seq_pooling_type", "pooling_type"), ("tok_pooling_type", "pooling_type"),
                            ("use_activation", "normalize")):
            if alias in given:
                if given.get(name, given[alias]) != given[alias]:
                    raise PoolingParamsError(f"pooler_config sets {name} and {alias} (the same setting) differently")
                given[name] = given.pop(alias)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise PoolingParamsError(f"pooler_config fields {unknown} are not supported (supported: pooling_type "
                                     "(seq_pooling_type, tok_pooling_type), normalize (use_activation), task)")
        return cls(**given)

    def over(self, other: PoolerConfig) -> PoolerConfig:
        """These settings where given, `other`'s elsewhere."""
        return PoolerConfig(self.pooling_type or other.pooling_type,
                            other.normalize if self.normalize is None else self.normalize, self.task or other.task)


@dataclass
class PoolingParams:
    """One pooling request's options (vLLM's `PoolingParams`).

    dimensions: keep the embedding's first N dimensions (then normalize), only for a model trained for it
        (Matryoshka: `is_matryoshka` or `matryoshka_dimensions` in its config; else the request is refused).
    normalize: L2-normalize the embedding; `use_activation` (vLLM's newer name, also the classifier's
        sigmoid or softmax) says the same; None = the engine's pooler config.
    truncate_prompt_tokens: keep only the prompt's last N tokens (-1: the most the context holds); None: a
        prompt over the context is an error.
    """

    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool)
                                            or self.dimensions < 1):
            raise PoolingParamsError(f"dimensions must be an integer >= 1, got {self.dimensions!r}")
        if None not in (self.normalize, self.use_activation) and self.normalize != self.use_activation:
            raise PoolingParamsError("normalize and use_activation are the same setting: give one")
        keep = self.truncate_prompt_tokens
        if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or not (keep == -1 or keep >= 1)):
            raise PoolingParamsError("truncate_prompt_tokens must be -1 (the most that fit) or an integer >= 1, got "
                                     f"{keep!r}")

    @property
    def activation(self) -> bool | None:
        """Normalization (embeddings) or the activation (classifiers) as asked; None = the engine's default."""
        return self.use_activation if self.use_activation is not None else self.normalize
