"""Requests in: a prompt and its `SamplingParams` tokenized, checked against the model and the cache, its
output constraint compiled and its seeded generator made, before anything is queued. A refusal is an
`InvalidRequestError` with a code and the parameter at fault (the server maps the code to its answer).
Safe from any thread: it reads only what is fixed once the engine is built.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from ..errors import InvalidRequestError, RequestErrorCode
from ..layers.pooler import Pooler
from ..pooling_params import PoolingParams
from ..reasoning_state import ReasoningMarkers, ReasoningState
from ..request import Prompt, Request
from ..sampling_params import SamplingParams
from ..structured.constraints import Constraints


# What a pooling request carries as sampling parameters: it never samples (its result is its pooled prompt).
POOLING_SAMPLING = SamplingParams(max_new_tokens=1, temperature=0.0)


class InputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, max_model_len: int,
                 eos_token_ids: tuple[int, ...], capacity_tokens: int, blocks_for_tokens: Callable[[int], int],
                 max_batch_pages: int | None, device: torch.device, seed: int | None = None,
                 priority_scheduling: bool = False, pooler: Pooler | None = None,
                 matryoshka: list[int] | None = None, whole_prompts: int | None = None) -> None:
        """`capacity_tokens`: the longest sequence the KV pool holds; `blocks_for_tokens`: the pages a
        sequence of that many tokens reads (the allocator's); `seed`: the engine's seed (config.seed);
        `priority_scheduling`: whether requests' priorities count (else only 0 is taken, as vLLM);
        `pooler` and `matryoshka`: a pooling engine's (`Engine`); `whole_prompts`: an encoder's pass size
        (`max_batch_tokens`), which each of its prompts must fit whole."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.capacity_tokens = capacity_tokens
        self.blocks_for_tokens = blocks_for_tokens
        self.max_batch_pages = max_batch_pages
        self.device = device
        self.constraints = Constraints(tokenizer, vocab_size, eos_token_ids)  # structured outputs
        self.seed = seed
        self.priority_scheduling = priority_scheduling
        self.pooler = pooler
        self.matryoshka = matryoshka
        self.whole_prompts = whole_prompts
        self.unseeded = itertools.count()  # arrival numbers of sampled requests without a seed (atomic next)
        # What a thinking_token_budget counts and forces, and where a grammar starts (after the reasoning)
        self.reasoning_markers: ReasoningMarkers | None = None
        self.constraints_in_reasoning = False  # vLLM's enable_in_reasoning: a grammar masks the reasoning too

    def make_request(self, request_id: str, prompt: Prompt, params: SamplingParams) -> Request:
        """Tokenize and validate; raises InvalidRequestError naming the limit."""
        if self.pooler is not None:
            raise InvalidRequestError("this is a pooling model (runner 'pooling'): it embeds or scores prompts "
                                      "(LLM.embed, LLM.score), it does not generate")
        if params.n != 1:
            raise InvalidRequestError(f"n={params.n}: a request is one sample; LLM.generate and LLM.chat make one "
                                      "request per sample (the server: its body's n)", param="n")
        token_ids, text = self.prompt_ids(prompt)
        token_ids = self.truncated(token_ids, params.truncate_prompt_tokens, params.max_new_tokens)
        self.check_fits(token_ids, params.max_new_tokens)
        if params.priority != 0 and not self.priority_scheduling:
            raise InvalidRequestError(f"priority {params.priority} needs priority scheduling: start the engine with "
                                      "scheduling_policy='priority' (--scheduling-policy priority)", param="priority")
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > self.vocab_size:
                raise InvalidRequestError(f"{name} must be at most the vocabulary size {self.vocab_size}, "
                                          f"got {getattr(params, name)}", param=name)
        for name, ids in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise InvalidRequestError(f"{name} token ids must be in [0, {self.vocab_size}), got {bad[:5]}",
                                          param=name)
        try:
            grammar = self.constraints.matcher(params.structured_outputs)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), RequestErrorCode.INVALID_STRUCTURED_OUTPUTS,
                                      "structured_outputs") from exc
        request = Request(request_id, token_ids, params, prompt=text, eos_token_ids=self.eos_token_ids)
        request.grammar = grammar
        gated = grammar is not None and self.reasoning_markers is not None and not self.constraints_in_reasoning
        if params.thinking_token_budget is not None or gated:
            request.reasoning = self.reasoning_state(params, token_ids, gated)
        request.bad_words_token_ids = self.bad_words_token_ids(params.bad_words)
        request.cache_salt = self.cache_salt(prompt)
        if not params.greedy and (params.seed is not None or self.seed is not None):
            request.generator = torch.Generator(device=self.device).manual_seed(self.request_seed(params))
        return request

    def reasoning_state(self, params: SamplingParams, token_ids: list[int], gated: bool) -> ReasoningState:
        """A request's reasoning followed: for its thinking budget, and where its grammar starts (`gated`)."""
        markers = self.reasoning_markers
        if markers is None:
            raise InvalidRequestError("thinking_token_budget needs the model's reasoning markers: start the engine "
                                      "with reasoning_parser=NAME or reasoning_config (--reasoning-parser, "
                                      "--reasoning-config)", param="thinking_token_budget")
        if params.structured_outputs is not None and not gated:
            raise InvalidRequestError("thinking_token_budget with structured_outputs needs the constraint after the "
                                      "reasoning, not in it (structured_outputs_config enable_in_reasoning is on)",
                                      param="thinking_token_budget")
        return ReasoningState(markers, token_ids, params.thinking_token_budget, gated)

    def make_pooling_request(self, request_id: str, prompt: Prompt, params: PoolingParams) -> Request:
        """A pooling engine's request (prefill only: the prompt may fill the whole context); raises
        InvalidRequestError naming the limit."""
        if self.pooler is None:
            raise InvalidRequestError("this model generates: embedding and scoring need a pooling model (LLM(..., "
                                      "runner='pooling'), conveyor serve --runner pooling)")
        if params.dimensions is not None:
            self.check_dimensions(params.dimensions)
        token_ids, text = self.prompt_ids(prompt)
        keep = params.truncate_prompt_tokens
        if self.whole_prompts is not None and keep is not None:  # an encoder keeps [CLS] ... [SEP], as its tokenizer
            keep = self.max_model_len if keep == -1 else keep
            token_ids = token_ids[:keep - 1] + token_ids[-1:] if len(token_ids) > keep else token_ids
        else:
            token_ids = self.truncated(token_ids, keep, 0)
        self.check_fits(token_ids, 0)
        if self.whole_prompts is not None and len(token_ids) > self.whole_prompts:
            raise InvalidRequestError(f"prompt ({len(token_ids)} tokens) exceeds the {self.whole_prompts} tokens an "
                                      "encoder model computes in one pass (max_num_batched_tokens)",
                                      RequestErrorCode.CONTEXT_LENGTH_EXCEEDED)
        request = Request(request_id, token_ids, POOLING_SAMPLING, prompt=text, pooling=params)
        request.pools_every_row = self.pooler.reads_every_row
        request.whole_prompt = self.whole_prompts is not None
        return request

    def check_dimensions(self, dimensions: int) -> None:
        """Matryoshka dimensions the model takes (vLLM's rule and message)."""
        if self.pooler is not None and self.pooler.task != "embed":
            raise InvalidRequestError("dimensions applies to embeddings; this model classifies", param="dimensions")
        if self.matryoshka is None:
            raise InvalidRequestError("the model does not support matryoshka representation, changing output "
                                      "dimensions will lead to poor results (a model trained for it says so in its "
                                      "config: is_matryoshka or matryoshka_dimensions; hf_overrides sets them)",
                                      param="dimensions")
        if self.matryoshka and dimensions not in self.matryoshka:
            raise InvalidRequestError(f"dimensions {dimensions} is not one the model was trained for: "
                                      f"{self.matryoshka}", param="dimensions")

    def check_fits(self, token_ids: list[int], max_new_tokens: int) -> None:
        """The prompt and what it may generate within the context, the KV pool and max_batch_pages."""
        total = len(token_ids) + max_new_tokens
        if total > self.max_model_len:
            what = f"prompt ({len(token_ids)} tokens)" + (f" + max_new_tokens ({max_new_tokens}) = {total}"
                                                           if max_new_tokens else "")
            raise InvalidRequestError(f"{what} exceeds the context length of {self.max_model_len} tokens "
                                      "(max_model_len)", RequestErrorCode.CONTEXT_LENGTH_EXCEEDED)
        if len(token_ids) > self.capacity_tokens:
            raise InvalidRequestError(f"prompt ({len(token_ids)} tokens) exceeds the KV cache capacity of "
                                      f"{self.capacity_tokens} tokens", RequestErrorCode.CACHE_CAPACITY_EXCEEDED)
        pages = self.blocks_for_tokens(total)
        if self.max_batch_pages is not None and pages > self.max_batch_pages:
            raise InvalidRequestError(f"request may need {pages} KV pages, over max_batch_pages="
                                      f"{self.max_batch_pages}", RequestErrorCode.CACHE_CAPACITY_EXCEEDED)

    def truncated(self, token_ids: list[int], keep: int | None, max_new_tokens: int) -> list[int]:
        """The prompt's last `keep` tokens (`truncate_prompt_tokens`; -1: the most that leave room for
        `max_new_tokens` in the context), or the whole prompt."""
        if keep is None:
            return token_ids
        if keep == -1:
            keep = self.max_model_len - max_new_tokens
            if keep < 1:
                raise InvalidRequestError(f"truncate_prompt_tokens=-1 leaves no room for the prompt: max_new_tokens "
                                          f"({max_new_tokens}) fills the context length of "
                                          f"{self.max_model_len} tokens", RequestErrorCode.CONTEXT_LENGTH_EXCEEDED,
                                          param="max_new_tokens")
        return token_ids[-keep:]

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word's tokens, alone and after a space (vLLM's rule: the spaced form is kept where it is
        other tokens of the same count, so the word is banned at the start and in the middle of a text)."""
        sequences: list[list[int]] = []
        for word in words:
            alone = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if alone:
                sequences.append(alone)
            if spaced and (not alone or spaced[0] != alone[0]) and len(spaced) == len(alone):
                sequences.append(spaced)
        return sequences

    def request_seed(self, params: SamplingParams) -> int:
        """The request's own seed, else one drawn from the engine's seed and the request's arrival number:
        the same requests in the same order sample the same tokens (vLLM's `seed`)."""
        if params.seed is not None:
            return params.seed
        digest = hashlib.blake2b(f"{self.seed}:{next(self.unseeded)}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little")

    def prompt_ids(self, prompt: Prompt) -> tuple[list[int], str | None]:
        """(token ids, the text if the prompt was text). vLLM's prompt dicts are taken too: `{"prompt": text}`
        and `{"prompt_token_ids": ids}`."""
        if isinstance(prompt, dict):
            prompt = self._vllm_prompt(prompt)
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty", RequestErrorCode.INVALID_PROMPT, "prompt")
            token_ids, text = self.tokenizer.encode(prompt), prompt
        else:
            token_ids, text = list(prompt), None
            bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(f"prompt token ids must be integers in [0, {self.vocab_size}), got {bad[:5]}",
                                          RequestErrorCode.INVALID_PROMPT, "prompt")
        if not token_ids:
            raise InvalidRequestError("prompt is empty (0 tokens)", RequestErrorCode.INVALID_PROMPT, "prompt")
        return token_ids, text

    @staticmethod
    def cache_salt(prompt: Prompt) -> str | None:
        """vLLM's `cache_salt` of a prompt dict: prompts reuse cached blocks only of prompts with the same salt."""
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise InvalidRequestError(f"cache_salt must be a non-empty string, got {salt!r}",
                                      RequestErrorCode.INVALID_PROMPT, "cache_salt")
        return salt

    @staticmethod
    def _vllm_prompt(prompt: dict[str, Any]) -> str | list[int]:
        """The text or ids of vLLM's `TextPrompt` / `TokensPrompt` (and its `cache_salt`); other keys
        (multi-modal data, embeddings) are refused by name rather than ignored."""
        other = sorted(set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"})
        if other or not prompt:
            raise InvalidRequestError(f"a prompt dict takes 'prompt' (text) or 'prompt_token_ids'; not supported: "
                                      f"{other or 'an empty dict'}", RequestErrorCode.INVALID_PROMPT, "prompt")
        if "prompt_token_ids" in prompt:
            return prompt["prompt_token_ids"]
        return prompt["prompt"]
