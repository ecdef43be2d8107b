"""CUDA graphs of padded decode steps (docs/design/cuda-graphs.md), in a bounded cache keyed by the padded shape.

A decode step of a small model is hundreds of kernel launches whose weights stream in tens of
microseconds: launch and host overhead set the speed. A padded decode-only step (`step_buffers`)
has a shape that recurs, so its whole forward pass (the attention backend's derived index tensors,
every layer, the LM head over the sample rows) is captured once per (buffer set, padded shape)
and replayed: the static buffers give the replay its fixed input addresses. Steps with prefill
chunks or prompt logprobs (per-chunk Python in the attention), and shapes over the largest bucket
(`max_tokens` padded tokens), run eagerly. Sampling stays outside the graph. All graphs share one
memory pool (they replay one after another on one stream); what they hold is reserved before the
KV pool is sized (`graph_memory_bytes`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..cache.pool import working_memory_bytes
from ..config import ConfigError, ContinuousBatchingConfig
from .step_buffers import PaddedShape, round_up

MAX_GRAPHS = 64  # captured graphs kept; the least recently replayed is dropped first


def use_cuda_graphs(config: ContinuousBatchingConfig, device: torch.device, capturable: bool = True) -> bool:
    """`use_cuda_graph` resolved for this device: None = on for CUDA, off elsewhere, and off for a model
    whose forward reads device values on the host (`capturable` False: mixture-of-experts models size
    each expert's slice from the routing)."""
    if config.use_cuda_graph is None:
        return device.type == "cuda" and capturable
    if config.use_cuda_graph and not capturable:
        raise ConfigError("use_cuda_graph=True: this model's forward cannot be captured in a CUDA graph (its "
                          "mixture-of-experts layers size each expert's rows from the routing); use None or False")
    if config.use_cuda_graph and device.type != "cuda":
        raise ConfigError(f"use_cuda_graph=True needs a CUDA device, got {device.type!r} (allowed on this device: "
                          "None or False; pad_steps=True pads steps without capturing)")
    if config.use_cuda_graph and config.pad_steps is False:
        raise ConfigError("use_cuda_graph=True needs padded steps: pad_steps must be None or True, got False")
    return bool(config.use_cuda_graph)


def graph_tokens(config: ContinuousBatchingConfig) -> int:
    """The largest bucket: padded decode rows of a full decode batch."""
    return round_up(config.max_requests_per_batch, config.q_padding_interval_size)


def graph_memory_bytes(model: Any, config: ContinuousBatchingConfig, dtype: torch.dtype) -> int:
    """Memory the graphs' pool may hold besides the eager working memory: one pass of the largest
    bucket (the same estimate as `working_memory_bytes`, for that many tokens and sample rows)."""
    tokens = graph_tokens(config)
    return working_memory_bytes(model, replace(config, max_batch_tokens=tokens, max_requests_per_batch=tokens), dtype)


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    logits: torch.Tensor  # the LM head's output rows, written by every replay
    keep: list[Any]  # tensors the graph reads that nothing else may free (metadata, attention workspace)


class CudaGraphs:
    """Capture and replay for one model runner; counts captures, replays and eager fallbacks."""

    def __init__(self, runner: Any, max_tokens: int, max_graphs: int = MAX_GRAPHS) -> None:
        self.runner = runner
        self.max_tokens = max_tokens
        self.max_graphs = max_graphs
        self.graphs: OrderedDict[tuple[int, PaddedShape], _Graph] = OrderedDict()
        self.pool = torch.cuda.graph_pool_handle()
        self.captures = self.replays = self.eager_steps = 0

    def takes(self, step: Any) -> bool:
        shape = step.shape
        return (shape is not None and shape.decode_only and step.prompt_plan is None and bool(step.samplers)
                and shape.num_tokens <= self.max_tokens)

    def replay(self, step: Any) -> torch.Tensor:
        """Logits of the step's sample rows (padded ones included): replayed, captured first if new."""
        key = (step.buffer_set, step.shape)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self._capture(step)
            if len(self.graphs) >= self.max_graphs:
                self.graphs.popitem(last=False)
            self.graphs[key] = entry
            self.captures += 1
        else:
            self.graphs.move_to_end(key)
        entry.graph.replay()
        self.replays += 1
        return entry.logits

    def _body(self, step: Any) -> torch.Tensor:
        for meta in step.metas:
            self.runner.attention.prepare(meta)
        hidden = self.runner.forward(step)
        return self.runner.model.compute_logits(hidden.index_select(0, step.sample_rows))

    def _capture(self, step: Any) -> _Graph:
        """Warm up on a side stream (workspaces sized, lazy initialisations done), then capture. The
        warm-up runs this very step once, so it writes the same K/V the replay writes."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._body(step)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._body(step)
        keep = [step.metas, getattr(self.runner.attention, "_workspace", None)]
        return _Graph(graph, logits, keep)
