"""Model runner: turns a scheduled batch into index tensors, runs the model, samples.

One forward pass covers every scheduled chunk, flattened: single-token chunks (decodes) first,
so attention can treat them as one padded group, then prefill chunks. Only the last token of a
chunk that completes its request's sequence is sent through the LM head and the sampler, plus,
for requests that ask for prompt logprobs, the prompt rows that score their next prompt token.
A speculating decode (`ScheduledChunk.draft_tokens`) is a chunk of its last token and its
proposals: one decode row per token where the attention backend writes a pass's K/V before decode
rows read it (causal through their context lengths), else a causal prefill chunk; all its rows'
logits go back for verification.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ..cache.allocator import STATE_TYPES, AttentionTypeAllocator, table_length
from ..cache.hybrid_allocator import LayerGroup
from ..cache.pool import CachePool
from ..cache.transfer import to_device
from ..config import ContinuousBatchingConfig
from ..layers.attention import (AttentionBackend, AttentionMetadata, PrefillSpan, decode_block_tables,
                                make_attention_backend)
from ..layers.lora import LoRABatch
from ..layers.rotary import with_lengths
from ..layers.short_conv import ring_metadata
from ..layers.sampler import SampledBatch, Sampler
from ..request import Pooled, Request, ranked_entry
from ..sched.output import ScheduledChunk
from .step_buffers import LogitsBuffer, PaddedShape, StepBuffers
from .window_snapshots import SnapshotCopies, take_snapshots

# (request, index in its prompt_logprobs list of the first entry, the entries)
PromptLogprobs = tuple[Request, int, list[dict[int, float]]]


@dataclass
class PooledStep:
    """A pooling pass's results (`engine.pooling`): the prompts it completed with their outputs, and the state
    the others carry on with."""

    results: list[tuple[Request, Pooled]] = field(default_factory=list)
    states: list[tuple[Request, torch.Tensor]] = field(default_factory=list)


@dataclass
class StepResult:
    """The requests that sampled this step, with their new tokens (and logprobs when asked), and the
    prompt logprobs this pass computed, per request in prompt order (to append to what it has); a pooling
    pass's results instead of samples."""

    requests: list[Request]
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    padding_tokens: int = 0  # rows a padded shape added to the pass
    verified: list[ScheduledChunk] = field(default_factory=list)  # speculating chunks, in row order
    verify_logits: torch.Tensor | None = None  # fp32 [sum of their num_tokens, vocab]
    pooled: PooledStep | None = None


def chunk_token_ids(chunk: ScheduledChunk) -> list[int]:
    """The chunk's input tokens: a slice of the request's sequence, then its proposals (if any)."""
    r, start = chunk.request, chunk.request.num_computed_tokens
    return r.token_slice(start, start + chunk.num_tokens - len(chunk.draft_tokens)) + chunk.draft_tokens


@dataclass
class LaunchedStep:
    """A step queued on the device: its samples (still there, their host copy under way) and its prompt
    logprobs; `result` waits for the copy."""

    samplers: list[Request]
    batch: SampledBatch | None
    prompt_logprobs: list[PromptLogprobs]
    padding_tokens: int = 0
    verified: list[ScheduledChunk] = field(default_factory=list)
    verify_logits: torch.Tensor | None = None

    @property
    def tokens(self) -> torch.Tensor | None:
        """The sampled tokens on the device (for the next step's inputs, without a host round trip)."""
        return None if self.batch is None else self.batch.tokens

    def result(self) -> StepResult:
        token_ids, logprobs = self.batch.to_host() if self.batch is not None else ([], [])
        return StepResult(self.samplers, token_ids, logprobs, self.prompt_logprobs, self.padding_tokens,
                          self.verified, self.verify_logits)


@dataclass
class PromptLogprobPlan:
    """Rows of the pass whose log-softmax scores a prompt token: `targets[i]` for `rows[i]`; `spans`
    are (request, first entry index, entry count) in row order."""

    rows: list[int]
    targets: list[int]
    spans: list[tuple[Request, int, int]]


