"""Conveyor's real decode step, timed and split (measurement 3 of tools/roofline/__init__.py): prefilled
requests, then `Engine.step()` with its runner's and model's methods wrapped for the duration."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from conveyor import ContinuousBatchingConfig, SamplingParams
from conveyor.request import RequestState

from .expert_load import ExpertLoad, sparse_blocks
from .measure import DenseBench, median, sync

class _Probe:
    """Wraps methods on instances (not classes) to accumulate their time within one engine step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.time: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._undo: list[Callable[[], None]] = []

    def wrap(self, obj: Any, attr: str, name: str) -> None:
        had = attr in vars(obj)
        previous = vars(obj).get(attr)
        original = getattr(obj, attr)
        self.time[name], self.calls[name] = 0.0, 0

        def timed(*args: Any, **kwargs: Any) -> Any:
            sync(self.device)
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                sync(self.device)
                self.time[name] += time.perf_counter() - started
                self.calls[name] += 1

        object.__setattr__(obj, attr, timed)

        def undo() -> None:
            if had:
                object.__setattr__(obj, attr, previous)
            else:
                object.__delattr__(obj, attr)

        self._undo.append(undo)

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()


@contextlib.contextmanager
def instrument(engine: Any) -> Iterator[_Probe]:
    """Time `runner.execute`, `runner.prepare`, `model.forward`, `model.compute_logits` and `runner.sampler.sample`,
    `model.greedy_tokens` (the LM head fused with greedy sampling, which stands for both when it runs), and a
    mixture-of-experts model's sparse blocks (all layers' under "moe")."""
    runner = engine.runner
    probe = _Probe(engine.device)
    try:
        probe.wrap(runner, "execute", "execute")
        probe.wrap(runner, "prepare", "prepare")
        probe.wrap(runner.model, "forward", "forward")
        probe.wrap(runner.model, "compute_logits", "lm_head")
        probe.wrap(runner.model, "greedy_tokens", "fused_head")
        probe.wrap(runner.sampler, "sample", "sampling")
        for block in sparse_blocks(runner.model):  # mixture-of-experts blocks, summed over the layers
            probe.wrap(block, "forward", "moe")
        yield probe
    finally:
        probe.restore()


def random_prompts(batch: int, length: int, vocab_size: int, exclude: list[int], seed: int = 0) -> list[list[int]]:
    """Random token ids, special tokens left out."""
    excluded = set(exclude)
    allowed = torch.tensor([t for t in range(vocab_size) if t not in excluded])
    g = torch.Generator().manual_seed(seed)
    return allowed[torch.randint(0, len(allowed), (batch, length), generator=g)].tolist()


