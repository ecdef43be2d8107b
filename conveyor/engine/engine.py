"""The engine loop: one `step()` = schedule, run one forward pass, append tokens, finish requests.

The batch is rebuilt every step (continuous batching): a request that finishes returns its blocks
at once and a waiting one can take its place in the next pass. Requests are validated before they
are queued; anything that goes wrong with one request inside the loop fails that request alone.
The engine is single-threaded: the manager drives it from its own thread.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from ..cache.allocator import STATE_TYPES, table_length
from ..cache.hybrid_allocator import build_allocators
from ..cache.kv_format import kv_format
from ..cache.offload import SwapPool, choose_victims
from ..cache.pool import CachePool, cpu_kv_cache_space, layer_groups, plan_num_chunks
from ..config import ConfigError, ContinuousBatchingConfig
from ..errors import DistributedError, InvalidRequestError, RequestErrorCode
from ..layers.attention import make_attention_backend
from ..layers.pooler import Pooler
from ..lora_request import LoRAConfig, LoRARequest
from ..models.base import CausalLM
from ..models.batch_invariance import make_batch_invariant
from ..pooling_params import PoolingParams
from ..reasoning_state import ReasoningMarkers
from ..request import Prompt, Request, RequestState
from ..sampling_params import SamplingParams
from ..sched.output import SchedulerOutput
from ..sched.scheduler import make_scheduler
from ..speculative import Speculator
from .async_batching import AsyncPipeline
from .deadlines import Deadlines, timeout_message
from .draft_runner import DraftProposer, draft_bytes_per_chunk
from .graph_runner import CudaGraphs, graph_memory_bytes, graph_tokens, use_cuda_graphs
from .input_processor import InputProcessor
from .lora_manager import LoRAManager, make_lora_manager
from .memory_profile import working_memory
from .model_runner import ModelRunner
from .output_processor import OutputProcessor
from .pooling import PoolingModelRunner, check_pooling_config
from .stats import EngineStats, snapshot
from .step_history import StepHistory, composition

logger = logging.getLogger("conveyor")


class Engine:
    def __init__(self, model: CausalLM, tokenizer: PreTrainedTokenizerBase,
                 config: ContinuousBatchingConfig, device: torch.device, draft_model: CausalLM | None = None,
                 pooler: Pooler | None = None, matryoshka: list[int] | None = None,
                 lora_config: LoRAConfig | None = None) -> None:
        """`draft_model`: the draft of a "draft_model" `config.speculative_config` (`draft_runner`). `pooler`: a
        pooling model's (`engine.pooling`): its requests are prefills pooled, never sampled; `matryoshka`: the
        dimensions its embeddings may be cut to ([]: any, None: not a Matryoshka model). `lora_config`:
        multi-LoRA serving on (`engine.lora_manager`)."""
        if pooler is not None:
            check_pooling_config(config)
        encoder = getattr(model, "encoder_only", False)  # (`models.encoder`: whole prompts, no KV cache)
        if encoder and (pooler is None or config.batch_invariant):
            raise ConfigError("an encoder-only model runs as a pooling model, without batch_invariant")
        self.pooler = pooler
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.device = device
        self.dtype = next(model.parameters()).dtype
        self.max_model_len = config.context_length(model.max_model_len)  # max_model_len, or the model's
        self.vocab_size = model.config.vocab_size
        self.eos_token_ids = self._eos_token_ids()
        self.lora: LoRAManager | None = (make_lora_manager(model, lora_config, config, device, pooler is not None)
                                         if lora_config is not None else None)
        # The cache layout follows the model's attention types: layer groups of equal size (a chunk is
        # a page in each layer of a group) and one allocator per type, all over one pool.
        groups = layer_groups(model.layer_types)
        self.kv_format = kv_format(config.kv_cache_dtype, self.dtype, device, model.head_dim)
        state = sorted(set(model.layer_types) & set(STATE_TYPES))
        if state and self.kv_format.name != "auto":  # (conv and SSM states are kept exact)
            raise ConfigError(f"kv_cache_dtype {config.kv_cache_dtype!r} is not supported for "
                              f"{model.config.model_type}'s {' and '.join(state)} layers (supported: auto)")
        shape = dict(page_size=config.page_size, num_layers=len(groups[0][1]),
                     num_kv_heads=model.num_kv_heads, head_dim=self.kv_format.row)
        page, windows = config.page_size, model.cache_windows
        chunks_per_request = sum(table_length(self.max_model_len, page, windows.get(t))
                                 for t, _ in groups)
        use_graphs = pooler is None and use_cuda_graphs(config, device, model.cuda_graphs)
        attention = make_attention_backend(device, self.dtype, config.attention_backend, config.kv_cache_dtype)
        # (CUDA: measured; an encoder's attention is its own, over one prompt at a time: no dense scores of the pass)
        working = working_memory(model, config, device, self.dtype, attention.dense_scores and not encoder)
        if use_graphs:  # the graphs' memory pool, besides the eager passes' working memory
            working += graph_memory_bytes(model, config, self.dtype)
        bytes_per_chunk = CachePool.bytes_per_chunk(dtype=self.kv_format.dtype, **shape)
        num_chunks = plan_num_chunks(
            num_blocks=config.num_blocks, max_memory_percent=config.max_memory_percent,
            memory_bytes=config.kv_cache_memory_bytes or (cpu_kv_cache_space() if device.type == "cpu" else None),
            bytes_per_chunk=bytes_per_chunk + (draft_bytes_per_chunk(draft_model, page) if draft_model else 0),
            activation_bytes=working,
            max_useful_chunks=config.max_requests_per_batch * chunks_per_request, device=device)
        self.pool = CachePool(num_chunks, dtype=self.kv_format.dtype, device=device, **shape)
        # Prefix caching: full attention's blocks, the snapshots of sliding windows (of a page at least) and of
        # state layers (copied by rank 0's runner alone, so not with tensor parallelism); an encoder holds
        # nothing (docs/design/prefix-caching.md).
        rings = {t for t, _ in groups if t != "full_attention"}
        self.block_sharing = (config.allow_block_sharing and not encoder
                              and all(windows[t] >= page for t in rings - set(STATE_TYPES))
                              and (not rings or config.tensor_parallel_size == 1))
        # Tails (finished requests' partial last blocks, copied by the requests that continue them): not
        # where another cache (a draft model's) or other ranks' pools would need the same copy.
        keep_tails = draft_model is None and config.tensor_parallel_size == 1
        self.allocator, runner_groups = build_allocators(self.pool, groups, windows, self.block_sharing,
                                                         model.prefix_key if model.rope_by_length else None,
                                                         keep_tails)
        # The longest sequence the whole pool holds (a sliding ring alone never runs out: then all slots).
        self.capacity_tokens = self.allocator.capacity_tokens(self.pool.num_usable * page)
        self.input_processor = InputProcessor(tokenizer, self.vocab_size, self.max_model_len, self.eos_token_ids,
                                              self.capacity_tokens, self.allocator.blocks_for_tokens,
                                              config.max_batch_pages, device, seed=config.seed,
                                              priority_scheduling=config.scheduler_type == "priority",
                                              pooler=pooler, matryoshka=matryoshka,
                                              whole_prompts=config.max_batch_tokens if encoder else None)
        spec = config.speculative_config
        if spec is not None and (spec.method == "draft_model") != (draft_model is not None):
            raise ValueError("speculative_config.method 'draft_model' needs its draft model (and only it does)")
        self.speculator = (Speculator(spec, self.max_model_len, sliding=bool(windows),
                                      rope_switch=model.rope_switch) if spec else None)
        # The draft model's runner, beside the target's: it fills the proposals the scheduler reserved.
        self.draft = DraftProposer(draft_model, self.allocator, num_chunks, page, device,
                                   config.attention_backend) if draft_model is not None else None
        self.scheduler = make_scheduler(config, self.allocator, proposer=self.speculator)
        # Prompt logprobs go through the LM head in slices as big as a sampling batch: the working memory has room.
        self.runner = (ModelRunner(model, self.pool, runner_groups, device, attention, config.max_requests_per_batch)
                       if pooler is None else PoolingModelRunner(model, self.pool, runner_groups, device, attention,
                                                                 pooler=pooler))
        self.runner.lora = self.lora
        if config.batch_invariant:
            make_batch_invariant(model, self.runner.attention, device, self.dtype)
        # Async batching (on by default where graphs are) alternates two sets of static buffers.
        use_async = config.use_async_batching
        if use_async is None:  # speculation needs each step's tokens before the next is scheduled
            use_async = use_graphs and config.speculative_config is None and pooler is None
        if config.pad_steps or (config.pad_steps is None and use_graphs):
            self.runner.enable_padding(config, buffer_sets=2 if use_async else 1)
        if use_graphs:
            self.runner.graphs = CudaGraphs(self.runner, graph_tokens(config))
        self.counters = EngineStats()  # cumulative; `stats()` adds the gauges
        history = StepHistory(config.step_history) if config.step_history else None  # the dashboard's
        self.output_processor = OutputProcessor(tokenizer, self.max_model_len, self.allocator, self.counters,
                                                self.finish_request, history, self.speculator, self.draft)
        self.pipeline = (AsyncPipeline(self.runner, self.output_processor, self.allocator, self.schedule,
                                       self.fail_unschedulable) if use_async else None)
        # Host swap pool for offloaded requests' blocks (docs/design/offloading.md); None = soft resets only.
        swap_slots = SwapPool.num_slots_for(config.cpu_offload_space, bytes_per_chunk)
        self.swap = SwapPool(swap_slots, self.pool) if swap_slots > 0 else None
        self._resume_state: dict[str, RequestState] = {}  # swapped request -> its state when swapped out
        self.requests: dict[str, Request] = {}
        self.deadlines = Deadlines()  # requests with a request_timeout
        self._constrained = 0  # requests in `requests` that run synchronously (they turn async batching off)
        kinds = ", ".join(f"{n} {t} group(s)" for t, n in Counter(t for t, _ in groups).items())
        logger.info("KV cache (%s): %d chunks of %d tokens x %d layers (%s) = %d tokens; %.0f MiB kept for working "
                    "memory; prefix caching %s; swap pool %d chunks", config.kv_cache_dtype, self.pool.num_usable, page,
                    shape["num_layers"], kinds, self.capacity_tokens, working / 2**20,
                    "on" if self.block_sharing else "off", swap_slots)

    def _eos_token_ids(self) -> tuple[int, ...]:
        ids = set()
        for source in (getattr(self.model.config, "eos_token_id", None), self.tokenizer.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(source)
        return tuple(sorted(ids))

    # -- requests in ------------------------------------------------------------------------
    def make_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                     lora_request: LoRARequest | None = None) -> Request:
        """Tokenize and validate (`InputProcessor`), and load its adapter if it has one; raises
        InvalidRequestError naming the limit (`ConfigError` for an adapter that does not fit). Safe from any
        thread."""
        request = self.input_processor.make_request(request_id, prompt, params)
        if lora_request is not None:
            if self.lora is None:
                raise InvalidRequestError(f"LoRA adapter {lora_request.lora_name!r} given, but LoRA is off: start the "
                                          "engine with enable_lora=True (--enable-lora)", param="lora_request")
            self.lora.load(lora_request)
            request.lora_request = lora_request
        return request

    def make_pooling_request(self, request_id: str, prompt: Prompt, params: PoolingParams) -> Request:
        """A pooling engine's request (`InputProcessor.make_pooling_request`); safe from any thread."""
        return self.input_processor.make_pooling_request(request_id, prompt, params)

    @property
    def reasoning_markers(self) -> ReasoningMarkers | None:
        return self.input_processor.reasoning_markers

    def constrain_reasoning(self, on: bool) -> None:
        """vLLM's `enable_in_reasoning`: output constraints apply from the first token, reasoning included,
        rather than after the reasoning, for requests made next."""
        self.input_processor.constraints_in_reasoning = on

    def set_reasoning_markers(self, markers: ReasoningMarkers | None) -> None:
        """What a thinking_token_budget counts and forces, and after which a grammar applies
        (`LLM(reasoning_parser=...)`), for requests made next."""
        self.input_processor.reasoning_markers = markers

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use",
                                      RequestErrorCode.DUPLICATE_REQUEST_ID)
        self.requests[request.request_id] = request
        self._constrained += request.runs_synchronously
        if self.lora is None or self.lora.admit(request):  # (else it waits for an adapter slot)
            self.scheduler.add_request(request)
        self.counters.prompt_tokens += len(request.prompt_token_ids)
        self.deadlines.add(request)

    def cancel_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish_request(request, RequestState.CANCELLED, "abort")
        return request

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or (self.pipeline is not None and self.pipeline.busy)

    def reset_prefix_cache(self) -> bool:
        """vLLM's: forget every cached prefix block (back to the free pool); False, changing nothing, while any
        request holds blocks."""
        if self.has_unfinished_requests():
            return False
        self.allocator.reset_prefix_cache()
        return True

    def drain(self) -> list[Request]:
        """Finish the step in flight (async batching); the requests it updated."""
        return self.pipeline.drain() if self.pipeline is not None else []

    @property
    def step_history(self) -> StepHistory | None:
        """The last steps' records (the dashboard's), None when off."""
        return self.output_processor.history

    def enable_step_history(self, size: int) -> StepHistory:
        """Switch the step records on (`size` steps) if the engine was built without them."""
        if self.output_processor.history is None:
            self.output_processor.history = StepHistory(size)
        return self.output_processor.history

    def cache_usage(self) -> dict[str, Any]:
        """The KV pool now: per attention type its layer groups and the chunks its requests hold (hybrid
        models have several types), reclaimable prefix-cached blocks, the pool's bytes and resident bytes."""
        allocators = getattr(self.allocator, "allocators", [self.allocator])
        return {"groups": [{"type": a.attention_type, "layer_groups": a.num_groups,
                            "used": a.num_held_chunks} for a in allocators],
                "cached": getattr(self.allocator, "num_cached_blocks", 0),
                "bytes": self.pool.nbytes, "resident_bytes": self.pool.resident_bytes()}

    def stats(self) -> EngineStats:
        """Counters so far plus the cache and queue gauges now (safe to read from another thread)."""
        return snapshot(self.counters, self.allocator, self.scheduler, self.swap, self.speculator, self.runner.graphs)

    # -- the loop ---------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one forward pass; return the requests that produced a token or ended (with async
        batching: submit one pass and read back the previous one), those past their deadline first."""
        overdue = self.expire_overdue()
        if not overdue:
            return self._step()
        return overdue + self._step() if self.has_unfinished_requests() else overdue

    def expire_overdue(self) -> list[Request]:
        """End the requests past their deadline (`deadlines`): finish reason "timeout", blocks back."""
        now = time.monotonic()
        overdue = self.deadlines.expired(now, self.requests)
        for request in overdue:
            self.finish_request(request, RequestState.FAILED, "timeout", timeout_message(request, now))
        return overdue

    def _step(self) -> list[Request]:
        if self.pipeline is not None:
            if not self._constrained:
                return self.pipeline.step()
            if self.pipeline.busy:  # a grammar masks (a budget forces) step N+1 after reading N's token: wait
                return self.pipeline.drain()
        started = time.monotonic()
        out = self.schedule()
        if not out.chunks:
            return self.fail_unschedulable(out)
        counts = composition(out.chunks) if self.step_history is not None else (0, 0)
        output = self.output_processor
        try:
            speculating = [c for c in out.chunks if c.draft_tokens]
            if self.draft is not None and speculating:  # the draft model's proposals for the reserved places
                self.draft.propose(speculating)
            result = self.runner.execute(out.chunks)
        except DistributedError:  # a tensor-parallel rank is gone: no step can run any more (the engine dies)
            raise
        except Exception as exc:  # a broken batch fails its own requests, not the engine
            logger.exception("forward pass failed")
            return output.fail([c.request for c in out.chunks], f"forward pass failed: {exc}")
        output.add_prompt_logprobs(result.prompt_logprobs)
        output.advance(out.chunks)
        generated = self.counters.generation_tokens
        updated = output.append_tokens(result.requests, result.token_ids, result.logprobs, time.monotonic())
        updated += output.add_pooled(result.pooled)
        if result.verified:
            updated = updated + output.verify(result.verified, result.verify_logits)
        output.record_step(started, counts, self.counters.generation_tokens - generated, result.padding_tokens)
        return updated

    def schedule(self) -> SchedulerOutput:
        """Schedule; offload the requests the scheduler preempts (a waiting request outranks them: priority
        scheduling) and stalled requests' competitors, retrying at once if nothing could run."""
        if self.model.rope_switch is not None:
            self._switch_rope(self.model.rope_switch)
        out = self._schedule_once()
        while out.preempted or out.stalled:
            if out.preempted:  # nothing was scheduled: schedule again once they made room
                self._offload(out.preempted)
            else:
                scheduled = {c.request.request_id for c in out.chunks}
                victims = choose_victims(self.scheduler.active, scheduled, out.stalled, self.allocator)
                self._offload(victims)
                if out.chunks or not victims:
                    break
            out = self._schedule_once()
        return out

    def _schedule_once(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        self.counters.prefix_cache_query_tokens += out.prefix_cache_query_tokens
        self.counters.prefix_cache_hit_tokens += out.prefix_cache_hit_tokens
        self._swap_in([c.request for c in out.chunks if c.request.request_id in self._resume_state])
        return out

    def _offload(self, victims: list[Request]) -> None:
        """Swap out the victims whose blocks fit in the free swap slots (one batched copy), soft-reset
        the rest; requeued in victim order either way. Freeing a victim only drops its references: a
        block shared with another request stays (its swapped copy includes it all the same)."""
        if self.pipeline is not None:
            self.pipeline.wait()  # the step in flight writes the victims' blocks
        to_swap: dict[str, list[int]] = {}
        room = self.swap.num_free if self.swap is not None else 0
        for victim in victims:
            blocks = self.allocator.chunks_holding(victim.request_id, victim.num_computed_tokens)  # those with K/V
            if blocks and len(blocks) <= room:
                to_swap[victim.request_id] = blocks
                room -= len(blocks)
        if to_swap:
            assert self.swap is not None
            self.swap.swap_out(list(to_swap.items()))  # copied before any block is freed
        for victim in victims:
            if victim.request_id not in to_swap:
                self._soft_reset(victim)
                continue
            self.counters.offloads += 1
            self.counters.swap_outs += 1
            self.allocator.free(victim.request_id)
            self.scheduler.requeue_front(victim)
            self._resume_state[victim.request_id] = victim.state
            victim.state = RequestState.SWAPPED

    def _swap_in(self, requests: list[Request]) -> None:
        """Swapped requests just admitted (new blocks for all their computed tokens and their next chunk):
        fill their leading blocks from the swap pool, batched, and let them go on where they stopped."""
        if not requests:
            return
        assert self.swap is not None
        entries = [(r.request_id, self.allocator.chunks_holding(r.request_id, r.num_computed_tokens)) for r in requests]
        self.swap.swap_in(entries)
        for request in requests:
            request.state = self._resume_state.pop(request.request_id)
            self.counters.swap_ins += 1

    def _switch_rope(self, switch: int) -> None:
        """Requests whose sequence just passed the model's RoPE switch length (`CausalLM.rope_switch`)
        recompute all their K/V, rotated for their whole length from now on (`Request.rope_length`)."""
        passed = [r for r in self.scheduler.active if r.rope_length <= switch < r.num_tokens]
        if passed and self.pipeline is not None:
            self.pipeline.wait()  # the step in flight writes their blocks
        for request in passed:
            request.rope_length = request.num_tokens
            self._recompute(request)

    def _soft_reset(self, request: Request) -> None:
        self.counters.soft_resets += 1
        self.counters.offloads += 1
        self._recompute(request)

    def _recompute(self, request: Request) -> None:
        """Drop the request's K/V and queue it first: its whole sequence is prefilled again."""
        self.allocator.free(request.request_id)
        self.scheduler.requeue_front(request)
        request.num_computed_tokens = 0
        request.state = RequestState.PENDING

    def fail_unschedulable(self, out: SchedulerOutput) -> list[Request]:
        """Nothing fits and nothing can be offloaded: the stalled request can never grow; fail it.
        With the cache empty and nothing active, the head of the queue can never start; fail it too."""
        failed = [r for r, _ in out.stalled]
        if not failed and not self.scheduler.active and self.scheduler.waiting:
            failed = [self.scheduler.waiting[0]]
        return self.output_processor.fail(
            failed, f"request needs more KV cache than the pool's {self.capacity_tokens} tokens")

    def finish_request(self, request: Request, state: RequestState, reason: str, error: str | None = None) -> None:
        """End a request (finished, failed or cancelled): out of the queues, its blocks back to the pool
        (after the step in flight that still holds them, with async batching)."""
        if request.is_finished:
            return
        if state is RequestState.FINISHED:
            self.allocator.keep_tail(request)  # its partial last block, for a request that continues it
        in_flight = self.pipeline is not None and self.pipeline.on_finish(request)
        self.scheduler.remove(request, free=not in_flight)
        if self.swap is not None:
            self.swap.release(request.request_id)
        self._resume_state.pop(request.request_id, None)
        request.state, request.finish_reason, request.error = state, reason, error
        request.metrics.finished_time = time.monotonic()
        if self.requests.pop(request.request_id, None) is not None:
            self._constrained -= request.runs_synchronously
        if self.lora is not None:  # its adapter slot back: requests waiting for one start
            for ready in self.lora.release(request):
                self.scheduler.add_request(ready)
        self.counters.finished_requests += 1
