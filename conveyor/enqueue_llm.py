"""vLLM's offline queue: `LLM.enqueue` validates prompts and keeps their requests without running them, as
many times as the caller likes; `LLM.wait_for_completion` runs every request kept since the last wait, as one
`generate` batch, and returns their outputs in the order they were queued (one per prompt, its `n` samples in
`outputs`). Nothing reaches the engine before the wait, so a `generate` in between neither runs nor cuts them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .lora_request import LoRARequest
from .request import Prompt, Request, RequestOutput
from .sampling_params import SamplingParams


class EnqueueMethods:
    """Mixed into `LLM`: `sample_requests` and `run_samples` are `LLM`'s (`generate`'s two halves)."""

    sample_requests: Callable[..., tuple[list[Request], list[int]]]
    run_samples: Callable[..., list[RequestOutput]]

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
        return self.run_samples([r for batch, _ in batches for r in batch], [n for _, ns in batches for n in ns],
                                use_tqdm)

    def _queued(self) -> list[tuple[list[Request], list[int]]]:
        """The batches `enqueue` kept since the last wait."""
        return self.__dict__.setdefault("_enqueued", [])
