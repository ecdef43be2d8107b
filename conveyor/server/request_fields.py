"""Request fields beyond OpenAI's: vLLM's `truncate_prompt_tokens`, llama.cpp's server fields, and the ones
nobody here reads; and the server flags that bound or shape fields (--max-logprobs,
--return-tokens-as-token-ids, the usage flags).

llama.cpp's `n_predict` is `max_tokens` (-1: the rest of the context), `grammar` (GBNF) and
`json_schema` are constraints (`response_format.body_constraint`), and `cache_prompt` is accepted:
prefix caching is always on. Its samplers that Conveyor does not have are refused with a 400 naming
the field and what to use, unless they carry their off value (clients send llama.cpp's defaults);
the fields that only matter with one of those on (`mirostat_tau`, `dry_base`, ...) or that change
nothing here (`id_slot`, `n_keep`) are accepted. vLLM's fields that Conveyor does not have (right
truncation, prompt embeddings) and OpenAI's it cannot honour (the deprecated `functions`, audio output,
web search) are refused the same way when set; OpenAI's bookkeeping fields (`metadata`, `store`,
`service_tier`, ...) are accepted. Any other unknown field is ignored, as vLLM does, with a warning the
first time the server sees its name.
"""

from __future__ import annotations

import logging
from typing import Any

from ..request import RequestOutput
from .protocol import APIError, SamplingFields
from .response_format import GUIDED
from .settings import ServerSettings

logger = logging.getLogger("conveyor.server")

SAMPLERS = "use temperature, top_p, top_k or min_p"
PENALTIES = "use repetition_penalty, presence_penalty or frequency_penalty"
# llama.cpp field -> (its values that mean "off", what to use instead)
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "mirostat": ((0,), SAMPLERS),
    "typical_p": ((1.0,), SAMPLERS),
    "tfs_z": ((1.0,), SAMPLERS),
    "top_n_sigma": ((-1.0, 0.0), SAMPLERS),
    "xtc_probability": ((0.0,), SAMPLERS),
    "dynatemp_range": ((0.0,), "use temperature"),
    "dry_multiplier": ((0.0,), PENALTIES),
    "repeat_penalty": ((1.0,), "use repetition_penalty (over the whole prompt and output, not the last "
                               "repeat_last_n tokens)"),
    "penalize_nl": ((False,), PENALTIES),
    "n_probs": ((0,), "use logprobs (and top_logprobs in chat completions)"),
    "post_sampling_probs": ((False,), "logprobs are the model's, before sampling"),
    "t_max_predict_ms": ((0,), "there is no time limit: use max_tokens"),
    "lora": (([],), "merge the adapter into the weights and serve that"),
}
# vLLM fields that would change the result and that Conveyor does not have -> (values that change nothing,
# what to use instead)
VLLM_REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "truncation_side": (("left", None), "truncate_prompt_tokens keeps the prompt's last tokens (left truncation)"),
    "prompt_embeds": ((None,), "prompts are text or token ids"),
    "logprob_token_ids": ((None, []), "use logprobs (the top-n) or prompt_logprobs"),
}
# OpenAI fields whose ask cannot be met -> (values that ask nothing, what to do instead)
OPENAI_REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "functions": ((None, []), "send them as tools: [{\"type\": \"function\", \"function\": ...}]"),
    "function_call": ((None, "none", "auto"), "use tool_choice (with the functions as tools)"),
    "modalities": ((None, ["text"]), "the output is text only"),
    "audio": ((None,), "the output is text only"),
    "web_search_options": ((None,), "there is no built-in web search: give a search function as a tool"),
}
INERT = {"mirostat_tau", "mirostat_eta", "dynatemp_exponent", "xtc_threshold", "dry_base", "dry_allowed_length",
         "dry_penalty_last_n", "dry_sequence_breakers", "repeat_last_n", "samplers", "min_keep", "n_keep", "id_slot",
         "spaces_between_special_tokens",  # vLLM's: slow tokenizers only
         "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"}  # OpenAI's bookkeeping


