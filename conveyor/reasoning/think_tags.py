"""Formats that write the reasoning as one marked block before the answer (vLLM's parser names):
`<think>` ... `</think>` (DeepSeek-R1, Qwen3, DeepSeek V3.1), Mistral's `[THINK]` tokens, Hunyuan's
think and answer tags, and Granite's sentences."""

from __future__ import annotations

from .base import BlockParser

THINK = ("<think>",)
UNTHINK = ("</think>",)


class DeepSeekR1Parser(BlockParser):
    """As vLLM's: with no marker in the prompt the reply begins inside the block (R1 often leaves its
    `<think>` out), unless the request turns thinking off."""

    name = "deepseek_r1"
    families = "DeepSeek-R1 and its distills, QwQ"
    example = "<think>\nreasoning\n</think>\n\nanswer"
    starts, ends, special = THINK, UNTHINK, THINK + UNTHINK
    assume_open = True


class Qwen3Parser(BlockParser):
    """The block is reasoning where the prompt opens it (thinking templates) or where the reply begins
    with `<think>` (Qwen3's first templates); a reply without it is the answer."""

    name = "qwen3"
    families = "Qwen3, Qwen3-MoE, Qwen3 2507 thinking, SmolLM3"
    example = "<think>\nreasoning\n</think>\n\nanswer"
    starts, ends, special = THINK, UNTHINK, THINK + UNTHINK


class DeepSeekV3Parser(Qwen3Parser):
    """DeepSeek V3.1's template opens the block when `thinking` is true and closes it otherwise."""

    name = "deepseek_v3"
    families = "DeepSeek V3.1, V3.2 (`thinking` chat template switch)"
    example = "reasoning</think>answer"


class MistralParser(BlockParser):
    name = "mistral"
    families = "Magistral (`[THINK]` tokens)"
    example = "[THINK]reasoning[/THINK]answer"
    starts, ends = ("[THINK]",), ("[/THINK]",)
    special = starts + ends


class HunyuanA13BParser(BlockParser):
    """The answer comes in `<answer>` tags, dropped with the newlines inside them."""

    name = "hunyuan_a13b"
    families = "Hunyuan-A13B"
    example = "<think>\nreasoning\n</think>\n<answer>\nanswer\n</answer>"
    starts, ends, markup = THINK, UNTHINK, ("<answer>\n", "\n</answer>", "<answer>", "</answer>")
    special = THINK + UNTHINK + ("<answer>", "</answer>")


class GraniteParser(BlockParser):
    """Granite 3.2 / 3.3 with `thinking` on write sentences, not tokens (and sometimes "Here's")."""

    name = "granite"
    families = "IBM Granite 3.2, 3.3 (`thinking` chat template switch)"
    example = "Here is my thought process: reasoning Here is my response: answer"
    starts = ("Here is my thought process:", "Here's my thought process:")
    ends = ("Here is my response:", "Here's my response:")