@dataclass
class PreparedStep:
    """A step ready to run: inputs, per-group metadata, sample rows (padded ones after the real ones),
    the requests that sample, and (padded steps) the shape and buffer set. `sampling_views` stand in
    for `samplers` in the sampler when async batching snapshots their history."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    metas: list[AttentionMetadata]
    sample_rows: torch.Tensor
    samplers: list[Request]
    prompt_plan: PromptLogprobPlan | None
    shape: PaddedShape | None = None
    buffer_set: int = 0
    sampling_views: list[Any] | None = None
    verified: list[ScheduledChunk] = field(default_factory=list)  # speculating chunks, in row order
    verify_rows: torch.Tensor | None = None  # all their rows (each row's logits check one token)
    pad_at: int = 0  # padded steps: rows from `pad_at` on moved down by `num_pad`
    num_pad: int = 0
    lora: LoRABatch | None = None  # the rows that run with an adapter (`engine.lora_manager`)
    snapshots: SnapshotCopies | None = None  # copies into sliding-window snapshots (`window_snapshots`)

    def row(self, unpadded_row: int) -> int:
        return unpadded_row if unpadded_row < self.pad_at else unpadded_row + self.num_pad


def split_batch(chunks: list[ScheduledChunk], drafts_decode: bool = False) -> tuple[list[ScheduledChunk],
                                                                                    list[ScheduledChunk]]:
    """Decodes (single-token chunks; with `drafts_decode` speculating chunks too, one decode row per
    token), then prefills: the order of the pass's rows."""
    decodes: list[ScheduledChunk] = []
    prefills: list[ScheduledChunk] = []
    for c in chunks:
        (decodes if c.num_tokens == 1 or (drafts_decode and c.draft_tokens) else prefills).append(c)
    return decodes, prefills


