"""Model runner: turns a scheduled batch into index tensors, runs the model, samples.

One forward pass covers every scheduled chunk, flattened: single-token chunks (decodes) first,
so attention can treat them as one padded group, then prefill chunks. Only the last token of a
chunk that completes its request's sequence is sent through the LM head and the sampler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .allocator import FullAttentionCacheAllocator
from .attention import AttentionBackend, AttentionMetadata, PrefillSpan, cache_slots, make_attention_backend
from .cache_pool import CachePool
from .models.llama import LlamaForCausalLM
from .request import Request
from .sampler import Sampler
from .scheduler import ScheduledChunk


@dataclass
class StepResult:
    """The requests that sampled this step, with their new tokens (and logprobs when asked)."""

    requests: list[Request]
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, pool: CachePool, allocator: FullAttentionCacheAllocator,
                 device: torch.device, attention: AttentionBackend | None = None) -> None:
        self.model = model
        self.pool = pool
        self.allocator = allocator
        self.device = device
        self.attention = attention or make_attention_backend(device, next(model.parameters()).dtype)
        self.sampler = Sampler()
        self.page_size = pool.page_size

    def prepare(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata,
                                                               list[int], list[Request]]:
        """Input ids, positions, attention metadata, and the batch rows (and requests) that sample."""
        decodes = [c for c in chunks if c.num_tokens == 1]
        prefills = [c for c in chunks if c.num_tokens > 1]
        ids: list[int] = []
        sample_rows: list[int] = []
        samplers: list[Request] = []
        positions: list[torch.Tensor] = []
        slot_mapping: list[torch.Tensor] = []
        meta = AttentionMetadata(slot_mapping=torch.empty(0), page_size=self.page_size, num_decodes=len(decodes))
        dev = self.device
        if decodes:
            tables = [self.allocator.block_table(c.request.request_id) for c in decodes]
            width = max(len(t) for t in tables)
            bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=dev)
            pos_t = torch.tensor([c.request.num_computed_tokens for c in decodes], device=dev)
            meta.decode_block_tables, meta.decode_context_lens = bt, pos_t + 1
            page = bt.gather(1, (pos_t // self.page_size).unsqueeze(1)).squeeze(1)
            slot_mapping.append(page * self.page_size + pos_t % self.page_size)
            positions.append(pos_t)
            for c in decodes:
                r = c.request
                ids.extend(r.token_slice(r.num_computed_tokens, r.num_computed_tokens + 1))
        for c in prefills:
            r = c.request
            start, n = r.num_computed_tokens, c.num_tokens
            end = start + n
            table = torch.tensor(self.allocator.block_table(r.request_id), device=dev)
            kv_slots = cache_slots(table, self.page_size)[:end]
            pos_t = torch.arange(start, end, device=dev)
            mask = None if start == 0 else torch.arange(end, device=dev).unsqueeze(0) <= pos_t.unsqueeze(1)
            meta.prefills.append(PrefillSpan(q_start=len(ids), q_len=n, kv_slots=kv_slots, mask=mask))
            positions.append(pos_t)
            slot_mapping.append(kv_slots[start:end])
            ids.extend(r.token_slice(start, end))
        offset = 0
        for c in decodes + prefills:
            offset += c.num_tokens
            if c.request.num_computed_tokens + c.num_tokens == c.request.num_tokens:
                sample_rows.append(offset - 1)
                samplers.append(c.request)
        meta.slot_mapping = torch.cat(slot_mapping)
        self.attention.prepare(meta)
        return torch.tensor(ids, device=dev), torch.cat(positions), meta, sample_rows, samplers

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> StepResult:
        input_ids, positions, meta, sample_rows, samplers = self.prepare(chunks)
        hidden = self.model(input_ids, positions, self.pool.kv, meta, self.attention)
        if not samplers:
            return StepResult([], [], [])
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
        token_ids, logprobs = self.sampler(logits, samplers)
        return StepResult(samplers, token_ids, logprobs)
