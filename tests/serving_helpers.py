"""Helpers of the dashboard, fuzz and soak tests: a tiny Llama with a long context (requests that run
for a while), served on a thread, and a reader of Prometheus lines."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

from conveyor import LLM, ContinuousBatchingConfig

from .conftest import TINY_COMMON, tiny_tokenizer

CHAT_TEMPLATE = ("{% for m in messages %}w3 {{ m['content'] }} w4 {% endfor %}"
                 "{% if add_generation_prompt %}w5{% endif %}")


def save_long_tiny(path: Path, context: int = 2048) -> Path:
    """A random 2-layer Llama with `context` positions and the word-level tokenizer (token i = "w{i}")."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**(TINY_COMMON | {"max_position_embeddings": context}),
                                      tie_word_embeddings=False)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    config_file = path / "tokenizer_config.json"
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | {"chat_template": CHAT_TEMPLATE}))
    return path


def long_tiny_llm(path: Path, num_blocks: int = 1024, **config: object) -> LLM:
    return LLM(path, dtype="float32", config=ContinuousBatchingConfig(num_blocks=num_blocks, max_batch_tokens=256,
                                                                      **config))


def metric(text: str, name: str) -> float:
    """The first sample of `name` in a Prometheus text page (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
