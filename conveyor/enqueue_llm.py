"""vLLM's offline queue: `LLM.enqueue` validates prompts and keeps their requests without running them, as
many times as the caller likes; `LLM.wait_for_completion` runs every request kept since the last wait, as one
`generate` batch, and returns their outputs in the order they were queued (one per prompt, its `n` samples in
`outputs`). Nothing reaches the engine before the wait, so a `generate` in between neither runs nor cuts them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from .lora_request import LoRARequest
from .manager import ContinuousBatchingManager
from .request import Prompt, Request, RequestOutput, decode_logprob_tokens, per_prompt_samples
from .sampling_params import SamplingParams


class EnqueueMethods:
    """Mixed into `LLM`: the manager, tokenizer, `sample_requests` and `_collect` are `LLM`'s."""

    manager: ContinuousBatchingManager
    tokenizer: PreTrainedTokenizerBase
    sample_requests: Callable[..., tuple[list[Request], list[int]]]
    _collect: Callable[..., list[RequestOutput]]

    def enqueue(self, prompts: Prompt | Sequence[Prompt],
                sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                priority: int | Sequence[int] | None = None, use_tqdm: bool = True) -> list[str]:
        """Validate the prompts as `generate` would (all of them first) and keep their requests for the next
        `wait_for_completion`; their request ids, one per sample. `use_tqdm` is taken for vLLM's signature."""
        requests, samples = self.sample_requests(prompts, sampling_params, priority, lora_request)
        self._queued().append((requests, samples))
        return [r.request_id for r in requests]

    def wait_for_completion(self, output_type: Any = None, *, use_tqdm: bool = True) -> list[RequestOutput]:
        """The outputs of every request queued since the last wait, in queueing order. `output_type` is taken
        for vLLM's signature (these are all `RequestOutput`)."""
        batches = self._queued()[:]
        self._queued().clear()
        requests = [r for batch, _ in batches for r in batch]
        outputs = self.manager.run_batch(requests, lambda ids: self._collect(ids, use_tqdm))
        decode_logprob_tokens(outputs, self.tokenizer.decode)
        return per_prompt_samples(outputs, [n for _, samples in batches for n in samples])

    def _queued(self) -> list[tuple[list[Request], list[int]]]:
        """The batches `enqueue` kept since the last wait."""
        return self.__dict__.setdefault("_enqueued", [])
