"""vLLM's offline queue: `LLM.enqueue` validates and queues prompts without waiting for them, as many
times as the caller likes; `LLM.wait_for_completion` runs the engine until every request queued since the
last wait has finished and returns their outputs, in the order they were queued (one per prompt, its
`n` samples in `outputs`). The requests wait in the manager's inbox until the loop runs: a server's loop,
already running, starts them at once."""

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
        """Queue the prompts as `generate` would run them (all validated first); their request ids, one per
        sample. `use_tqdm` is taken for vLLM's signature: queueing shows no progress."""
        requests, samples = self.sample_requests(prompts, sampling_params, priority, lora_request)
        for request in requests:
            self.manager.submit(request)
        self._queued().append((requests, samples))
        return [r.request_id for r in requests]

    def wait_for_completion(self, output_type: Any = None, *, use_tqdm: bool = True) -> list[RequestOutput]:
        """The outputs of every request queued since the last wait, in queueing order; the engine's loop is
        started for the call when it was not running. `output_type` is taken for vLLM's signature (these are
        all `RequestOutput`)."""
        batches = self._queued()[:]
        self._queued().clear()
        ids = [r.request_id for requests, _ in batches for r in requests]
        started_here = not self.manager.is_running()
        self.manager.start()
        try:
            outputs = self._collect(ids, use_tqdm)
        except BaseException:
            for request_id in ids:
                self.manager.cancel_request(request_id)
            raise
        finally:
            if started_here:
                self.manager.stop()
        decode_logprob_tokens(outputs, self.tokenizer.decode)
        return per_prompt_samples(outputs, [n for _, samples in batches for n in samples])

    def _queued(self) -> list[tuple[list[Request], list[int]]]:
        """The batches `enqueue` queued since the last wait."""
        return self.__dict__.setdefault("_enqueued", [])
