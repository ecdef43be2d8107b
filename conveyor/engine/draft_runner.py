"""Draft-model proposals: a smaller model with the target's vocabulary (or the target's own weights in
a low-bit mode, the self-draft) proposes k tokens greedily, batched across speculating requests.

The draft keeps its own KV tensors, a `CachePool` with the target's number of chunks and page size,
addressed by the target's block tables: a block id is an index into both pools, so there is no second
allocator, blocks come and go with the target's, and the positions the target rolls back are simply
overwritten later. The draft catches up lazily: before proposing for a request it runs every token
of the request the draft has not seen yet (its whole prompt the first time) in the same pass as the
other requests' newest token, then k - 1 one-row-per-request passes. What it saw is remembered per
request with the blocks it wrote; if the target's table changed under them (offload, swap), the draft
starts over. Proposals are only hints: verification decides every token, so a stale draft costs
acceptance, never correctness.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..cache.allocator import AttentionTypeAllocator, CacheAllocator
from ..cache.pool import CachePool
from ..layers.attention import make_attention_backend
from ..layers.precision import keeps_stored
from ..models import build_model
from ..models.base import CausalLM
from ..models.loader import load_checkpoint
from ..request import Request
from ..sched.output import ScheduledChunk
from ..speculative.config import SpeculativeConfig
from .model_runner import ModelRunner


def load_draft_model(spec: SpeculativeConfig, target_path: Path, target: CausalLM, device: torch.device) -> CausalLM:
    """The draft for `spec`: the model at `spec.model`, or (self-draft) the target's checkpoint again in
    `spec.quantization`; computes in the target's dtype. A draft with another vocabulary, or with
    sliding-window layers, is a ValueError naming the field."""
    dtype = target.dtype
    quantization = spec.quantization
    path = target_path if spec.model is None else Path(spec.model)
    checkpoint = load_checkpoint(path, dtype=dtype, keep_quantized=keeps_stored(quantization, device))
    if quantization is None:
        quantization = checkpoint.stored_format or "none"
    vocab, target_vocab = checkpoint.config.vocab_size, target.config.vocab_size
    if vocab != target_vocab:
        raise ValueError(f"speculative_config.model: the draft's vocabulary has {vocab} tokens, the target's "
                         f"{target_vocab}; a draft model must share the target's tokenizer")
    draft = build_model(checkpoint.config, checkpoint.state_dict, dtype, device, quantization)
    if set(draft.layer_types) != {"full_attention"}:
        raise ValueError("speculative_config.model: draft models with sliding-window layers are not supported")
    return draft


def draft_bytes_per_chunk(draft: CausalLM, page_size: int) -> int:
    """KV bytes the draft adds to every chunk of the pool (for sizing the pool)."""
    return CachePool.bytes_per_chunk(page_size=page_size, num_layers=draft.num_layers,
                                     num_kv_heads=draft.num_kv_heads, head_dim=draft.head_dim, dtype=draft.dtype)


@dataclass
class _Seen:
    """How many of a request's tokens the draft has K/V for, and the blocks that K/V went into."""

    num_tokens: int
    blocks: list[int] = field(default_factory=list)


class _DraftView:
    """A request as the draft's runner sees it: its sequence plus the proposals so far, computed up to
    what the draft has seen."""

    needs_prompt_logprobs = False

    def __init__(self, request: Request, start: int, drafts: list[int]) -> None:
        self.request, self.request_id = request, request.request_id
        self.num_computed_tokens, self.drafts = start, drafts

    @property
    def num_tokens(self) -> int:
        return self.request.num_tokens + len(self.drafts)

    @property
    def rope_length(self) -> int:
        return self.request.rope_length

    def token_slice(self, start: int, end: int) -> list[int]:
        base = self.request.num_tokens
        head = self.request.token_slice(start, min(end, base)) if start < base else []
        return head + self.drafts[max(start - base, 0):end - base]


class DraftProposer:
    def __init__(self, draft: CausalLM, allocator: CacheAllocator, num_chunks: int, page_size: int,
                 device: torch.device, attention_backend: str = "auto") -> None:
        if (not isinstance(allocator, AttentionTypeAllocator) or allocator.window is not None
                or allocator.num_groups != 1):
            raise ValueError("speculative_config: draft models need a target with full attention only")
        self.model = draft
        self.allocator = allocator
        self.page_size = page_size
        self.pool = CachePool(num_chunks, page_size=page_size, num_layers=draft.num_layers,
                              num_kv_heads=draft.num_kv_heads, head_dim=draft.head_dim, dtype=draft.dtype,
                              device=device)
        self.runner = ModelRunner(draft, self.pool, [(allocator, 0, list(range(draft.num_layers)))], device,
                                  attention=make_attention_backend(device, draft.dtype, attention_backend))
        self.seen: dict[str, _Seen] = {}

    def _start(self, request: Request) -> int:
        """Tokens of `request` whose draft K/V is still where the target's table says."""
        seen = self.seen.get(request.request_id)
        if seen is None:
            return 0
        table = self.allocator.block_table(request.request_id)
        if table[:len(seen.blocks)] != seen.blocks:
            return 0
        return min(seen.num_tokens, request.num_computed_tokens)

    @torch.inference_mode()
    def propose(self, chunks: list[ScheduledChunk]) -> None:
        """Fill each chunk's `draft_tokens` (placeholders of the right length) with greedy proposals."""
        views = [_DraftView(c.request, self._start(c.request), []) for c in chunks]
        for step in range(max(len(c.draft_tokens) for c in chunks)):
            live = [v for v, c in zip(views, chunks) if len(c.draft_tokens) > step]
            passes = [ScheduledChunk(v, v.num_tokens - v.num_computed_tokens) for v in live]  # type: ignore[arg-type]
            prepared = self.runner.prepare(passes)
            hidden = self.runner.forward(prepared)
            logits = self.model.compute_logits(hidden.index_select(0, prepared.sample_rows))
            for view, token in zip(prepared.samplers, logits.argmax(dim=-1).tolist()):
                view.num_computed_tokens = view.num_tokens  # type: ignore[attr-defined]
                view.drafts.append(token)  # type: ignore[attr-defined]
        for view, chunk in zip(views, chunks):
            chunk.draft_tokens[:] = view.drafts
            end = view.num_computed_tokens  # the last proposal was never fed back
            table = self.allocator.block_table(view.request_id)
            self.seen[view.request_id] = _Seen(end, table[:-(-end // self.page_size)])
        if len(self.seen) > 2 * len(chunks) + 64:  # forget finished requests now and then
            self.seen = {rid: s for rid, s in self.seen.items() if self.allocator.holds(rid)}

    def rolled_back(self, request: Request) -> None:
        """The target kept K/V up to `num_computed_tokens`; draft K/V past it is for rejected tokens."""
        seen = self.seen.get(request.request_id)
        if seen is not None and seen.num_tokens > request.num_computed_tokens:
            seen.num_tokens = request.num_computed_tokens
            del seen.blocks[-(-seen.num_tokens // self.page_size):]
