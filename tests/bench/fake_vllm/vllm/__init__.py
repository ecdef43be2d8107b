"""A stand-in for vLLM in `tests/bench/test_vllm.py`: the part of its offline API that
`conveyor/bench/vllm_runner.py` uses (`LLM(model, tokenizer, dtype, **kwargs)`, `SamplingParams`,
`LLM.generate` over `{"prompt_token_ids": ...}` prompts, `llm.model_config`), decoding greedily with
transformers' eager model so that its tokens are a known reference; and `LLM.embed` (for
`runner="pooling"`): the last token's final hidden state, L2-normalized, as vLLM pools a decoder.

`FAKE_VLLM_LOG` (a path): the constructor arguments, the sampling parameters of the timed call and
the `VLLM_*`/`HF_*` environment are written there as JSON. `FAKE_VLLM_FLIP` ("i:k,..."): request i's
k-th output token is replaced (by another token id), to test the agreement figures.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch
import transformers

__version__ = "0.0+fake"


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None


@dataclass
class CompletionOutput:
    token_ids: list[int]
    finish_reason: str


@dataclass
class RequestOutput:
    outputs: list[CompletionOutput] = field(default_factory=list)


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    outputs: EmbeddingOutput


@dataclass
class ModelConfig:
    dtype: torch.dtype
    quantization: str | None = None


class LLM:
    def __init__(self, model: str, tokenizer: str | None = None, dtype: str = "auto", **kwargs: object) -> None:
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            model, dtype=getattr(torch, dtype), attn_implementation="eager").eval()
        self.model_config = ModelConfig(getattr(torch, dtype))
        self.log = {"model": model, "tokenizer": tokenizer, "dtype": dtype, "kwargs": kwargs, "calls": [],
                    "env": {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "HF_"))}}
        flips = [item.split(":") for item in os.environ.get("FAKE_VLLM_FLIP", "").split(",") if item]
        self.flips = {(int(i), int(k)) for i, k in flips}

    @torch.inference_mode()
    def _greedy(self, prompt: list[int], p: SamplingParams) -> CompletionOutput:
        assert p.temperature == 0.0, "the throughput benchmark is greedy"
        ids, out = list(prompt), []
        for _ in range(p.max_tokens):
            token = int(self.model(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(token)
            out.append(token)
            if not p.ignore_eos and token in (p.stop_token_ids or []):
                return CompletionOutput(out, "stop")
        return CompletionOutput(out, "length")

    @torch.inference_mode()
    def embed(self, prompts: list[dict], use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        assert self.log["kwargs"].get("runner") == "pooling", "embed needs runner='pooling'"
        outputs = []
        for pr in prompts:
            hidden = self.model.model(torch.tensor([pr["prompt_token_ids"]])).last_hidden_state[0, -1].float()
            outputs.append(EmbeddingRequestOutput(EmbeddingOutput((hidden / hidden.norm()).tolist())))
        self.log["calls"].append([len(pr["prompt_token_ids"]) for pr in prompts])
        if os.environ.get("FAKE_VLLM_LOG"):
            with open(os.environ["FAKE_VLLM_LOG"], "w") as f:
                json.dump(self.log, f)
        return outputs

    def generate(self, prompts: list[dict], sampling_params: SamplingParams | list[SamplingParams],
                 use_tqdm: bool = True) -> list[RequestOutput]:
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        outputs = [RequestOutput([self._greedy(pr["prompt_token_ids"], p)]) for pr, p in zip(prompts, params)]
        for i, k in self.flips:
            if i < len(outputs) and k < len(outputs[i].outputs[0].token_ids):
                outputs[i].outputs[0].token_ids[k] = 3 + (outputs[i].outputs[0].token_ids[k] + 1) % 200
        self.log["calls"].append([vars(p) for p in params])
        if os.environ.get("FAKE_VLLM_LOG"):
            with open(os.environ["FAKE_VLLM_LOG"], "w") as f:
                json.dump(self.log, f)
        return outputs
