"""The errors Conveyor raises to its callers. An invalid request carries a typed code and the parameter at
fault, so the server maps it to an HTTP answer without reading the message."""

from __future__ import annotations

from enum import Enum


class ConfigError(ValueError):
    """A configuration value is out of its allowed range, or cannot run on this device."""


class DistributedError(RuntimeError):
    """A tensor-parallel rank died, or stopped answering within the collectives' timeout: the group
    cannot run another step, so the engine dies with it (not one batch's fault)."""


class RequestErrorCode(str, Enum):
    """Why a request was refused before it was queued (OpenAI's `code` where OpenAI has one)."""

    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # prompt + max_new_tokens over the model's context
    CACHE_CAPACITY_EXCEEDED = "kv_cache_capacity_exceeded"  # the prompt alone does not fit the KV cache
    INVALID_PROMPT = "invalid_prompt"  # empty, or token ids outside the vocabulary
    INVALID_VALUE = "invalid_value"  # a parameter outside what this model takes (token ids, logprobs, pages)
    INVALID_STRUCTURED_OUTPUTS = "invalid_structured_outputs"  # the constraint does not compile
    DUPLICATE_REQUEST_ID = "duplicate_request_id"


class InvalidRequestError(ValueError):
    """A request that cannot be served as given; `code` says why, `param` names the parameter at fault
    (a `SamplingParams` field, or "prompt")."""

    def __init__(self, message: str, code: RequestErrorCode = RequestErrorCode.INVALID_VALUE,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param
