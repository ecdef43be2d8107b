"""transformers baselines on the same weights and prompt token ids as Conveyor.

* `run_generate_batch`: transformers' own continuous batching, `model.generate_batch(...)`.
* `run_static_generate`: classic `model.generate` in fixed, left-padded batches.

Both decode greedily and stop at the EOS ids that Conveyor uses (or never, for ignore_eos requests).

Notes on transformers 5.24 (see transformers/generation/continuous_batching/continuous_api.py):

* Attention: the model is loaded with `attn_implementation="sdpa"` (the default). In 5.24 the
  "paged|" prefix is gone except for "paged|eager": continuous batching accepts "sdpa",
  "paged|eager" or a flash implementation, and reads the paged cache through an attention mask
  for sdpa/eager. With `auto_switch_to_flash=True` (its default) it switches to flash attention
  only when a flash kernel is installed (never on CPU), so on CPU the baseline runs paged sdpa.
  Static `generate` uses the same sdpa model.
* Cache sizing: with `num_blocks=None` transformers sizes the KV cache from free memory (60 % of
  it on CPU, and without `psutil` it falls back to NUMA totals) and allocates it up front, which
  on CPU takes tens of seconds and GiBs for a 64-prompt run. We give it `num_blocks` just large
  enough for the whole workload (no preemption, like Conveyor's pool), and by default the same
  per-pass token budget and request cap as Conveyor (`max_batch_tokens`, `max_requests_per_batch`);
  `page_size` stays transformers' default (256).
* `generate_batch` builds a fresh manager (and cache) in every call, returns
  `{request_id: GenerationOutput}` in input order, and only logs requests that failed or went
  missing, so results are looked up by the returned ids and errors are reported here.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .progress import TokenRate

logger = logging.getLogger("conveyor.bench")

HF_CB_PAGE_SIZE = 256  # transformers' ContinuousBatchingConfig default


@dataclass
class RunResult:
    """What one system produced: per-request output token ids and the timed wall-clock window."""

    token_ids: list[list[int]]
    wall_s: float
    errors: list[str | None] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


def load_hf_model(model: str | Path | None, dtype: torch.dtype, device: torch.device,
                  attn_implementation: str = "sdpa") -> tuple[torch.nn.Module, str]:
    """The transformers model for a HF directory or a GGUF file (None: the built-in GGUF).

    Returns (model, how it was loaded). GGUF files go through
    `AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)`; transformers refuses that without
    `accelerate`, in which case the model is built with `from_config` and filled with the tensors of
    Conveyor's loader (whose parity with transformers' GGUF reader is tested in tests/models/test_loader.py).
    """
    import transformers

    from ..models.loader import default_model_path, load_checkpoint

    path = default_model_path() if model is None else Path(model)
    kwargs = dict(dtype=dtype, attn_implementation=attn_implementation)
    if path.is_dir():
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs)
        how = f"from_pretrained({path})"
    else:
        try:
            # Newer transformers keep a GGUF's blocks packed unless told (its kernels then cast every matmul
            # outside fp32): the baseline is the dense model, as vLLM's and ours run it.
            dense = ({"quantization_config": transformers.GgufConfig(dequantize=True)}
                     if hasattr(transformers, "GgufConfig") else {})
            hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, **kwargs,
                                                                   **dense)
            how = f"from_pretrained({path.parent}, gguf_file={path.name!r}{', dequantized' if dense else ''})"
        except ValueError as exc:
            if "accelerate" not in str(exc):
                raise
            checkpoint = load_checkpoint(path, dtype=dtype)
            hf = transformers.AutoModelForCausalLM.from_config(checkpoint.config, **kwargs)
            missing, unexpected = hf.load_state_dict(checkpoint.state_dict, strict=False)
            tied = getattr(hf.config, "tie_word_embeddings", False)
            missing = [k for k in missing if not (tied and k == "lm_head.weight")]
            if missing or unexpected:
                raise RuntimeError(f"weights of {path} do not fit the transformers model: "
                                   f"missing {missing[:5]}, unexpected {unexpected[:5]}") from exc
            hf.tie_weights()
            how = ("from_config + conveyor.models.loader.load_checkpoint tensors (transformers' GGUF "
                   "from_pretrained needs `accelerate`, which is not installed)")
    # generate() fills every unset GenerationConfig field from model.generation_config (a checkpoint's
    # generation_config.json may carry repetition_penalty, num_beams, ...): drop those defaults so both
    # baselines decode plain greedy, like Conveyor with temperature 0.
    hf.generation_config = transformers.GenerationConfig()
    return hf.to(device).eval(), how


def _generation_config(max_new_tokens: int, eos_token_ids: Sequence[int] | None, pad_token_id: int):
    from transformers import GenerationConfig

    # eos_token_id=None would fall back to the model's EOS; -1 is transformers' "no EOS".
    eos = list(eos_token_ids) if eos_token_ids else -1
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                            pad_token_id=pad_token_id)


@contextmanager
def _quiet_no_eos_warning(active: bool):
    """transformers warns once per call that eos_token_id=-1 is not a positive id; that is intended."""
    if not active:
        yield
        return
    tf_logger = logging.getLogger("transformers")
    previous = tf_logger.level
    tf_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        tf_logger.setLevel(previous)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _eos_for(ignore_eos: Sequence[bool], eos_token_ids: Sequence[int]) -> list[int] | None:
    if all(ignore_eos):
        return None
    if any(ignore_eos):
        raise ValueError("the HF baselines need ignore_eos to be the same for every request of a workload")
    return list(eos_token_ids)


def cb_num_blocks(prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int],
                  page_size: int = HF_CB_PAGE_SIZE) -> int:
    """Blocks of `page_size` tokens that hold every request at its longest at once, plus one spare each."""
    return sum(math.ceil((len(p) + m) / page_size) + 1 for p, m in zip(prompts, max_new_tokens))


def run_generate_batch(model: torch.nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int],
                       eos_token_ids: Sequence[int], pad_token_id: int, ignore_eos: Sequence[bool], *,
                       max_batch_tokens: int | None, max_requests_per_batch: int | None,
                       progress: bool = True, warmup_prompt: Sequence[int] | None = None) -> RunResult:
    """transformers continuous batching on all prompts at once (after a small untimed warm-up call).

    With one `max_new_tokens` for all requests this is a single `model.generate_batch(...)` call.
    `generate_batch` takes only one `max_new_tokens`, so for workloads with per-request limits
    (docs32) the same thing is done through the manager API it wraps
    (`continuous_batching_context_manager` + `add_request(max_new_tokens=...)` + `get_result`).

    `wall_s` runs from the first request's creation to the end: it leaves out the manager and
    cache construction at the start of `generate_batch` (Conveyor builds its cache in `LLM()`);
    the whole call is in `extra["call_s"]`, the difference in `extra["setup_s"]`.
    """
    from transformers.generation.configuration_utils import ContinuousBatchingConfig as HFCBConfig

    eos = _eos_for(ignore_eos, eos_token_ids)
    device = next(model.parameters()).device
    uniform = len(set(max_new_tokens)) == 1

    def cb_config(ps: Sequence[Sequence[int]], ms: Sequence[int]) -> HFCBConfig:
        return HFCBConfig(num_blocks=cb_num_blocks(ps, ms), max_batch_tokens=max_batch_tokens,
                          max_requests_per_batch=max_requests_per_batch)

    token_ids: list[list[int]] = [[] for _ in prompts]
    errors: list[str | None] = ["missing from the results"] * len(prompts)
    with _quiet_no_eos_warning(eos is None):
        if warmup_prompt is not None:
            model.generate_batch(inputs=[list(warmup_prompt)], generation_config=_generation_config(4, eos, pad_token_id),
                                 continuous_batching_config=cb_config([warmup_prompt], [4]), progress_bar=False)
        config = cb_config(prompts, max_new_tokens)
        _sync(device)
        started = time.perf_counter()
        if uniform:
            results = model.generate_batch(inputs=[list(p) for p in prompts],
                                           generation_config=_generation_config(max_new_tokens[0], eos, pad_token_id),
                                           continuous_batching_config=config, progress_bar=progress)
            # request ids are req_<k> in input order (the counter starts at 0 in each new manager)
            by_index = {k: results.get(f"req_{k}") for k in range(len(prompts))}
            first_created = min((o.created_time for o in results.values()), default=started)
        else:
            by_index, first_created = _manager_generate(model, prompts, max_new_tokens, eos, pad_token_id,
                                                        config, progress)
        _sync(device)
        ended = time.perf_counter()
    for k, result in by_index.items():
        if result is None:
            continue
        token_ids[k] = list(result.generated_tokens)
        errors[k] = result.error
        if list(result.prompt_ids) != list(prompts[k]):
            errors[k] = f"result {result.request_id} belongs to another prompt"
    setup = max(first_created - started, 0.0)
    return RunResult(token_ids=token_ids, wall_s=ended - started - setup, errors=errors,
                     extra={"api": "generate_batch" if uniform else "continuous_batching_context_manager",
                            "call_s": ended - started, "setup_s": setup,
                            "attn_implementation": model.config._attn_implementation,
                            "page_size": config.page_size, "num_blocks": config.num_blocks,
                            "max_batch_tokens": config.max_batch_tokens,
                            "max_requests_per_batch": config.max_requests_per_batch})


def _manager_generate(model: torch.nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int],
                      eos: list[int] | None, pad_token_id: int, config: Any, progress: bool) -> tuple[dict, float]:
    """`generate_batch`'s own loop, with a `max_new_tokens` per request."""
    from tqdm.auto import tqdm

    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints
        hints = WorkloadHints(max_prompt_length=max(len(p) for p in prompts),
                              max_generated_length=max(max_new_tokens), num_requests=len(prompts))
    except ImportError:  # internal helper; only a sizing hint
        hints = None
    eos_arg = eos if eos is not None else -1
    order = list(range(len(prompts)))
    if config.allow_block_sharing:  # generate_batch sorts prompts this way for prefix-cache hits
        order.sort(key=lambda k: list(prompts[k]), reverse=True)
    results: dict[str, Any] = {}
    ids: dict[int, str | None] = {}
    with model.continuous_batching_context_manager(
            generation_config=_generation_config(max(max_new_tokens), eos, pad_token_id),
            continuous_batching_config=config, block=True, timeout=5, workload_hints=hints) as manager, \
            tqdm(total=len(prompts), desc="hf generate_batch", unit="req", disable=not progress) as bar:
        first_created, rate = time.perf_counter(), TokenRate()
        for k in order:
            ids[k] = manager.add_request(input_ids=list(prompts[k]), max_new_tokens=max_new_tokens[k],
                                         eos_token_id=eos_arg)
        pending = {i for i in ids.values() if i is not None}
        while pending:
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    logger.error("transformers' continuous batching thread stopped with %d requests left", len(pending))
                    break
                continue
            if result.is_finished() and result.request_id in pending:
                pending.discard(result.request_id)
                results[result.request_id] = result
                rate.add(len(result.generated_tokens), bar)
                bar.update(1)
    return {k: results.get(i) if i is not None else None for k, i in ids.items()}, first_created


