"""Model runner: turns a scheduled batch into index tensors, runs the model, samples.

One forward pass covers every scheduled chunk, flattened: single-token chunks (decodes) first,
so attention can treat them as one padded group, then prefill chunks. Only the last token of a
chunk that completes its request's sequence is sent through the LM head and the sampler, plus,
for requests that ask for prompt logprobs, the prompt rows that score their next prompt token.
A speculating decode (`ScheduledChunk.draft_tokens`) is a chunk of its last token and its
proposals, causal like any prefill chunk; all its rows' logits go back for verification.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .allocator import AttentionTypeAllocator, LayerGroup
from .attention import AttentionBackend, AttentionMetadata, PrefillSpan, make_attention_backend
from .cache_pool import CachePool
from .request import Request
from .sampler import Sampler
from .scheduler import ScheduledChunk


@dataclass
class StepResult:
    """The requests that sampled this step, with their new tokens (and logprobs when asked), and the
    prompt logprobs this pass computed, per request in prompt order (to append to what it has)."""

    requests: list[Request]
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]
    prompt_logprobs: list[tuple[Request, list[dict[int, float]]]] = field(default_factory=list)
    verified: list[ScheduledChunk] = field(default_factory=list)  # speculating chunks, in row order
    verify_logits: torch.Tensor | None = None  # fp32 [sum of their num_tokens, vocab]


def chunk_token_ids(chunk: ScheduledChunk) -> list[int]:
    """The chunk's input tokens: a slice of the request's sequence, then its proposals (if any)."""
    r, start = chunk.request, chunk.request.num_computed_tokens
    return r.token_slice(start, start + chunk.num_tokens - len(chunk.draft_tokens)) + chunk.draft_tokens


def split_batch(chunks: list[ScheduledChunk]) -> tuple[list[ScheduledChunk], list[ScheduledChunk]]:
    """Decodes (single-token chunks), then prefills: the order of the pass's rows."""
    return [c for c in chunks if c.num_tokens == 1], [c for c in chunks if c.num_tokens > 1]


def verify_rows_of(chunks: list[ScheduledChunk]) -> tuple[list[ScheduledChunk], list[int]]:
    """The speculating chunks in row order and all their rows (each row's logits check one token)."""
    decodes, prefills = split_batch(chunks)
    verified, rows, offset = [], [], 0
    for c in decodes + prefills:
        if c.draft_tokens:
            verified.append(c)
            rows.extend(range(offset, offset + c.num_tokens))
        offset += c.num_tokens
    return verified, rows