def step_config(batch: int, context: int, new_tokens: int, *, page_size: int = 16,
                max_batch_tokens: int | None = None) -> Any:
    """A config whose pool holds every request to its end; all prompts prefill in one pass by default
    (so every sequence has exactly `context` tokens when decoding starts)."""
    blocks = batch * -(-(context + new_tokens) // page_size)
    return ContinuousBatchingConfig(page_size=page_size, num_blocks=math.ceil(blocks / 0.8) + 4,
                                    max_requests_per_batch=max(64, batch),
                                    max_batch_tokens=max_batch_tokens or max(512, batch * context))


def measure_step(llm: Any, batch: int, context: int, *, steps: int = 10, warmup_steps: int = 2,
                 seed: int = 0, dense: DenseBench | None = None) -> dict[str, Any]:
    """Prefill `batch` random `context`-token prompts, then time `steps` decode steps (after `warmup_steps`).

    With `dense`, one dense-ceiling step runs (and is recorded) right after each engine step, so the
    two are measured interleaved, under the same conditions, rather than minutes apart.
    """
    engine = llm.engine
    if engine.has_unfinished_requests():
        raise RuntimeError("the engine already has requests; the step benchmark needs an idle engine")
    if batch > engine.config.max_requests_per_batch:
        raise ValueError(f"batch {batch} exceeds max_requests_per_batch={engine.config.max_requests_per_batch}")
    new_tokens = warmup_steps + steps + 4
    special = list(getattr(llm.get_tokenizer(), "all_special_ids", []) or []) + list(engine.eos_token_ids)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    requests = [engine.make_request(f"roofline-step-{i}", prompt, params)
                for i, prompt in enumerate(random_prompts(batch, context, engine.vocab_size, special, seed))]
    free_before = engine.allocator.num_free_blocks
    device = engine.device
    try:
        for r in requests:
            engine.add_request(r)
        started = time.perf_counter()
        prefill_steps = 0
        while not all(r.state is RequestState.DECODING for r in requests):
            broken = [r for r in requests if r.is_finished]
            if broken or prefill_steps > batch * context:
                raise RuntimeError(f"prefill did not complete: {broken[0].request_id} ended "
                                   f"({broken[0].finish_reason}: {broken[0].error})" if broken else
                                   "prefill did not complete")
            engine.step()
            prefill_steps += 1
        sync(device)
        prefill_s = time.perf_counter() - started
        start_context = sorted(r.num_tokens - 1 for r in requests)  # tokens in cache before the first decode

        rows: list[dict[str, float]] = []
        contexts: list[int] = []
        load = ExpertLoad(engine.runner.model)
        for i in range(warmup_steps + steps):
            in_cache = [r.num_tokens - 1 for r in requests]
            with instrument(engine) as probe, load if i >= warmup_steps else contextlib.nullcontext():
                sync(device)
                t0 = time.perf_counter()
                stepped = engine.step()
                sync(device)
                total = time.perf_counter() - t0
            if len(stepped) != batch or any(r.is_finished for r in requests):
                raise RuntimeError(f"decode step {i} advanced {len(stepped)} of {batch} requests")
            calls = probe.calls
            fused = calls.get("sampling", 0) == 0 and calls.get("fused_head", 0) == 1
            if (any(calls.get(k, 0) != 1 for k in ("execute", "prepare", "forward"))
                    or not fused and (calls.get("lm_head", 0) != 1 or calls.get("sampling", 0) != 1)):
                raise RuntimeError(f"the step timing hooks fired {calls} times (expected once each, or the fused "
                                   "head instead of the head and the sampler): ModelRunner or Engine changed shape; "
                                   "update tools/roofline/step.py")
            if dense is not None:  # right after, so both see the same machine (threads, contention, caches)
                dense.once(record=i >= warmup_steps)
            if i < warmup_steps:
                continue
            t = dict(probe.time)
            head = t.get("lm_head", 0.0) + t.get("fused_head", 0.0)
            rows.append({"step_s": total, "forward_s": t["forward"], "prepare_s": t["prepare"],
                         "lm_head_sampling_s": t["execute"] - t["prepare"] - t["forward"],
                         "lm_head_s": head, "forward_lm_head_s": t["forward"] + head,
                         "sampling_s": t.get("sampling", 0.0), "fused_head": float(fused),
                         "rest_s": total - t["execute"], "outside_forward_s": total - t["forward"],
                         "moe_s": t.get("moe", 0.0)})
            contexts += [min(in_cache), max(in_cache)]
    finally:
        for r in requests:
            engine.cancel_request(r.request_id)
    if engine.allocator.num_free_blocks != free_before:
        raise RuntimeError("the step benchmark leaked KV blocks")
    medians = {key: median([row[key] for row in rows]) for key in rows[0]}
    return {"batch": batch, "context": context, "steps": steps, "warmup_steps": warmup_steps,
            "prefill_steps": prefill_steps, "prefill_s": prefill_s,
            "start_context": [start_context[0], start_context[-1]],
            "timed_context": [min(contexts), max(contexts)],
            **medians,
            "outside_forward_fraction": median([r["outside_forward_s"] / r["step_s"] for r in rows]),
            "host_fraction": median([(r["step_s"] - r["forward_s"] - r["lm_head_s"]) / r["step_s"] for r in rows]),
            "tok_per_s": batch / medians["step_s"],
            "step_samples_s": [r["step_s"] for r in rows],
            **({"moe_fraction": median([r["moe_s"] / r["step_s"] for r in rows]), "expert_load": load.summary()}
               if load.blocks else {})}