def check_fields(body: SamplingFields, endpoint: str, logged: set[str]) -> None:
    """A 400 for a field that asks for what Conveyor does not do (llama.cpp's samplers, vLLM's and OpenAI's
    fields it lacks); a warning, once per name in `logged`, for a field ignored."""
    for name, value in (body.model_extra or {}).items():
        refused = [(whose, table[name]) for whose, table in (("llama.cpp", REFUSED), ("vLLM", VLLM_REFUSED),
                                                              ("OpenAI", OPENAI_REFUSED)) if name in table]
        if refused:
            [(whose, (off, instead))] = refused
            if value not in off:
                raise APIError(400, f"{whose}'s {name} is not supported (got {repr(value)[:80]}): {instead}",
                               param=name)
        elif name not in INERT and name not in GUIDED and name not in logged:
            logged.add(name)
            logger.warning("%s: request field %r is not supported and is ignored (logged once per field name)",
                           endpoint, name)


def token_limit(body: SamplingFields) -> int | None:
    """The generation limit asked for: `max_completion_tokens` over `max_tokens`, else llama.cpp's
    `n_predict`; None: the rest of the context. Two of them that disagree are a 400."""
    given = {name: getattr(body, name) for name in ("max_completion_tokens", "max_tokens")
             if name in body.model_fields_set and getattr(body, name) is not None}
    limit = next(iter(given.values()), None) if given else getattr(body, "max_tokens", None)
    if body.n_predict is None:
        return limit
    if body.n_predict == 0:
        raise APIError(400, "n_predict must be at least 1, or -1 for the rest of the context", param="n_predict")
    wanted = None if body.n_predict == -1 else body.n_predict
    if given and next(iter(given.values())) != wanted:
        raise APIError(400, f"n_predict ({body.n_predict}) and {next(iter(given))} disagree: give one",
                       param="n_predict")
    return wanted


def truncated(body: SamplingFields, prompts: list[list[int]], limit: int | None, max_model_len: int,
              param: str) -> list[list[int]]:
    """The prompts as `truncate_prompt_tokens` (vLLM's) keeps them: the last N tokens of each; -1, the most
    that fit beside `limit` (max_tokens) in the context; None, all (an over-long prompt is then a 400)."""
    keep = body.truncate_prompt_tokens
    if keep is None:
        return prompts
    if keep == 0:
        raise APIError(400, "truncate_prompt_tokens must be -1 (what fits beside max_tokens) or at least 1, got 0",
                       param="truncate_prompt_tokens")
    if keep == -1:
        if limit is None:
            raise APIError(400, "truncate_prompt_tokens=-1 keeps what fits beside max_tokens: give max_tokens",
                           param="truncate_prompt_tokens")
        keep = max_model_len - limit
        if keep < 1:
            raise APIError(400, f"max_tokens ({limit}) fills the context length of {max_model_len} tokens: no room "
                           "for the prompt", param=param, code="context_length_exceeded")
    return [ids[-keep:] for ids in prompts]


def check_logprobs(limit: int, **asked: int | None) -> None:
    """A 400 naming the field that asks for more logprobs than `limit` (--max-logprobs) allows."""
    for name, n in asked.items():
        if n is not None and n > limit:
            raise APIError(400, f"{name} must be at most {limit} (the server's --max-logprobs), got {n}", param=name)


def tokens_as_ids(body: SamplingFields, settings: ServerSettings) -> bool:
    """Whether logprobs name tokens `token_id:N` (vLLM's): the request's say, else the server's."""
    own = body.return_tokens_as_token_ids
    return settings.return_tokens_as_token_ids if own is None else own


def stream_usage(settings: ServerSettings) -> dict[str, bool]:
    """`streaming.stream_response`'s usage options as the server's flags set them."""
    return {"usage_details": settings.enable_prompt_tokens_details,
            "force_usage": settings.enable_force_include_usage}


def cached_tokens(finals: list[RequestOutput], n: int, settings: ServerSettings) -> int | None:
    """The prompt tokens the prefix cache held (each prompt's first choice's), with
    --enable-prompt-tokens-details; else None (the usage leaves them out)."""
    return sum(out.num_cached_tokens for out in finals[::n]) if settings.enable_prompt_tokens_details else None
