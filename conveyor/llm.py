"""`LLM`: the offline entry point. Loads a model, builds the engine, generates through the manager."""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from .config import ContinuousBatchingConfig
from .distributed.driver import ShardedModel, load_tensor_parallel
from .engine.draft_runner import load_draft_model
from .engine.engine import Engine
from .engine.stats import EngineStats
from .engine.step_history import StepHistory
from .kernels import vector_flags
from .layers.precision import keeps_stored, resolve_precision, resolve_quantization
from .layers.quantization.linear import describe_weights
from .manager import ContinuousBatchingManager
from .models import build_model
from .models.loader import load_checkpoint
from .request import Request, RequestOutput
from .sampling_params import SamplingParams
from .speculative import SpeculativeConfig

logger = logging.getLogger("conveyor")

Prompt = str | list[int]


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but no CUDA device is available")
    return device


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """The compute dtype `dtype` means on `device` ("auto": see `precision`)."""
    return resolve_precision(dtype, None, device, None).dtype


def release_freed_memory() -> None:
    """Give freed heap memory back to the OS. glibc keeps it after a big load (a checkpoint widened to
    fp32, then quantized to int8, stays resident otherwise). Built-in model, process RSS after load:
    int8 1337 -> 482 MiB, gguf 591 -> 441 MiB."""
    if sys.platform.startswith("linux"):
        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass


