"""Tool calls written by the model itself (the server's `tool_choice: "auto"`), one parser per output
format, under vLLM's `--tool-call-parser` names; without the flag the format is read off the chat
template. Plain text in, calls out: nothing here depends on the engine or the server.

`base` holds the incremental reading every format shares (content streams as it comes; each call is
sent whole once its text is complete; streamed deltas concatenate to the whole reply's); the
formats are in `json_formats` (Hermes, Llama 3 JSON, Mistral, Granite, DeepSeek), `pythonic` (and
OLMo 3's lines of calls) and `qwen3_xml`.
"""

from __future__ import annotations

from .base import ToolCall, ToolParser
from .json_formats import (
    DeepSeekV3Parser,
    DeepSeekV31Parser,
    GraniteParser,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
)
from .pythonic import Olmo3Parser, PythonicParser
from .qwen3_xml import Qwen3XmlParser

__all__ = ["ToolCall", "ToolParser", "TOOL_PARSERS", "PARSER_CLASSES", "detect_parser", "get_parser"]

PARSER_CLASSES: list[type[ToolParser]] = [HermesParser, Llama3JsonParser, MistralParser, Qwen3XmlParser,
                                          GraniteParser, PythonicParser, Olmo3Parser, DeepSeekV3Parser,
                                          DeepSeekV31Parser]
# vLLM's names: each format's own, and the aliases vLLM registers for the same format.
TOOL_PARSERS: dict[str, type[ToolParser]] = {cls.name: cls for cls in PARSER_CLASSES} | {
    "qwen3_json": HermesParser, "llama4_json": Llama3JsonParser, "qwen3_coder": Qwen3XmlParser,
    "llama4_pythonic": PythonicParser}

# (a text the chat template holds, the parser its replies need), the first match wins.
TEMPLATE_SIGNS: list[tuple[tuple[str, ...], str]] = [
    (("<function=", "<parameter="), "qwen3_xml"),
    (("[TOOL_CALLS]",), "mistral"),
    (("tool▁calls▁begin", "```json"), "deepseek_v3"),
    (("tool▁calls▁begin",), "deepseek_v31"),
    (("<|tool_call|>",), "granite"),
    (("<|start_of_role|>",), "granite"),
    (("<|python_start|>",), "pythonic"),
    (("<function_calls>",), "olmo3"),
    (("<|header_start|>",), "llama3_json"),
    (("<|start_header_id|>", "<|python_tag|>"), "llama3_json"),
    (("<|start_header_id|>", '"parameters"'), "llama3_json"),
    (("<tool_call>",), "hermes"),
]


def detect_parser(template: str | None) -> str:
    """The parser for the replies of a model with this chat template; Hermes when nothing says otherwise
    (it is also the format Conveyor describes to models whose template does not know tools)."""
    for signs, name in TEMPLATE_SIGNS:
        if template and all(s in template for s in signs):
            return name
    return "hermes"


def get_parser(name: str) -> type[ToolParser]:
    """The parser class of a `--tool-call-parser` name; a ValueError listing the names otherwise."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; choose from {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]
