"""Reasoning split out of a reply, one parser per output format, under vLLM's `--reasoning-parser`
names. Plain text in, (reasoning, answer) out: nothing here depends on the engine or the server.

The interface a route uses:

    cls = get_reasoning_parser(name)            # a ValueError listing the names for an unknown one
    parser = cls(prompt=prompt_text, thinking=thinking_switch(chat_template_kwargs))  # one per reply
    reasoning_delta, answer_delta = parser.feed(text_so_far, finished)             # as tokens arrive
    reasoning, answer = cls(prompt=prompt_text).parse(whole_text)                  # or all at once

`prompt` is the rendered chat the reply continues: a template that ends its generation prompt
inside the think block (DeepSeek-R1's, Qwen3's thinking templates) makes the reply reasoning up to
the end marker, all of it if the block is still open at the token limit; one that closes the block
(Qwen3's `enable_thinking: false`) makes it the answer. A parser made with `prompt=""` and
`thinking=False` reads a reply that begins outside any block (a constrained reply, whose first
token is the constraint's). Tool calls are read from the answer only (the server's job).

`base` holds the incremental reading and the block formats' machine; the formats are in
`think_tags` and `harmony` (gpt-oss).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .base import ReasoningParser
from .harmony import GptOssParser
from .think_tags import (
    DeepSeekR1Parser,
    DeepSeekV3Parser,
    GraniteParser,
    HunyuanA13BParser,
    MistralParser,
    Qwen3Parser,
)

__all__ = ["ReasoningParser", "REASONING_PARSERS", "PARSER_CLASSES", "get_reasoning_parser", "thinking_switch"]

PARSER_CLASSES: list[type[ReasoningParser]] = [DeepSeekR1Parser, Qwen3Parser, DeepSeekV3Parser, GptOssParser,
                                               GraniteParser, HunyuanA13BParser, MistralParser]
# vLLM's names, and `gpt_oss` for the harmony parser (vLLM calls it `openai_gptoss`).
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {cls.name: cls for cls in PARSER_CLASSES} | {
    "gpt_oss": GptOssParser}
SWITCHES = ("enable_thinking", "thinking")  # Qwen3's, Hunyuan's; DeepSeek V3.1's, Granite's


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class of a `--reasoning-parser` name; a ValueError listing the names otherwise."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose from {', '.join(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]


def thinking_switch(chat_template_kwargs: Mapping[str, Any] | None) -> bool | None:
    """Thinking on or off as the chat template kwargs set it (`enable_thinking`, else `thinking`); None
    when neither is a boolean."""
    for key in SWITCHES:
        value = (chat_template_kwargs or {}).get(key)
        if isinstance(value, bool):
            return value
    return None
