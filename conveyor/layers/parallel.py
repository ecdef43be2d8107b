"""Tensor-parallel layers (Megatron's layout, as vLLM and nano-vllm have it), wrapped around the
existing linear and embedding classes so that every weight format runs sharded unchanged.

A column-parallel linear (fused q/k/v, gate/up) needs no wrapper: each rank simply holds its rows
(its heads, its share of the MLP), and its output is this rank's part of the activation. A
row-parallel linear (o, down) holds the matching input columns; its output is a partial sum, added
up across ranks by one all-reduce (`RowParallelLinear`). The embedding and the LM head are split
along the vocabulary: a rank looks up only the ids it holds and the rows are summed
(`VocabParallelEmbedding`, one all-reduce), and each rank's logits are gathered to rank 0, the
one that samples (`VocabParallelHead`). The collectives come from a `Collectives` object
(`distributed.group`): this module only calls it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


class Collectives(Protocol):
    """The two collectives a tensor-parallel forward pass needs."""

    rank: int
    world_size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; returns `x`."""

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `x` (same shape) concatenated along the last dim on rank 0; None elsewhere."""


class RowParallelLinear(nn.Module):
    """A linear layer over this rank's input features (any class: `nn.Linear`, `PackedLinear`,
    `QuantLinear`); the partial outputs summed across ranks. Only rank 0's copy has the bias
    (the sharding zeroes the others), so it is added once."""

    def __init__(self, linear: nn.Module, comm: Collectives) -> None:
        super().__init__()
        self.linear = linear
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(self.linear(x))


class VocabParallelEmbedding(nn.Module):
    """An embedding over rows `[start, start + rows)` of the vocabulary (any class: `nn.Embedding`,
    `QuantEmbedding`): ids outside it give zero rows, and the ranks' rows are summed, which is exact
    (each id is found on one rank only)."""

    def __init__(self, embedding: nn.Module, start: int, comm: Collectives) -> None:
        super().__init__()
        self.embedding = embedding
        self.start = start
        self.rows = embedding.weight.shape[0]
        self.comm = comm

    @property
    def weight(self) -> torch.Tensor:
        """This rank's rows (a tied LM head reads them)."""
        return self.embedding.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.rows)
        out = self.embedding(torch.where(inside, local, 0))
        out = out.masked_fill(~inside.unsqueeze(-1), 0)
        return self.comm.all_reduce(out)


class VocabParallelHead:
    """hidden -> logits from this rank's vocabulary rows (`head`: the quantized, packed or plain LM head
    over them), gathered to rank 0. Shards are padded to `shard_rows` (the largest) for the gather and
    the padding cut off. Rank 0 gets `[rows, vocab_size]`; the others get their own part (unused)."""

    __slots__ = ("comm", "head", "shard_rows", "vocab_size")

    def __init__(self, head: Callable[[torch.Tensor], torch.Tensor], comm: Collectives, shard_rows: int,
                 vocab_size: int) -> None:
        self.head = head
        self.comm = comm
        self.shard_rows = shard_rows
        self.vocab_size = vocab_size

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.head(hidden)
        if local.shape[-1] < self.shard_rows:
            local = F.pad(local, (0, self.shard_rows - local.shape[-1]))
        gathered = self.comm.gather_to_first(local.contiguous())
        return local if gathered is None else gathered[..., :self.vocab_size]
