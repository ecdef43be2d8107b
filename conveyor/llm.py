"""`LLM`: the offline entry point. Loads a model, builds the engine, generates through the manager."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from .beam_search import BeamSearchMethods
from .chat_llm import ChatMethods
from .chat_template import load_chat_template
from .config import ContinuousBatchingConfig, with_vllm_engine_args
from .errors import ConfigError
from .distributed.driver import ShardedModel, load_tensor_parallel
from .distributed.launch import exit_if_spawned_rank
from .engine.draft_runner import load_draft_model
from .engine_view import EngineViewMethods
from .enqueue_llm import EnqueueMethods
from .engine.engine import Engine
from .generation_config import GenerationDefaults
from .kernels import vector_flags
from .kernels.host_memory import keep_freed_memory, release_freed_memory
from .kernels.openmp import run_on_fresh_thread
from .layers.precision import keeps_stored, resolve_precision, resolve_quantization
from .layers.quantization.linear import describe_weights, prompts_take_onednn
from .manager import ContinuousBatchingManager
from .metrics import Metrics
from .models import build_model
from .models.hub import resolve_model_path, resolve_tokenizer_path
from .models.loader import load_checkpoint, load_tokenizer
from .models.pooling import apply_hf_overrides, build_pooler, matryoshka_dimensions, pooling_task
from .lora_llm import LoRAMethods, per_prompt
from .lora_request import LoRAConfig, LoRARequest
from .pooling_llm import PoolingMethods, pooling_engine_config
from .pooling_params import PoolerConfig
from .reasoning.markers import ReasoningConfig
from .reasoning_state import ReasoningMarkers
from .request import Prompt, Request, RequestOutput, decode_logprob_tokens, per_prompt_samples, prompt_list
from .sampling_params import SamplingParams
from .speculative import SpeculativeConfig
from .structured.config import StructuredOutputsConfig
from .vllm_flags import check_vllm_kwargs

logger = logging.getLogger("conveyor")


DEVICES = "'auto', 'cpu', 'cuda' or 'cuda:N'"
# The same where a model's prompts go to oneDNN's bf16 matmul over weights dequantized at each call (AMX
# CPUs, `prompts_take_onednn`): larger steps amortize the dequantization (docs/configuration.md).
ONEDNN_MAX_BATCH_TOKENS = 2048


def resolve_device(device: str | torch.device) -> torch.device:
    """The device `device` names, or a `ConfigError` saying what runs here: Conveyor runs on CPUs and
    CUDA GPUs only, and torch's own errors for the others come late (at the first tensor moved)."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:  # torch lists its own 20 device types
        raise ConfigError(f"unknown device {str(device)!r}: give {DEVICES}") from None
    if resolved.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {str(device)!r}: Conveyor runs on CPUs and CUDA GPUs only: give {DEVICES}")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            raise ConfigError(f"device {str(device)!r} was asked for, but this PyTorch ({torch.__version__}) is "
                              "built without CUDA: run on the CPU (device='cpu', --device cpu), or install "
                              "PyTorch's CUDA build (pytorch.org/get-started)")
        raise ConfigError(f"device {str(device)!r} was asked for, but PyTorch sees no CUDA GPU (none in "
                          "nvidia-smi, or hidden by CUDA_VISIBLE_DEVICES): run on the CPU (device='cpu', --device cpu)")
    if resolved.type == "cuda" and resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise ConfigError(f"device {str(device)!r}: this machine has {torch.cuda.device_count()} visible CUDA "
                          f"GPU(s): give one of cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return resolved


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """The compute dtype `dtype` means on `device` ("auto": see `precision`)."""
    return resolve_precision(dtype, None, device, None).dtype


class LLM(ChatMethods, PoolingMethods, LoRAMethods, BeamSearchMethods, EnqueueMethods, EngineViewMethods):
    """A model with its continuous-batching engine. `LLM()` loads the built-in SmolLM2-135M-Instruct.

    model: a Hugging Face model directory, a .gguf file, or a Hub id (`org/name`, `org/name:QUANT` for a
        GGUF repo's file of that quant type) fetched through huggingface_hub (`revision`, `download_dir`
        as its cache, `gguf_file` naming the repo's or directory's GGUF file, `hf_token` else HF_TOKEN;
        HF_HUB_OFFLINE=1 uses the cache only).
    speculative_config: vLLM's dict (or `SpeculativeConfig`) turns speculative decoding on; it may also
        come in `config.speculative_config`.
    batch_invariant: guarantee that a request's output does not depend on its batch or on how its prompt
        is chunked (`config.batch_invariant`; None: VLLM_BATCH_INVARIANT=1 turns it on, as in vLLM).
    max_model_len, max_num_seqs, max_num_batched_tokens, gpu_memory_utilization, kv_cache_memory_bytes (the
    KV cache's size in bytes; on CPU also VLLM_CPU_KVCACHE_SPACE, in GiB), enable_prefix_caching, seed,
    enforce_eager, block_size, swap_space, num_gpu_blocks_override, tensor_parallel_size (the model split
    over that many ranks: docs/scale-out.md), kv_cache_dtype ("auto", "int8", "fp8": docs/configuration.md),
    scheduling_policy ("fcfs" or "priority": `generate(priority=...)`, docs/configuration.md),
    async_scheduling (`config.use_async_batching`): vLLM's engine arguments, mapped onto `config`
    (`config.VLLM_ENGINE_ARGS`); one that disagrees with a value `config` sets is an error.
    tokenizer: vLLM's: a tokenizer directory or Hub id used in place of the model's (a GGUF file's then is not
        converted); its chat template with it.
    chat_template: a Jinja file or template text used instead of the model's (`chat`, the server).
    runner, convert, task, pooler_config: vLLM's pooling model options (docs/python-api.md): `runner="pooling"`
        embeds (`embed`) or classifies and scores (`classify`, `score`) instead of generating; "auto" reads
        the config's architectures. hf_overrides: vLLM's dict of config fields set over the checkpoint's.
    generation_config: "auto" (the model's generation_config.json gives the defaults of what a request
        leaves unset), "vllm" (ignore it) or a directory; `override_generation_config` goes over it.
    reasoning_parser, reasoning_config: vLLM's: the model's reasoning markers (a parser's format, or
        `ReasoningConfig` strings), which `SamplingParams.thinking_token_budget` counts and forces, and
        after which a request's output constraint applies (unless `structured_outputs_config`, vLLM's,
        says `enable_in_reasoning`).
    enable_lora, max_loras, max_lora_rank, max_cpu_loras: vLLM's multi-LoRA serving (docs/lora.md):
        `generate(..., lora_request=LoRARequest(name, id, path))`, `add_lora`.
    vllm_kwargs: vLLM's other engine arguments: those that ask for what Conveyor always does
        (`trust_remote_code`, ...) are taken with a log line, the others are errors saying what to use
        (`vllm_flags`).
    """

    def __init__(self, model: str | os.PathLike | None = None, *, dtype: str | torch.dtype = "auto",
                 quantization: str | None = None, device: str | torch.device = "auto",
                 config: ContinuousBatchingConfig | None = None,
                 speculative_config: dict[str, Any] | SpeculativeConfig | None = None,
                 revision: str | None = None, download_dir: str | os.PathLike | None = None,
                 gguf_file: str | None = None, hf_token: str | bool | None = None,
                 tokenizer: str | os.PathLike | None = None, max_model_len: int | None = None,
                 max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                 gpu_memory_utilization: float | None = None, kv_cache_memory_bytes: int | None = None,
                 enable_prefix_caching: bool | None = None, seed: int | None = None,
                 enforce_eager: bool | None = None, block_size: int | None = None, swap_space: float | None = None,
                 chat_template: str | os.PathLike | None = None, generation_config: str | os.PathLike = "auto",
                 override_generation_config: dict[str, Any] | None = None,
                 num_gpu_blocks_override: int | None = None, tensor_parallel_size: int | None = None,
                 batch_invariant: bool | None = None, kv_cache_dtype: str | None = None,
                 scheduling_policy: str | None = None, async_scheduling: bool | None = None,
                 runner: str = "auto", convert: str = "auto",
                 task: str | None = None, pooler_config: PoolerConfig | dict[str, Any] | str | None = None,
                 hf_overrides: dict[str, Any] | None = None, reasoning_parser: str | None = None,
                 reasoning_config: ReasoningConfig | dict[str, Any] | None = None,
                 structured_outputs_config: StructuredOutputsConfig | dict[str, Any] | None = None,
                 **vllm_kwargs: Any) -> None:
        exit_if_spawned_rank()  # a script without the __main__ guard, re-run in a tensor-parallel rank
        lora_config = LoRAConfig.pop_kwargs(vllm_kwargs)
        for note in check_vllm_kwargs(vllm_kwargs):
            logger.info("%s", note)
        given_config = config
        config = with_vllm_engine_args(
            config, max_model_len=max_model_len, max_num_seqs=max_num_seqs, seed=seed, block_size=block_size,
            max_num_batched_tokens=max_num_batched_tokens, gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_memory_bytes=kv_cache_memory_bytes, enable_prefix_caching=enable_prefix_caching,
            enforce_eager=enforce_eager, swap_space=swap_space,
            num_gpu_blocks_override=num_gpu_blocks_override, tensor_parallel_size=tensor_parallel_size,
            kv_cache_dtype=kv_cache_dtype, scheduling_policy=scheduling_policy, async_scheduling=async_scheduling)
        if speculative_config is not None:
            config = replace(config, speculative_config=speculative_config)  # validated there
        if batch_invariant is not None and batch_invariant != config.batch_invariant:
            if given_config is not None:
                raise ConfigError(f"batch_invariant={batch_invariant!r} disagrees with the config's "
                                  f"batch_invariant={config.batch_invariant!r}: give one of them")
            config = replace(config, batch_invariant=batch_invariant)
        template = load_chat_template(chat_template) if chat_template is not None else None
        self.structured_outputs_config = structured = StructuredOutputsConfig.of(structured_outputs_config)
        reasoning = ReasoningConfig.of(reasoning_config, reasoning_parser or structured.reasoning_parser)
        pooler_settings = PoolerConfig.parse(pooler_config)
        if config.tensor_parallel_size > 1 and (hf_overrides or runner == "pooling" or task or convert != "auto"
                                                or lora_config is not None):
            raise ConfigError("pooling models, LoRA adapters and hf_overrides run on one rank: tensor_parallel_size "
                              "must be 1")
        self.device = resolve_device(device)
        location = resolve_model_path(model, revision=revision, download_dir=download_dir, gguf_file=gguf_file,
                                      token=hf_token)
        self.generation_defaults = GenerationDefaults.load(generation_config, location.path,
                                                           override_generation_config)
        own_tokenizer = None if tokenizer is None else load_tokenizer(resolve_tokenizer_path(
            tokenizer, download_dir=download_dir, token=hf_token))
        precision = resolve_precision(dtype, quantization, self.device, location.path)
        self.dtype = precision.dtype
        started = time.monotonic()
        self.sharded: ShardedModel | None = None  # rank 0's side of a tensor-parallel model
        def load() -> torch.nn.Module:
            """The model, its tokenizer, the draft model (or the pooler), the engine and its manager."""
            engine_config, pooler = config, None
            if config.tensor_parallel_size > 1:
                self.sharded = load_tensor_parallel(location.path, precision, self.device,
                                                    config.tensor_parallel_size, config.attention_backend)
                net, checkpoint = self.sharded.model, self.sharded.checkpoint
                self.quantization = self.sharded.quantization
                engine_config = self.sharded.engine_config(config)
            else:
                checkpoint = load_checkpoint(location.path, dtype=self.dtype, tokenizer=own_tokenizer is None,
                                             keep_quantized=keeps_stored(precision.quantization, self.device))
                self.quantization = resolve_quantization(precision, checkpoint.stored_format)
                apply_hf_overrides(checkpoint.config, hf_overrides)
                task_name = pooling_task(checkpoint.config, runner, convert, task)
                if task_name is not None:
                    pooler = build_pooler(task_name, checkpoint.config, checkpoint.state_dict,
                                          own_tokenizer or checkpoint.tokenizer,
                                          pooler_settings, checkpoint.pooler_config, self.device, checkpoint.projector)
                net = build_model(checkpoint.config, checkpoint.state_dict, self.dtype, self.device, self.quantization,
                                  lm_head=task_name is None)
                if task_name is not None:
                    engine_config = pooling_engine_config(config, net, checkpoint.path,
                                                          own_tokenizer or checkpoint.tokenizer,
                                                          sized=given_config is not None or max_num_batched_tokens
                                                          is not None)
                if (given_config is None and max_num_batched_tokens is None and task_name is None
                        and self.device.type == "cpu" and not config.batch_invariant
                        and prompts_take_onednn(net, self.dtype)):
                    engine_config = replace(config, max_batch_tokens=ONEDNN_MAX_BATCH_TOKENS)
            self.model_path = checkpoint.path
            self.model_name = location.hub_id or self.model_path.name  # what the server answers to by default
            self.tokenizer = own_tokenizer or checkpoint.tokenizer
            if own_tokenizer is not None and len(own_tokenizer) > checkpoint.config.vocab_size:
                raise ConfigError(f"the tokenizer {tokenizer} has {len(own_tokenizer)} tokens, more than the model's "
                                  f"vocabulary of {checkpoint.config.vocab_size}: it is not this model's tokenizer")
            del checkpoint  # what the model did not keep of the loaded tensors is garbage now
            release_freed_memory()
            if self.device.type == "cpu":
                keep_freed_memory()  # from here on the steps reuse each other's buffers
            if template is not None:  # everything that renders chats (the server too) reads it from the tokenizer
                self.tokenizer.chat_template = template
                try:
                    self.render_chat([{"role": "user", "content": "Hello"}])
                except Exception as exc:  # Jinja's and transformers' many errors: fail now, not at the first chat
                    raise ValueError(f"the chat template {chat_template!s:.80} cannot render a user message: "
                                     f"{exc}") from exc
            spec = engine_config.speculative_config
            draft = (load_draft_model(spec, self.model_path, net, self.device)
                     if spec is not None and spec.method == "draft_model" else None)
            self.engine = Engine(net, self.tokenizer, engine_config, self.device, draft_model=draft, pooler=pooler,
                                 matryoshka=matryoshka_dimensions(net.config), lora_config=lora_config)
            self.manager = ContinuousBatchingManager(self.engine)
            return net

        # On CPU in one process, on a thread that exits, so that the engine thread's OpenMP team is the only one
        net = run_on_fresh_thread(load) if self.device.type == "cpu" and config.tensor_parallel_size == 1 else load()
        if self.sharded is not None:  # a rank that dies while the loop is idle kills the engine at once
            self.sharded.on_failure(self.manager.kill)
        self.engine.constrain_reasoning(self.structured_outputs_config.enable_in_reasoning)
        if reasoning is not None:
            self.set_reasoning_config(reasoning)
        self.metrics = Metrics(self.stats, self.model_name, self.kv_cache_resident_bytes)  # `get_metrics`
        logger.info("precision: %s; weights %s; flags %s", precision.reason, describe_weights(net, self.quantization),
                    " ".join(vector_flags()) or "unknown")
        logger.info("loaded %s (%s, %s) in %.1f s; context %d tokens; generation defaults: %s", self.model_name,
                    self.device, self.dtype, time.monotonic() - started, self.max_model_len,
                    self.generation_defaults.describe())
        if self.engine.pooler is not None:
            pooler = self.engine.pooler
            logger.info("pooling model (runner 'pooling'): task %s, %s-token pooling, %s", pooler.task,
                        pooler.pooling_type, ("normalized" if pooler.normalize else "not normalized")
                        if pooler.task.endswith("embed") else f"{pooler.num_labels} label(s)")

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.tokenizer

    @property
    def reasoning_markers(self) -> ReasoningMarkers | None:
        """The reasoning markers thinking budgets count between and force (None: budgets are refused)."""
        return self.engine.reasoning_markers

    def set_reasoning_config(self, config: ReasoningConfig | dict[str, Any]) -> None:
        """As `LLM(reasoning_config=...)`, for requests made from now on (a server's --reasoning-parser)."""
        reasoning = ReasoningConfig.of(config)
        if reasoning is not None:
            self.engine.set_reasoning_markers(reasoning.markers(self.tokenizer))

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams' defaults with the model's generation config applied (vLLM's name): what
        `generate` and `chat` use without sampling params, and what the server fills unset fields from."""
        return self.generation_defaults.sampling_params()

    def default_max_tokens(self, prompt_tokens: int) -> int:
        """What a request that sets no limit may generate (the server's, vLLM's rule): the rest of the
        context, capped by the generation config. Below 1: the prompt leaves no room."""
        return self.generation_defaults.max_tokens(prompt_tokens, self.max_model_len)

    def shutdown(self) -> None:
        """Stop the engine loop; with tensor parallelism, release the model on the other ranks (they stay up
        for this process's next `LLM` of the same size, and stop when it exits)."""
        self.manager.stop()
        if self.sharded is not None:
            self.sharded.close()

    def make_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                     lora_request: LoRARequest | None = None) -> Request:
        """A validated request for `manager.submit` (tokenized, constraint compiled, its adapter loaded); raises
        `InvalidRequestError` with a code and the parameter at fault. Safe from any thread."""
        return self.engine.make_request(request_id, prompt, params, lora_request)

    def reset_prefix_cache(self) -> bool:
        """vLLM's: forget every cached prefix, so the next prompts are computed in full (fair benchmarks and
        evaluations); False, changing nothing, while requests are unfinished (a server's too)."""
        return self.manager.call(Engine.reset_prefix_cache)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: int | Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or vLLM's `{"prompt": ...}` / `{"prompt_token_ids": ...}`);
        outputs in input order. priority (vLLM's): one for all prompts or one each, over the sampling
        params' (lower runs first; needs `scheduling_policy="priority"`). lora_request: the adapter of all
        prompts or one each (None: the base model); needs `enable_lora=True`.

        All prompts are validated before any is queued, so one bad prompt raises and runs nothing.
        """
        requests, samples = self.sample_requests(prompts, sampling_params, priority, lora_request)
        return self.run_samples(requests, samples, use_tqdm)

    def run_samples(self, requests: list[Request], samples: list[int], use_tqdm: bool) -> list[RequestOutput]:
        """Run validated requests (`sample_requests`') to the end: one output per prompt, its `samples[i]`
        samples in `outputs`, logprobs' tokens decoded."""
        outputs = self.manager.run_batch(requests, lambda ids: self._collect(ids, use_tqdm))
        decode_logprob_tokens(outputs, self.tokenizer.decode)
        return per_prompt_samples(outputs, samples)

    def sample_requests(self, prompts: Prompt | Sequence[Prompt],
                        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                        priority: int | Sequence[int] | None = None,
                        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                        ) -> tuple[list[Request], list[int]]:
        """`generate`'s validated requests, one per sample (vLLM's `n`), and each prompt's number of samples."""
        prompts = prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        if priority is not None:
            priorities = [priority] * len(prompts) if isinstance(priority, int) else list(priority)
            if len(priorities) != len(prompts):
                raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
            params = [replace(p, priority=q) for p, q in zip(params, priorities)]
        adapters = per_prompt(lora_request, len(prompts))
        requests = [self.make_request(self.manager.new_request_id(), prompt, p.for_sample(j), lora)
                    for prompt, p, lora in zip(prompts, params, adapters) for j in range(p.n)]
        return requests, [p.n for p in params]

    def _collect(self, ids: list[str], use_tqdm: bool, pooling: bool = False) -> list[RequestOutput]:
        """The final outputs of `ids`, in order, with a progress bar of output tokens (pooling: prompt tokens)/s."""
        pending = set(ids)
        results: dict[str, RequestOutput] = {}
        started = time.monotonic()
        tokens = 0
        with tqdm(total=len(ids), desc="Pooling" if pooling else "Generating", unit="req",
                  disable=not use_tqdm) as bar:
            while pending:
                output = self.manager.wait_any(pending)
                pending.discard(output.request_id)
                results[output.request_id] = output
                if not pooling:
                    self.metrics.observe_finished(output)
                tokens += output.num_prompt_tokens if pooling else output.num_output_tokens
                bar.set_postfix_str(f"{tokens / max(time.monotonic() - started, 1e-9):.1f} "
                                    f"{'input' if pooling else 'output'} tok/s")
                bar.update(1)
        return [results[i] for i in ids]