def verify_rows_of(chunks: list[ScheduledChunk], drafts_decode: bool = False) -> tuple[list[ScheduledChunk],
                                                                                      list[int]]:
    """The speculating chunks in row order and all their rows (each row's logits check one token)."""
    decodes, prefills = split_batch(chunks, drafts_decode)
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
        self.rope_by_length = bool(getattr(model, "rope_by_length", False))  # LongRoPE, dynamic NTK (`layers.rotary`)
        self.attention = attention or make_attention_backend(device, next(model.parameters()).dtype)
        # A speculating chunk runs as decode rows (the decode stack takes them) where decode attention
        # reads the pass's own K/V from the cache: row j then sees rows 0..j-1 through its context length.
        # (Not with sliding windows: a later row's ring slot can still be in an earlier row's window.)
        self.drafts_decode = self.attention.decode_reads_written and all(a.window is None for a, _ in self.groups)
        self.sampler = Sampler()
        self.logits_buffer = LogitsBuffer(getattr(model, "logits_out_width", None) if device.type == "cpu" else None)
        self.page_size = pool.page_size
        self.max_logit_rows = max_logit_rows  # LM head rows at a time for prompt logprobs (bounds the logits)
        self.buffers: list[StepBuffers] = []  # static step buffers, when steps are padded
        self.graphs: Any = None  # a graph_runner.CudaGraphs replaying padded steps, when on
        self.lora: Any = None  # an engine.lora_manager.LoRAManager, with LoRA on

    def enable_padding(self, config: ContinuousBatchingConfig, buffer_sets: int = 1) -> None:
        """Pad every step into static buffers (`step_buffers`); `buffer_sets` alternate (async batching
        prepares one while the previous step still reads the other)."""
        context = config.max_model_len or self.model.max_model_len
        width = max(table_length(context, self.page_size, allocator.window) for allocator, _ in self.groups)
        self.buffers = [StepBuffers(len(self.groups), config.max_batch_tokens, config.max_requests_per_batch, width,
                                    config.max_requests_per_batch, config.q_padding_interval_size,
                                    max(1, config.kv_padding_interval_size // self.page_size), self.device)
                        for _ in range(buffer_sets)]

    def prepare(self, chunks: list[ScheduledChunk], buffer_set: int = 0) -> PreparedStep:
        """Input ids, positions, attention metadata per layer group, and the batch rows (and requests)
        that sample; padded into static buffer set `buffer_set` when padding is on."""
        decodes, prefills = split_batch(chunks, self.drafts_decode)
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        dev = self.device
        decode_pos = torch.tensor([c.request.num_computed_tokens + j for c in decodes for j in range(c.num_tokens)],
                                  device=dev)
        if decodes:
            positions.append(decode_pos)
            for c in decodes:
                ids.extend(chunk_token_ids(c))
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
        snapshots = SnapshotCopies()
        taken = take_snapshots([a for a, _ in self.groups], decodes + prefills, snapshots)
        # (a state group's layers index their slots themselves: `layers.short_conv`, `layers.mamba2`)
        metas = [ring_metadata(allocator, index, decodes, prefills, decode_pos, self.page_size)
                 if allocator.attention_type in STATE_TYPES else
                 self._group_metadata(allocator, index, decodes, prefills, decode_pos, taken.get(allocator, {}),
                                      snapshots)
                 for allocator, index in self.groups]
        input_ids, pos = to_device(ids, torch.long, dev), torch.cat(positions)
        if self.rope_by_length:  # each token's RoPE length with its position: max(request.rope_length, position + 1)
            floors = [c.request.rope_length for c in decodes + prefills for _ in range(c.num_tokens)]
            pos = with_lengths(pos, torch.maximum(pos + 1, to_device(floors, torch.long, dev)))
        plan = self._prompt_logprob_plan(decodes + prefills)
        if self.buffers:
            step = self.buffers[buffer_set].load(input_ids, pos, metas, sample_rows)
            plan = plan and replace(plan, rows=[step.row(r) for r in plan.rows])
            prepared = PreparedStep(step.input_ids, step.positions, step.metas, step.sample_rows, samplers, plan,
                                    step.shape, buffer_set, pad_at=step.pad_at, num_pad=step.num_pad)
        else:
            prepared = PreparedStep(input_ids, pos, metas, to_device(sample_rows, torch.long, dev), samplers,
                                    plan)
        if snapshots.before or snapshots.after:
            prepared.snapshots = snapshots
        verified, verify_rows = verify_rows_of(chunks, self.drafts_decode)
        if verified:
            prepared.verified = verified
            prepared.verify_rows = to_device([prepared.row(r) for r in verify_rows], torch.long, dev)
        if self.lora is not None:
            prepared.lora = self.lora.step_batch(decodes + prefills, prepared.pad_at, prepared.num_pad)
        for (allocator, _), meta in zip(self.groups, prepared.metas):
            if allocator.attention_type not in STATE_TYPES:
                self.attention.prepare(meta)
        return prepared

    def _group_metadata(self, allocator: AttentionTypeAllocator, group: int, decodes: list[ScheduledChunk],
                        prefills: list[ScheduledChunk], decode_pos: torch.Tensor,
                        taken: dict[str, dict[int, int]] | None = None,
                        snapshots: SnapshotCopies | None = None) -> AttentionMetadata:
        """Where this group's layers write the new K/V and which slots each query reads. Full attention:
        position `p` is at slot `table[p // page] * page + p % page`. Sliding window `w`: the ring index
        `p % w` takes the place of `p`, a decode reads the whole ring (at most `w` slots), a prefill
        chunk its last `w - 1` positions, and a chunk longer than `w` writes only its last `w` tokens
        (the earlier ones would be overwritten in the same pass; they go to the reserved chunk, or to
        the snapshots of the blocks they complete: `taken`, planned into `snapshots`)."""
        page, window, dev = self.page_size, allocator.window, self.device
        taken, snapshots = taken or {}, snapshots or SnapshotCopies()
        rows = len(decode_pos)
        meta = AttentionMetadata(slot_mapping=torch.empty(0), page_size=page, num_decodes=rows, window=window,
                                 decode_positions=decode_pos, decode_shared_rows=rows > len(decodes))
        writes: list[torch.Tensor] = []
        q_start = rows
        if decodes:
            bt = decode_block_tables(allocator, group, decodes, dev)
            ring = decode_pos if window is None else decode_pos % window
            meta.decode_block_tables = bt
            meta.decode_context_lens = decode_pos + 1 if window is None else (decode_pos + 1).clamp(max=window)
            writes.append(bt.gather(1, (ring // page).unsqueeze(1)).squeeze(1) * page + ring % page)
            for c in decodes:
                if c.request.request_id in taken:
                    p = c.request.num_computed_tokens
                    snapshots.add(allocator, group, c.request.request_id, p, p + 1, taken[c.request.request_id])
        for c in prefills:
            start, n = c.request.num_computed_tokens, c.num_tokens
            end = start + n
            lo = 0 if window is None else max(0, start - window + 1)
            table = to_device(allocator.block_table(c.request.request_id, group), torch.long, dev)
            key_pos = torch.arange(lo, end, device=dev)
            ring = key_pos if window is None else key_pos % window
            slots = table[ring // page] * page + ring % page
            write = slots[start - lo:]
            if window is not None and n > window:
                write = write.clone()
                write[:n - window] = 0
            if c.request.request_id in taken:
                direct = snapshots.add(allocator, group, c.request.request_id, start, end, taken[c.request.request_id])
                if direct is not None:
                    write[direct[0].to(dev) - start] = direct[1].to(dev)
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
        return self.run(self.prepare(chunks))

    @torch.inference_mode()
    def run(self, step: PreparedStep) -> StepResult:
        """The forward pass of a prepared step, its prompt logprobs and its samples."""
        return self.launch(step).result()

    @torch.inference_mode()
    def launch(self, step: PreparedStep) -> LaunchedStep:
        """Queue the step's forward pass and sampling, and the copy of its samples to the host; waits
        for the device only for prompt logprobs (their entries are host dicts)."""
        tokens = None
        if self.graphs is not None and step.lora is None and self.graphs.takes(step):  # (adapters run eagerly)
            self._copy_snapshots(step, before=True)
            hidden, logits = None, self.graphs.replay(step)
            self._copy_snapshots(step, before=False)
        else:
            if self.graphs is not None:
                self.graphs.eager_steps += 1
            rows = step.sample_rows[:len(step.samplers)] if step.verified else step.sample_rows
            if step.verify_rows is not None:  # one LM head pass for the sampled and the verified rows
                rows = torch.cat([rows, step.verify_rows])
            # Prompt logprobs read any row; else the pass computes the read rows' last layer alone.
            hidden = self.forward(step) if step.prompt_plan else self.forward(step, rows)
            picked = hidden.index_select(0, rows) if step.prompt_plan else hidden  # the rows' states, in order
            if step.verify_rows is None and step.samplers and self.sampler.plain_greedy(step.sampling_views
                                                                                          or step.samplers):
                # the LM head fused with the argmax where it can (None elsewhere): no logits written
                tokens = self.model.greedy_tokens(picked[:len(step.samplers)])
            logits = None
            if tokens is None and rows.numel():
                # the reused buffer, except for verified rows' logits, which outlive the step
                out = None if step.verified else self.logits_buffer.take(rows.numel())
                logits = self.model.compute_logits(picked, out)
        prompt_logprobs = self._prompt_logprobs(step.prompt_plan, hidden) if step.prompt_plan else []
        verify_logits = logits[len(step.samplers):] if step.verified else None
        batch = None
        if tokens is not None:
            batch = SampledBatch(tokens, [], []).start_copy()
        elif step.samplers:
            batch = self.sampler.sample(logits[:len(step.samplers)], step.sampling_views or step.samplers).start_copy()
        return LaunchedStep(step.samplers, batch, prompt_logprobs, step.num_pad, step.verified, verify_logits)

    def forward(self, step: PreparedStep, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states of every row of the step (each layer with its group's metadata), or of `rows` only
        (in their order), its adapter rows through their adapters."""
        state = getattr(self.model, "lora_state", None)
        if state is not None:
            state.batch = step.lora
        try:
            self._copy_snapshots(step, before=True)
            hidden = self.model(step.input_ids, step.positions, self.layer_kv,
                                [step.metas[g] for g in self.layer_group], self.attention, rows)
            self._copy_snapshots(step, before=False)
            return hidden
        finally:
            if state is not None:
                state.batch = None

    def _copy_snapshots(self, step: PreparedStep, before: bool) -> None:
        if step.snapshots is not None:
            step.snapshots.run(self.pool, before)

    def _prompt_logprob_plan(self, chunks: list[ScheduledChunk]) -> PromptLogprobPlan | None:
        """Which rows score which prompt tokens, for requests that ask for prompt logprobs: the row at
        position `p` scores prompt token `p + 1`. Positions whose entry is already recorded (a soft reset
        recomputes them) are skipped."""
        plan = PromptLogprobPlan([], [], [])
        offset = 0
        for chunk in chunks:
            request, start = chunk.request, chunk.request.num_computed_tokens
            if request.needs_prompt_logprobs:
                assert request.prompt_logprobs is not None
                lo = max(start, len(request.prompt_logprobs) - 1)
                hi = min(start + chunk.num_tokens, len(request.prompt_token_ids) - 1)
                if lo < hi:
                    plan.rows.extend(range(offset + lo - start, offset + hi - start))
                    plan.targets.extend(request.prompt_token_ids[lo + 1:hi + 1])
                    plan.spans.append((request, lo + 1, hi - lo))
            offset += chunk.num_tokens
        return plan if plan.rows else None

    def _prompt_logprobs(self, plan: PromptLogprobPlan, hidden: torch.Tensor) -> list[PromptLogprobs]:
        """Log-softmax (fp32, raw logits) of the planned rows, with the top-n alternatives. The LM head
        takes at most `max_logit_rows` rows at a time, so a long prompt chunk never holds all its logits."""
        rows, targets = plan.rows, plan.targets
        tops = [request.params.prompt_logprobs or 0 for request, _, n in plan.spans for _ in range(n)]
        row_index = torch.tensor(rows, device=self.device)
        target_ids = torch.tensor(targets, device=self.device)
        entries: list[dict[int, float]] = []
        for s in range(0, len(rows), self.max_logit_rows):
            part = slice(s, s + self.max_logit_rows)
            lp = torch.log_softmax(self.model.compute_logits(hidden[row_index[part]]), dim=-1)
            chosen = lp.gather(1, target_ids[part].unsqueeze(1))
            ranks = (lp >= chosen).sum(dim=1).tolist()
            k = max(tops[part])
            top_vals, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
            for n, ids, vals, token, value, rank in zip(tops[part], top_ids.tolist(), top_vals.tolist(),
                                                        targets[part], chosen.squeeze(1).tolist(), ranks):
                entries.append(ranked_entry(ids[:n], vals[:n], token, value, rank))
        result, at = [], 0
        for request, first, n in plan.spans:
            result.append((request, first, entries[at:at + n]))
            at += n
        return result