class LLM:
    """A model with its continuous-batching engine. `LLM()` loads the built-in SmolLM2-135M-Instruct.
    `speculative_config` (vLLM's dict, or `SpeculativeConfig`) turns speculative decoding on, and
    `tensor_parallel_size` splits the model over that many ranks (README, "Tensor parallelism"); both
    may also come in `config`."""

    def __init__(self, model: str | os.PathLike | None = None, *, dtype: str | torch.dtype = "auto",
                 quantization: str | None = None, device: str | torch.device = "auto",
                 config: ContinuousBatchingConfig | None = None,
                 speculative_config: dict[str, Any] | SpeculativeConfig | None = None,
                 tensor_parallel_size: int | None = None) -> None:
        config = config or ContinuousBatchingConfig()
        if speculative_config is not None:
            config = replace(config, speculative_config=speculative_config)  # validated there
        if tensor_parallel_size is not None:
            config = replace(config, tensor_parallel_size=tensor_parallel_size)
        self.device = resolve_device(device)
        precision = resolve_precision(dtype, quantization, self.device, model)
        self.dtype = precision.dtype
        started = time.monotonic()
        self.sharded: ShardedModel | None = None  # rank 0's side of a tensor-parallel model
        if config.tensor_parallel_size > 1:
            self.sharded = load_tensor_parallel(model, precision, self.device, config.tensor_parallel_size,
                                                config.attention_backend)
            net, checkpoint, self.quantization = self.sharded.model, self.sharded.checkpoint, self.sharded.quantization
            config = self.sharded.engine_config(config)
        else:
            checkpoint = load_checkpoint(model, dtype=self.dtype,
                                         keep_quantized=keeps_stored(precision.quantization, self.device))
            self.quantization = resolve_quantization(precision, checkpoint.quantized)
            net = build_model(checkpoint.config, checkpoint.state_dict, self.dtype, self.device, self.quantization)
        self.model_path = checkpoint.path
        self.tokenizer = checkpoint.tokenizer
        del checkpoint  # what the model did not keep of the loaded tensors is garbage now
        release_freed_memory()
        spec = config.speculative_config
        draft = (load_draft_model(spec, self.model_path, net, self.device)
                 if spec is not None and spec.method == "draft_model" else None)
        self.engine = Engine(net, self.tokenizer, config, self.device, draft_model=draft)
        self.manager = ContinuousBatchingManager(self.engine)
        if self.sharded is not None:  # a rank that dies while the loop is idle kills the engine at once
            self.sharded.on_failure(self.manager.kill)
        logger.info("precision: %s; weights %s; flags %s", precision.reason, describe_weights(net, self.quantization),
                    " ".join(vector_flags()) or "unknown")
        logger.info("loaded %s (%s, %s) in %.1f s", self.model_path.name, self.device, self.dtype,
                    time.monotonic() - started)

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.tokenizer

    def shutdown(self) -> None:
        """Stop the engine loop; with tensor parallelism, release the model on the other ranks (they stay up
        for this process's next `LLM` of the same size, and stop when it exits)."""
        self.manager.stop()
        if self.sharded is not None:
            self.sharded.close()

    # -- what a server or another client reads of the engine ---------------------------------
    @property
    def model_config(self) -> PretrainedConfig:
        """The model's transformers config."""
        return self.engine.model.config

    @property
    def max_model_len(self) -> int:
        """The context length: prompt + generated tokens of one request."""
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.engine.eos_token_ids

    @property
    def kv_capacity_tokens(self) -> int:
        """The longest sequence the whole KV pool holds."""
        return self.engine.capacity_tokens

    @property
    def step_history(self) -> StepHistory | None:
        """The engine's recent step records (the dashboard's), None when off."""
        return self.engine.step_history

    def enable_step_history(self, size: int) -> StepHistory:
        """Switch the engine's step records on (`size` steps) unless `config.step_history` already did."""
        return self.engine.enable_step_history(size)

    def cache_usage(self) -> dict[str, Any]:
        """The KV pool now (per attention type, prefix-cached blocks, bytes and resident bytes)."""
        return self.engine.cache_usage()

    def kv_cache_resident_bytes(self) -> int:
        """Bytes of the KV pool in physical memory (on CPU the pool is committed as it is first written)."""
        return self.engine.pool.resident_bytes()

    def make_request(self, request_id: str, prompt: Prompt, params: SamplingParams) -> Request:
        """A validated request for `manager.submit` (tokenized, constraint compiled); raises
        `InvalidRequestError` with a code and the parameter at fault. Safe from any thread."""
        return self.engine.make_request(request_id, prompt, params)

    def stats(self) -> EngineStats:
        """Engine counters (tokens, preemptions, prefix cache) and cache/queue gauges now."""
        return self.engine.stats()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in input order.

        All prompts are validated before any is queued, so one bad prompt raises and runs nothing.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        requests = [self.make_request(self.manager.new_request_id(), prompt, p)
                    for prompt, p in zip(prompts, params)]
        started_here = not self.manager.is_running()
        self.manager.start()
        try:
            for request in requests:
                self.manager.submit(request)
            return self._collect([r.request_id for r in requests], use_tqdm)
        except BaseException:
            for request in requests:
                self.manager.cancel_request(request.request_id)
            raise
        finally:
            if started_here:
                self.manager.stop()

    def _collect(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(ids)
        results: dict[str, RequestOutput] = {}
        started = time.monotonic()
        generated = 0
        with tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm) as bar:
            while pending:
                output = self.manager.wait_any(pending)
                pending.discard(output.request_id)
                results[output.request_id] = output
                generated += output.num_output_tokens
                bar.set_postfix_str(f"{generated / max(time.monotonic() - started, 1e-9):.1f} output tok/s")
                bar.update(1)
        return [results[i] for i in ids]

    def chat(self, conversations: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate replies to conversations rendered with the model's own chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        prompts = [self.render_chat(c) for c in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def render_chat(self, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of the conversation through the model's chat template (with `tools`, as transformers')."""
        return self.tokenizer.encode(self.render_chat_text(conversation, tools), add_special_tokens=False)

    def render_chat_text(self, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        """The conversation through the model's chat template, as the text `render_chat` tokenizes (a server
        checks its length before it spends time tokenizing it)."""
        if not conversation:
            raise ValueError("conversation is empty: it needs at least one message")
        return self.tokenizer.apply_chat_template(conversation, tools=tools, add_generation_prompt=True, tokenize=False)
