"""Helpers of the server tests: a tiny Llama with a long context (requests that run for a while), one
over a byte-level BPE tokenizer that can spell JSON, prompts of its words, `conveyor serve`'s parser,
waiting for a server subprocess, a reader of Prometheus lines, and a reasoning server's chat template
and settings (with waiting for its pool to come back)."""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from conveyor import LLM, ContinuousBatchingConfig
from conveyor.cli_args import add_serve_args
from conveyor.scaleout import add_data_parallel_args
from conveyor.server import ServerSettings

from tests.utils import TINY_COMMON, VOCAB, idle, tiny_tokenizer

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


CORPUS = ['{"name": "get_weather", "arguments": {"city": "Lima", "unit": "C", "where": {"lat": -12}}}',
          '[{"name": "get_time", "arguments": {"zone": "UTC", "dst": true}}]', "What is the weather in Lima?",
          '{"temperature": 25, "type": "string", "description": "sunny"}'] * 4


def save_json_tiny(path: Path) -> Path:
    """A random 2-layer Llama (2048 positions) over a byte-level BPE tokenizer trained on a few JSON lines."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                                     eos_token="</s>")
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}assistant: {% endif %}")
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**(TINY_COMMON | {"vocab_size": len(tokenizer), "max_position_embeddings": 2048}),
                                      tie_word_embeddings=False)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def long_tiny_llm(path: Path, num_blocks: int = 1024, **config: object) -> LLM:
    return LLM(path, dtype="float32", config=ContinuousBatchingConfig(num_blocks=num_blocks, max_batch_tokens=256,
                                                                      **config))


def random_words(seed: int, n: int) -> str:
    """A prompt of `n` random words of the word-level tokenizer."""
    return " ".join(f"w{t}" for t in random.Random(seed).choices(range(3, VOCAB), k=n))


def serve_parser() -> argparse.ArgumentParser:
    """`conveyor serve`'s options, data parallelism included."""
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    add_data_parallel_args(parser)
    return parser


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float = 90) -> None:
    """Until the server subprocess `proc` answers /health (its `log` in the error if it exits first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError("server did not become healthy")


def metric(text: str, name: str, **labels: str) -> float:
    """The first sample of `name` with these `labels` in a Prometheus text page (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


# Qwen3's way on the built-in model: the generation prompt opens a think block unless `enable_thinking` is
# false (then it closes an empty one), an assistant's earlier `reasoning_content` is rendered in its block,
# and a `system_note` variable (the reasoning server's default template kwargs) adds a system turn.
THINK_TEMPLATE = (
    "{% if system_note is defined %}<|im_start|>system\n{{ system_note }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}")
THINK_NOTE = "Answer in one word."


def think_settings(**settings: Any) -> ServerSettings:
    """A server on THINK_TEMPLATE: the qwen3 reasoning parser, tool_choice "auto", served as "smol", the
    system note as its default template kwargs."""
    return ServerSettings(**({"served_model_names": ["smol"], "enable_auto_tool_choice": True,
                              "reasoning_parser": "qwen3", "default_chat_template_kwargs": {"system_note": THINK_NOTE}}
                             | settings))


def settles(llm: LLM) -> None:
    """Until every block is back (a stream's last requests end within a step of its last event)."""
    deadline = time.monotonic() + 10
    while not idle(llm):
        assert time.monotonic() < deadline, llm.stats()
        time.sleep(0.05)
