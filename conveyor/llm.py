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
from transformers import PreTrainedTokenizerBase

from .config import ContinuousBatchingConfig
from .engine import Engine, EngineStats
from .manager import ContinuousBatchingManager
from .models import build_model
from .kernels import vector_flags
from .models.loader import load_checkpoint
from .models.quant_linear import describe_weights
from .precision import resolve_precision, resolve_quantization
from .request import RequestOutput
from .sampling_params import SamplingParams
from .speculative import SpeculativeConfig
from .speculative.draft import load_draft_model

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
    `speculative_config` (vLLM's dict, or `SpeculativeConfig`) turns speculative decoding on; it
    may also come in `config.speculative_config`."""

    def __init__(self, model: str | os.PathLike | None = None, *, dtype: str | torch.dtype = "auto",
                 quantization: str | None = None, device: str | torch.device = "auto",
                 config: ContinuousBatchingConfig | None = None,
                 speculative_config: dict[str, Any] | SpeculativeConfig | None = None) -> None:
        config = config or ContinuousBatchingConfig()
        if speculative_config is not None:
            config = replace(config, speculative_config=speculative_config)  # validated there
        self.device = resolve_device(device)
        precision = resolve_precision(dtype, quantization, self.device, model)
        self.dtype = precision.dtype
        started = time.monotonic()
        keep = precision.quantization in (None, "gguf") and self.device.type == "cpu"
        checkpoint = load_checkpoint(model, dtype=self.dtype, keep_quantized=keep)
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
        logger.info("precision: %s; weights %s; flags %s", precision.reason, describe_weights(net, self.quantization),
                    " ".join(vector_flags()) or "unknown")
        logger.info("loaded %s (%s, %s) in %.1f s", self.model_path.name, self.device, self.dtype,
                    time.monotonic() - started)

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.tokenizer

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
        requests = [self.engine.make_request(self.manager.new_request_id(), prompt, p)
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
        if not conversation:
            raise ValueError("conversation is empty: it needs at least one message")
        ids = self.tokenizer.apply_chat_template(conversation, tools=tools, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
