"""The pooling model's runner (docs/design/pooling.md): a pooling request is a prefill-only request whose
result is its pooled hidden states, as prompt logprobs are a prefill's by-product.

A pass runs the scheduled chunks through the model as any pass does (`ModelRunner.prepare`, `forward`:
chunked prefill and prefix caching work as for generation), then, instead of the LM head and the
sampler, the pooler reduces each chunk's rows (`layers.pooler`; the token tasks keep them all): a chunk
that completes its prompt gives the request's output through the task's head, an earlier one the state
its next chunk starts from. The results go back as a `StepResult`, so the engine's step is the generating one; the output
processor records them and finishes the requests (`OutputProcessor.add_pooled`). A pooling engine
runs only pooling requests: nothing in its batches decodes, so it has no CUDA graphs, async
batching or speculation.
"""

from __future__ import annotations

import torch

from ..config import ConfigError, ContinuousBatchingConfig
from ..layers.pooler import Pooler
from ..request import Request
from ..sched.output import ScheduledChunk
from .model_runner import ModelRunner, PooledStep, StepResult, split_batch


class PoolingModelRunner(ModelRunner):
    """`ModelRunner` whose passes end in the pooler instead of the LM head and the sampler."""

    def __init__(self, *args: object, pooler: Pooler, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.pooler = pooler

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> StepResult:
        step = self.prepare(chunks)  # (its sample rows are left unread: nothing samples)
        decodes, prefills = split_batch(chunks, self.drafts_decode)
        order = decodes + prefills  # the pass's row order
        counts = torch.tensor([c.num_tokens for c in order], device=self.device)
        starts = counts.cumsum(0) - counts
        rows = self.pooler.read_rows(starts, counts)  # (LAST, CLS: the pass computes those rows' states alone)
        hidden = self.forward(step, rows)
        if rows is not None:
            starts, counts = torch.arange(len(order), device=self.device), torch.ones_like(counts)
        return StepResult([], [], [], pooled=self.pool_chunks(order, hidden, starts, counts))

    def pool_chunks(self, order: list[ScheduledChunk], hidden: torch.Tensor, starts: torch.Tensor,
                    counts: torch.Tensor) -> PooledStep:
        """Each chunk's part of its prompt's pooling (chunk i: `counts[i]` rows of `hidden` from `starts[i]`),
        merged with its earlier chunks'; the outputs of the prompts completed, through the head in one batch
        per set of options. `order`: the chunks in the pass's row order."""
        parts = self.pooler.chunk_parts(hidden, starts, counts)
        out = PooledStep()
        done: list[torch.Tensor] = []
        for chunk, part in zip(order, parts):
            request, start = chunk.request, chunk.request.num_computed_tokens
            pooled = self.pooler.merge(request.pooling_state, part, first=start == 0)
            if start + chunk.num_tokens == request.num_tokens:
                done.append(pooled)
                out.results.append((request, []))
            else:
                out.states.append((request, pooled))
        if done:
            requests = [r for r, _ in out.results]
            options = [head_options(r, self.pooler) for r in requests]
            values = self.pooler.finish(done, [r.num_tokens for r in requests], options)
            out.results = list(zip(requests, values))
        return out


def head_options(request: Request, pooler: Pooler) -> tuple[int | None, bool]:
    """(Matryoshka dimensions, normalize / activation) of a pooling request, the pooler's default where unset."""
    params = request.pooling
    assert params is not None, "a pooling engine runs pooling requests only"
    activation = params.activation
    return params.dimensions, pooler.normalize if activation is None else activation


def check_pooling_config(config: ContinuousBatchingConfig) -> None:
    """A pooling engine's batches never decode: what exists for decodes (graphs, padding, async batching,
    speculation) is refused when asked for, rather than ignored."""
    asked = [name for name in ("use_cuda_graph", "use_async_batching", "pad_steps") if getattr(config, name)]
    asked += ["speculative_config"] if config.speculative_config is not None else []
    if asked:
        raise ConfigError(f"a pooling model (runner 'pooling') runs prefills only: {', '.join(asked)} apply to "
                          "decoding; leave them unset")
