"""The pooling step's arithmetic (docs/design/pooling.md): a prompt's hidden states reduced to one vector,
chunk by chunk, and the task's head over it.

A prompt may be prefilled in several chunks, so the reduction works on chunks: each pass reduces every
pooling chunk's rows at once (`chunk_parts`: the last row, the first row, or the rows' sum, in fp32),
`merge` folds a chunk's part into what the prompt's earlier chunks left, and `finish` turns the
prompts that completed into their outputs in a few batched operations. The head runs in fp32, as
vLLM's: an embedding is the pooled vector (its first `dimensions` for a Matryoshka model), then
L2-normalized; a classifier's scores are its linear head over it, then a sigmoid (one label) or a
softmax. The token tasks ("ALL") keep every row instead (a chunk's part is its rows, `merge` appends
them) and run the same head over each row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

# One request's options in `finish`: (Matryoshka dimensions or None, normalize / activation on)
HeadOptions = tuple[int | None, bool]
# A pass's parts, one a chunk: `[chunks, hidden]` (one row each), or each chunk's `[rows, hidden]` ("ALL")
Parts = torch.Tensor | list[torch.Tensor]


class Pooler(nn.Module):
    """`task` "embed" or "classify", or "token_embed" / "token_classify" (every row through the same head);
    `pooling_type` "LAST", "MEAN" or "CLS", "ALL" for the token tasks; `classifier` the classify head
    (hidden -> num_labels, fp32: a linear layer, or layers ending in one); `projector` layers every pooled
    embedding goes through before the head (a sentence-transformers checkpoint's Dense modules, fp32)."""

    def __init__(self, task: str, pooling_type: str, normalize: bool, classifier: nn.Module | None = None,
                 projector: nn.Module | None = None) -> None:
        super().__init__()
        if task.endswith("classify") != (classifier is not None):
            raise ValueError("a classify pooler needs its classifier head, an embed pooler none")
        if task.startswith("token_") != (pooling_type == "ALL"):
            raise ValueError(f"the {task} task does not pool {pooling_type}: the token tasks pool ALL")
        self.task = task
        self.pooling_type = pooling_type
        self.normalize = normalize  # the default of requests that do not say (`PoolingParams.activation`)
        self.classifier = classifier
        self.projector = projector

    @property
    def reads_every_row(self) -> bool:
        """Whether rows before a prompt's last take part (then the whole prompt is computed: no prefix reuse)."""
        return self.pooling_type != "LAST"

    @property
    def num_labels(self) -> int | None:
        if self.classifier is None:
            return None
        return [m for m in self.classifier.modules() if isinstance(m, nn.Linear)][-1].out_features

    def read_rows(self, starts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor | None:
        """The one row of each chunk `chunk_parts` reads (the last or the first), in order; None where it reads
        them all (MEAN). A pass may then compute only these rows' hidden states (`CausalLM.forward`'s `rows`),
        and `chunk_parts` takes them with starts 0, 1, ... and counts of one."""
        if self.pooling_type == "LAST":
            return starts + counts - 1
        return starts if self.pooling_type == "CLS" else None

    def chunk_parts(self, hidden: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor) -> Parts:
        """Each chunk's part of its prompt's pooling, fp32, the chunk being `counts[i]` rows of `hidden` from
        row `starts[i]` (long tensors on its device): `[chunks, hidden]`, or for "ALL" each chunk's rows
        (copies: the pass's buffers are reused by the next)."""
        if self.pooling_type == "ALL":
            rows = hidden.index_select(0, torch.repeat_interleave(starts, counts) + ranks(counts))
            return list(rows.float().split(counts.tolist()))
        if self.pooling_type == "LAST":
            return hidden.index_select(0, starts + counts - 1).float()
        if self.pooling_type == "CLS":
            return hidden.index_select(0, starts).float()
        segment = torch.repeat_interleave(torch.arange(len(counts), device=hidden.device), counts)
        rows = hidden.index_select(0, starts[segment] + ranks(counts)).float()
        return torch.zeros(len(counts), hidden.shape[1], device=hidden.device).index_add_(0, segment, rows)

    def merge(self, state: torch.Tensor | None, part: torch.Tensor, first: bool) -> torch.Tensor:
        """What a prompt has pooled after one more chunk: `state` from its earlier chunks, `part` this one's,
        `first` whether this chunk starts at its first token (a recomputed prompt starts over)."""
        if first or state is None or self.pooling_type == "LAST":
            return part
        if self.pooling_type == "ALL":
            return torch.cat([state, part])
        return state if self.pooling_type == "CLS" else state + part

    def finish(self, pooled: Sequence[torch.Tensor], lengths: Sequence[int],
               options: Sequence[HeadOptions]) -> list[list[float]] | list[list[list[float]]]:
        """The outputs of completed prompts: each one's fp32 state as `merge` left it, their lengths (the
        mean's divisor) and head options; one head and one host copy per group of equal options. A token
        task's output is a list of rows, one a token."""
        if self.pooling_type == "ALL":
            return self.finish_rows(pooled, options)
        stacked = torch.stack(list(pooled))
        if self.pooling_type == "MEAN":
            stacked = stacked / torch.tensor(lengths, dtype=stacked.dtype, device=stacked.device).unsqueeze(1)
        if self.projector is not None:
            stacked = self.projector(stacked)
        results: list[list[float]] = [[] for _ in options]
        for (dimensions, activation), rows in groups(options).items():
            part = stacked if len(rows) == len(options) else stacked[torch.tensor(rows, device=stacked.device)]
            for i, values in zip(rows, self.head(part, dimensions, activation).tolist()):
                results[i] = values
        return results

    def finish_rows(self, pooled: Sequence[torch.Tensor], options: Sequence[HeadOptions]) -> list[list[list[float]]]:
        """The token tasks' outputs: the head over all rows of each group of prompts at once, split back."""
        results: list[list[list[float]]] = [[] for _ in options]
        for (dimensions, activation), members in groups(options).items():
            heads = self.head(torch.cat([pooled[i] for i in members]), dimensions, activation)
            values = heads.tolist()
            start = 0
            for i in members:
                results[i] = values[start:start + len(pooled[i])]
                start += len(pooled[i])
        return results

    def head(self, pooled: torch.Tensor, dimensions: int | None, activation: bool) -> torch.Tensor:
        """The task's head over pooled vectors (fp32)."""
        if self.classifier is not None:
            scores = self.classifier(pooled)
            if not activation:
                return scores
            return scores.sigmoid() if scores.shape[1] == 1 else scores.softmax(dim=-1)
        if dimensions is not None:
            pooled = pooled[:, :dimensions]
        return F.normalize(pooled, p=2, dim=-1) if activation else pooled


def groups(options: Sequence[HeadOptions]) -> dict[HeadOptions, list[int]]:
    """The indices of the requests sharing each set of head options."""
    grouped: dict[HeadOptions, list[int]] = {}
    for i, key in enumerate(options):
        grouped.setdefault(key, []).append(i)
    return grouped


def ranks(counts: torch.Tensor) -> torch.Tensor:
    """0, 1, ..., counts[i] - 1 for each i, concatenated: each row's place in its chunk."""
    total = int(counts.sum())
    return torch.arange(total, device=counts.device) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