class ModelRunner:
    """Runs the model over the pool. `groups` are the model's layer groups (see `cache_pool.layer_groups`),
    each `(allocator, index of the group within that allocator, layers)`: every group gets its own
    attention metadata, since each reads its own blocks (and a sliding group its own window)."""

    def __init__(self, model: nn.Module, pool: CachePool,
                 groups: list[LayerGroup], device: torch.device,
                 attention: AttentionBackend | None = None, max_logit_rows: int = 64) -> None:
        self.model = model
        self.pool = pool
        self.groups = [(allocator, index) for allocator, index, _ in groups]
        self.layer_group = [0] * model.num_layers
        self.layer_kv: list[torch.Tensor] = [pool.kv[0]] * model.num_layers
        for g, (_, _, layers) in enumerate(groups):
            for j, layer in enumerate(layers):
                self.layer_group[layer], self.layer_kv[layer] = g, pool.kv[j]
        self.device = device
        self.attention = attention or make_attention_backend(device, next(model.parameters()).dtype)
        self.sampler = Sampler()
        self.page_size = pool.page_size
        self.max_logit_rows = max_logit_rows  # LM head rows at a time for prompt logprobs (bounds the logits)

    def prepare(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor, list[AttentionMetadata],
                                                               list[int], list[Request]]:
        """Input ids, positions, attention metadata per layer, and the batch rows (and requests) that sample."""
        decodes, prefills = split_batch(chunks)
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        dev = self.device
        decode_pos = torch.tensor([c.request.num_computed_tokens for c in decodes], device=dev)
        if decodes:
            positions.append(decode_pos)
            for c in decodes:
                r = c.request
                ids.extend(r.token_slice(r.num_computed_tokens, r.num_computed_tokens + 1))
        for c in prefills:
            r = c.request
            positions.append(torch.arange(r.num_computed_tokens, r.num_computed_tokens + c.num_tokens, device=dev))
            ids.extend(chunk_token_ids(c))
        sample_rows: list[int] = []
        samplers: list[Request] = []
        offset = 0
        for c in decodes + prefills:
            offset += c.num_tokens
            if c.request.num_computed_tokens + c.num_tokens == c.request.num_tokens:
                sample_rows.append(offset - 1)
                samplers.append(c.request)
        metas = [self._group_metadata(allocator, index, decodes, prefills, decode_pos)
                 for allocator, index in self.groups]
        for meta in metas:
            self.attention.prepare(meta)
        return (torch.tensor(ids, device=dev), torch.cat(positions), [metas[g] for g in self.layer_group],
                sample_rows, samplers)

    def _group_metadata(self, allocator: AttentionTypeAllocator, group: int, decodes: list[ScheduledChunk],
                        prefills: list[ScheduledChunk], decode_pos: torch.Tensor) -> AttentionMetadata:
        """Where this group's layers write the new K/V and which slots each query reads. Full attention:
        position `p` is at slot `table[p // page] * page + p % page`. Sliding window `w`: the ring index
        `p % w` takes the place of `p`, a decode reads the whole ring (at most `w` slots), a prefill
        chunk its last `w - 1` positions, and a chunk longer than `w` writes only its last `w` tokens
        (the earlier ones would be overwritten in the same pass; they go to the reserved chunk)."""
        page, window, dev = self.page_size, allocator.window, self.device
        meta = AttentionMetadata(slot_mapping=torch.empty(0), page_size=page, num_decodes=len(decodes), window=window,
                                 decode_positions=decode_pos)
        writes: list[torch.Tensor] = []
        q_start = len(decodes)
        if decodes:
            tables = [allocator.block_table(c.request.request_id, group) for c in decodes]
            width = max(len(t) for t in tables)
            bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=dev)
            ring = decode_pos if window is None else decode_pos % window
            meta.decode_block_tables = bt
            meta.decode_context_lens = decode_pos + 1 if window is None else (decode_pos + 1).clamp(max=window)
            writes.append(bt.gather(1, (ring // page).unsqueeze(1)).squeeze(1) * page + ring % page)
        for c in prefills:
            start, n = c.request.num_computed_tokens, c.num_tokens
            end = start + n
            lo = 0 if window is None else max(0, start - window + 1)
            table = torch.tensor(allocator.block_table(c.request.request_id, group), device=dev)
            key_pos = torch.arange(lo, end, device=dev)
            ring = key_pos if window is None else key_pos % window
            slots = table[ring // page] * page + ring % page
            write = slots[start - lo:]
            if window is not None and n > window:
                write = write.clone()
                write[:n - window] = 0
            mask = None
            if start > lo or (window is not None and n > window):
                q_pos = key_pos[start - lo:].unsqueeze(1)
                mask = key_pos <= q_pos
                if window is not None:
                    mask &= key_pos > q_pos - window
            meta.prefills.append(PrefillSpan(q_start=q_start, q_len=n, ctx_slots=slots[:start - lo], mask=mask,
                                             start=start, block_table=table))
            writes.append(write)
            q_start += n
        meta.slot_mapping = torch.cat(writes)
        return meta

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> StepResult:
        input_ids, positions, metas, sample_rows, samplers = self.prepare(chunks)
        hidden = self.model(input_ids, positions, self.layer_kv, metas, self.attention)
        prompt_logprobs = self._prompt_logprobs(chunks, hidden)
        verified, verify_rows = verify_rows_of(chunks)
        if not samplers and not verified:
            return StepResult([], [], [], prompt_logprobs)
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows + verify_rows, device=self.device)])
        token_ids, logprobs = self.sampler(logits[:len(samplers)], samplers) if samplers else ([], [])
        return StepResult(samplers, token_ids, logprobs, prompt_logprobs, verified,
                          logits[len(samplers):] if verified else None)

    def _prompt_logprobs(self, chunks: list[ScheduledChunk],
                         hidden: torch.Tensor) -> list[tuple[Request, list[dict[int, float]]]]:
        """Log-softmax (fp32, raw logits) of the prompt rows of requests that ask for prompt logprobs: the
        row at position `p` scores prompt token `p + 1`, with the top-n alternatives. Positions whose
        entry is already recorded (a soft reset recomputes them) are skipped. The LM head takes at most
        `max_logit_rows` rows at a time, so a long prompt chunk never holds all its logits at once."""
        decodes, prefills = split_batch(chunks)
        rows: list[int] = []
        targets: list[int] = []
        spans: list[tuple[Request, int]] = []
        offset = 0
        for chunk in decodes + prefills:
            request, start = chunk.request, chunk.request.num_computed_tokens
            if request.needs_prompt_logprobs:
                assert request.prompt_logprobs is not None
                lo = max(start, len(request.prompt_logprobs) - 1)
                hi = min(start + chunk.num_tokens, len(request.prompt_token_ids) - 1)
                if lo < hi:
                    rows.extend(range(offset + lo - start, offset + hi - start))
                    targets.extend(request.prompt_token_ids[lo + 1:hi + 1])
                    spans.append((request, hi - lo))
            offset += chunk.num_tokens
        if not rows:
            return []
        tops = [request.params.prompt_logprobs or 0 for request, n in spans for _ in range(n)]
        row_index = torch.tensor(rows, device=self.device)
        target_ids = torch.tensor(targets, device=self.device)
        entries: list[dict[int, float]] = []
        for s in range(0, len(rows), self.max_logit_rows):
            part = slice(s, s + self.max_logit_rows)
            lp = torch.log_softmax(self.model.compute_logits(hidden[row_index[part]]), dim=-1)
            chosen = lp.gather(1, target_ids[part].unsqueeze(1)).squeeze(1).tolist()
            k = max(tops[part])
            top_vals, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
            for n, ids, vals, token, value in zip(tops[part], top_ids.tolist(), top_vals.tolist(), targets[part],
                                                  chosen):
                entry = dict(zip(ids[:n], vals[:n]))
                entry[token] = value
                entries.append(entry)
        result, at = [], 0
        for request, n in spans:
            result.append((request, entries[at:at + n]))
            at += n
        return result
