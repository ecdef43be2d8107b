"""`ContinuousBatchingConfig`: every knob of the engine, validated once at start (docs/configuration.md).

It sits above the layers, the scheduler and speculative decoding, so that it validates against the
tables those keep (`layers.attention.ATTENTION_BACKENDS`, `sched.scheduler.SCHEDULERS`, and through
`SpeculativeConfig` the quantization registry); they read the fields they need without importing it."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import Any

from .cache.kv_format import KV_CACHE_DTYPES
from .errors import ConfigError
from .layers.attention import ATTENTION_BACKENDS
from .sched.scheduler import SCHEDULERS
from .speculative.config import SpeculativeConfig

__all__ = ["ConfigError", "ContinuousBatchingConfig"]


@dataclass
class ContinuousBatchingConfig:
    """Engine configuration. Field names follow transformers' continuous batching.

    page_size: tokens of K/V per page (one layer); a block is one page per layer.
    num_blocks: cache capacity in pool chunks (blocks, for a model with one attention type; see
        docs/design/kv-cache.md); None sizes the pool from free memory.
    max_batch_tokens: token budget of one forward pass (query tokens of all requests).
    max_memory_percent: share of free memory the KV pool may take when `num_blocks` is None;
        None = 0.9 on CUDA, 0.5 on CPU (which shares its memory with everything else).
    kv_cache_memory_bytes: the KV pool's size in bytes (vLLM's name), in place of `max_memory_percent`
        (with `num_blocks`, an error); None = `max_memory_percent`, or on CPU vLLM's VLLM_CPU_KVCACHE_SPACE
        (GiB) when it is set above 0.
    max_requests_per_batch: most requests in one forward pass (bounds the logits tensor).
    max_batch_pages: cache budget, the most KV pages read in one pass; None = the pool's size.
    scheduler_type: "fifo" (decodes first), "prefill_first", or "priority" (each request's
        `SamplingParams.priority`, lower first, preempting lower-ranked running requests: vLLM's
        `scheduling_policy="priority"`, which sets it).
    safety_margin: below this free-cache fraction, new prefills wait; None = scheduler default.
    priority_aging: with "priority", the seconds of waiting that count as one priority level, so that
        a waiting request is overtaken only by those that arrive within (difference in priority) x this
        many seconds after it (starvation's bound); None = strict priority, no bound.
    allow_block_sharing: prefix caching across requests (docs/design/prefix-caching.md).
    cpu_offload_space: GiB of host memory for swapping out KV blocks of preempted requests.
    q_padding_interval_size / kv_padding_interval_size: shape padding for CUDA graphs.
    use_cuda_graph: replay CUDA graphs of padded decode steps; None = on for CUDA, off elsewhere.
    use_async_batching: prepare step N+1 while step N runs; None = on for CUDA with graphs, off on CPU.
    pad_steps: pad every step into static buffers; None = exactly when CUDA graphs are on. True on CPU
        pads without capturing (for tests: padded steps must give the unpadded outputs).
    attention_backend: "auto" (Triton on CUDA, the native kernels on CPU for fp32/bf16, else PyTorch),
        "torch", "cpu" (native) or "triton" (CUDA; on CPU only with TRITON_INTERPRET=1, for tests).
    kv_cache_dtype: how K/V rows are stored (vLLM's name): "auto" (the model's dtype), "int8" (CPU: a
        scale per token and KV head; the same memory holds about twice the tokens), "fp8" (= "fp8_e4m3")
        or "fp8_e5m2" (CUDA's Triton kernel, or the PyTorch backend). `cache/kv_format.py`.
    speculative_config: vLLM's speculative decoding options (a dict or `SpeculativeConfig`), None = off.
    step_history: keep the last N steps' records (batch composition, duration) for the dashboard;
        0 = off (the server turns it on).
    max_model_len: the context length served (prompt + generated tokens of one request), at most the
        model's own; None = the model's (vLLM's name and meaning).
    seed: vLLM's engine seed: a request without its own seed samples from a generator seeded from this
        seed and its arrival number, so a run with the same requests in the same order repeats
        exactly; None = unseeded requests draw from torch's global generator.
    tensor_parallel_size: ranks the model is split over (vLLM's name; `distributed/`): 1 = one process.
        Over 1, CUDA graphs are off (None resolves to False); async batching, a draft model and a swap pool
        are errors.
    batch_invariant: guarantee that a request's tokens and logprobs do not depend on what it is batched
        with or how its prompt is chunked (`models/batch_invariance.py`). On CPU in bf16 (or with quantized
        weights) they do not anyway, except on AMX CPUs; True refuses an engine that cannot keep it (dense
        fp32, CUDA, the PyTorch attention backend) and keeps AMX CPUs' bf16 inputs on the native kernel at
        every row count. None = vLLM's switch, the environment's VLLM_BATCH_INVARIANT=1 (False otherwise).
    """

    page_size: int = 16
    num_blocks: int | None = None
    max_batch_tokens: int = 512
    max_memory_percent: float | None = None
    kv_cache_memory_bytes: int | None = None
    max_requests_per_batch: int = 64
    max_batch_pages: int | None = None
    scheduler_type: str = "fifo"
    safety_margin: float | None = None
    priority_aging: float | None = 60.0
    allow_block_sharing: bool = True
    cpu_offload_space: float = 0.0
    q_padding_interval_size: int = 16
    kv_padding_interval_size: int = 256
    use_cuda_graph: bool | None = None
    use_async_batching: bool | None = None
    pad_steps: bool | None = None
    attention_backend: str = "auto"
    kv_cache_dtype: str = "auto"
    speculative_config: Any = None
    step_history: int = 0
    max_model_len: int | None = None
    seed: int | None = None
    tensor_parallel_size: int = 1
    batch_invariant: bool | None = None

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")

        for name in ("page_size", "max_batch_tokens", "max_requests_per_batch",
                     "q_padding_interval_size", "kv_padding_interval_size", "tensor_parallel_size"):
            positive(name)
        if self.num_blocks is not None:
            positive("num_blocks")
        for name in ("max_batch_pages", "max_model_len", "kv_cache_memory_bytes"):
            if getattr(self, name) is not None:
                positive(name)
        if self.num_blocks is not None and self.kv_cache_memory_bytes is not None:
            raise ConfigError("num_blocks and kv_cache_memory_bytes both size the KV pool: give one")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**64):
            raise ConfigError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        if self.max_memory_percent is not None and not 0.0 < self.max_memory_percent <= 1.0:
            raise ConfigError(f"max_memory_percent must be in (0, 1], got {self.max_memory_percent}")
        if self.scheduler_type not in SCHEDULERS:
            raise ConfigError(f"scheduler_type must be one of {tuple(SCHEDULERS)}, got {self.scheduler_type!r}")
        if self.safety_margin is None:
            self.safety_margin = SCHEDULERS[self.scheduler_type].default_safety_margin
        if not 0.0 <= self.safety_margin < 1.0:
            raise ConfigError(f"safety_margin must be in [0, 1), got {self.safety_margin}")
        if self.priority_aging is not None and not 0 < self.priority_aging < float("inf"):
            raise ConfigError(f"priority_aging must be a number of seconds > 0 (None: strict priority), got "
                              f"{self.priority_aging!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if not isinstance(self.step_history, int) or self.step_history < 0:
            raise ConfigError(f"step_history must be an integer >= 0 (0 = off), got {self.step_history!r}")
        if self.cpu_offload_space < 0:
            raise ConfigError(f"cpu_offload_space must be >= 0 GiB, got {self.cpu_offload_space}")
        if self.batch_invariant is None:
            self.batch_invariant = os.environ.get("VLLM_BATCH_INVARIANT", "0").strip() == "1"
        if not isinstance(self.batch_invariant, bool):
            raise ConfigError(f"batch_invariant must be True, False or None, got {self.batch_invariant!r}")
        self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        if self.speculative_config is not None and self.use_async_batching:
            raise ConfigError("speculative_config does not combine with use_async_batching=True (a step's "
                              "proposals need the previous step's tokens); set use_async_batching to False or None")
        if self.tensor_parallel_size > 1:
            self.check_tensor_parallel()

    def check_tensor_parallel(self) -> None:
        """What runs with tensor parallelism: the eager step (rank 0 tells the other ranks each call of the
        model, which a captured graph cannot), no async pipeline, no draft model (it would run unsharded),
        no swap pool (it copies rank 0's blocks only; preempted requests take the soft-reset path)."""
        tp = self.tensor_parallel_size
        if self.use_cuda_graph:
            raise ConfigError(f"use_cuda_graph=True does not combine with tensor_parallel_size={tp} (steps run "
                              "eagerly); leave it None or set False")
        self.use_cuda_graph = False
        if self.use_async_batching:
            raise ConfigError(f"use_async_batching=True does not combine with tensor_parallel_size={tp}; leave it "
                              "None or set False")
        if self.speculative_config is not None and self.speculative_config.method == "draft_model":
            raise ConfigError(f"a draft model does not combine with tensor_parallel_size={tp}; use the 'ngram' "
                              "method")
        if self.cpu_offload_space > 0:
            raise ConfigError(f"cpu_offload_space > 0 does not combine with tensor_parallel_size={tp} (the swap pool "
                              "holds rank 0's KV blocks only); leave it 0: preempted requests are recomputed")

    def context_length(self, model_max_len: int) -> int:
        """The context length this engine serves: `max_model_len`, checked against the model's own."""
        if self.max_model_len is None:
            return model_max_len
        if self.max_model_len > model_max_len:
            raise ConfigError(f"max_model_len={self.max_model_len} is larger than the model's context length of "
                              f"{model_max_len} tokens (max_position_embeddings in its config, times a dynamic RoPE's "
                              "factor); give at most "
                              f"{model_max_len}, or leave it out to serve the whole context")
        return self.max_model_len


# vLLM's engine arguments that are fields here, under another name or the same one. `LLM(...)` and the
# command line take them.
VLLM_ENGINE_ARGS: dict[str, str] = {
    "max_model_len": "max_model_len",
    "seed": "seed",
    "max_num_seqs": "max_requests_per_batch",
    "max_num_batched_tokens": "max_batch_tokens",
    "gpu_memory_utilization": "max_memory_percent",
    "kv_cache_memory_bytes": "kv_cache_memory_bytes",
    "enable_prefix_caching": "allow_block_sharing",
    "block_size": "page_size",
    "swap_space": "cpu_offload_space",
    "num_gpu_blocks_override": "num_blocks",
    "enforce_eager": "use_cuda_graph",
    "tensor_parallel_size": "tensor_parallel_size",
    "kv_cache_dtype": "kv_cache_dtype",
    "scheduling_policy": "scheduler_type",
    "async_scheduling": "use_async_batching",
}
SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's: fcfs is fifo or prefill_first, priority is "priority"


def with_vllm_engine_args(config: ContinuousBatchingConfig | None, **given: Any) -> ContinuousBatchingConfig:
    """`config` (or the defaults) with vLLM-named engine arguments applied (those not None;
    `enforce_eager=False` leaves CUDA graphs automatic). A field that `config` sets away from its default
    and a vLLM name sets to something else is a `ConfigError`: two answers, neither silently wins."""
    unknown = set(given) - set(VLLM_ENGINE_ARGS)
    if unknown:
        raise ConfigError(f"unknown engine argument(s) {sorted(unknown)}; vLLM's names taken: "
                          f"{sorted(VLLM_ENGINE_ARGS)}")
    config = config or ContinuousBatchingConfig()
    defaults = {f.name: f.default for f in fields(ContinuousBatchingConfig)}
    values: dict[str, Any] = {}
    for name, value in given.items():
        if name == "enforce_eager":
            value = False if value else None  # use_cuda_graph's value
        if name == "scheduling_policy" and value is not None:
            if value not in SCHEDULING_POLICIES:
                raise ConfigError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {value!r}")
            # fcfs leaves a first-come scheduler type as it is, and disagrees only with "priority"
            value = "priority" if value == "priority" else ("fifo" if config.scheduler_type == "priority" else None)
        if value is None:
            continue
        field_name = VLLM_ENGINE_ARGS[name]
        current = getattr(config, field_name)
        if current != defaults[field_name] and current != value:
            label = name if name == field_name else f"{name} (vLLM's name for {field_name})"
            raise ConfigError(f"{label}={given[name]!r} disagrees with {field_name}={current!r} given in the config: "
                              "give one of them")
        values[field_name] = value
    return replace(config, **values) if values else config