def run_static_generate(model: torch.nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int],
                        eos_token_ids: Sequence[int], pad_token_id: int, ignore_eos: Sequence[bool], *,
                        batch_size: int = 16, progress: bool = True,
                        warmup_prompt: Sequence[int] | None = None) -> RunResult:
    """`model.generate` on consecutive batches of `batch_size` prompts, left-padded, greedy.

    Each batch runs to the largest `max_new_tokens` in it (or until every row hit EOS); each row is
    then cut at its own limit and after its first EOS, which is what it would have produced alone.
    """
    from tqdm.auto import tqdm

    eos = _eos_for(ignore_eos, eos_token_ids)
    eos_set = set(eos or ())
    device = next(model.parameters()).device

    def generate(batch: list[Sequence[int]], limit: int) -> torch.Tensor:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_token_id] * (width - len(p)) + list(p) for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        out = model.generate(input_ids=ids, attention_mask=mask,
                             generation_config=_generation_config(limit, eos, pad_token_id))
        return out[:, width:]

    token_ids: list[list[int]] = []
    generated_tokens = 0  # including the padding rows' wasted steps: batch rows x steps
    with _quiet_no_eos_warning(eos is None), torch.inference_mode():
        if warmup_prompt is not None:
            generate([warmup_prompt], 4)
        _sync(device)
        started = time.perf_counter()
        with tqdm(total=len(prompts), desc="hf generate", unit="req", disable=not progress) as bar:
            rate = TokenRate()
            for start in range(0, len(prompts), batch_size):
                batch = list(prompts[start:start + batch_size])
                limits = list(max_new_tokens[start:start + batch_size])
                new = generate(batch, max(limits)).tolist()
                generated_tokens += len(new) * (len(new[0]) if new else 0)
                for row, limit in zip(new, limits):
                    row = row[:limit]
                    for j, t in enumerate(row):
                        if t in eos_set:
                            row = row[:j + 1]
                            break
                    token_ids.append(row)
                    rate.add(len(row), bar)
                bar.update(len(batch))
        _sync(device)
        wall = time.perf_counter() - started
    return RunResult(token_ids=token_ids, wall_s=wall, errors=[None] * len(prompts),
                     extra={"batch_size": batch_size, "padded_steps_x_rows": generated_tokens,
                            "attn_implementation": model.config._attn_implementation})
