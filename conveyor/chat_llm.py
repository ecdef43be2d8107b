"""`LLM`'s chat entry points, vLLM's: `chat` (conversations rendered with the chat template, then generated),
and `render_chat` / `render_chat_text`, which the server renders its conversations with."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from .chat_template import load_chat_template, string_contents
from .errors import InvalidRequestError
from .lora_request import LoRARequest
from .request import RequestOutput
from .sampling_params import SamplingParams


class ChatMethods:
    """Mixed into `LLM`: the tokenizer and `generate` are `LLM`'s."""

    tokenizer: PreTrainedTokenizerBase
    generate: Callable[..., list[RequestOutput]]

    def chat(self, conversations: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             chat_template: str | os.PathLike | None = None, chat_template_content_format: str = "auto",
             chat_template_kwargs: dict[str, Any] | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None) -> list[RequestOutput]:
        """Generate replies to conversations rendered with the chat template: the model's (or `LLM`'s
        `chat_template`), or this call's `chat_template` (a file or the template text, as vLLM's).
        Messages' content may be OpenAI's list of text parts (joined by newlines: vLLM's content format
        "string", which "auto" is here; "openai" is refused). chat_template_kwargs: variables for the template
        (`{"enable_thinking": False}`); continue_final_message: the reply continues the last message (with
        add_generation_prompt=False); tools: OpenAI tool definitions, for templates that render them;
        lora_request: as `generate`'s. The text is the model's whole reply, reasoning included
        (`conveyor.reasoning` splits it)."""
        if chat_template_content_format not in ("auto", "string"):
            raise ValueError(f"chat_template_content_format={chat_template_content_format!r}: message contents reach "
                             "the template as one string ('auto' or 'string')")
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        template = load_chat_template(chat_template) if chat_template is not None else None
        prompts = [self.render_chat(c, tools=tools, chat_template=template, add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message,
                                    chat_template_kwargs=chat_template_kwargs)
                   for c in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def render_chat(self, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    chat_template: str | None = None, **options: Any) -> list[int]:
        """Token ids of the conversation through the chat template (with `tools`, as transformers'), or
        through `chat_template` (the template text); `options` as `render_chat_text`'s."""
        text = self.render_chat_text(conversation, tools, chat_template, **options)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def render_chat_text(self, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                         chat_template: str | None = None, add_generation_prompt: bool = True,
                         continue_final_message: bool = False,
                         chat_template_kwargs: dict[str, Any] | None = None,
                         documents: list[dict[str, Any]] | None = None) -> str:
        """The conversation through the chat template, as the text `render_chat` tokenizes (a server
        checks its length before it spends time tokenizing it); `documents` go to a RAG template (vLLM's).
        `InvalidRequestError` naming the parameter for options that cannot go together or a template
        variable the renderer owns."""
        if not conversation:
            raise ValueError("conversation is empty: it needs at least one message")
        if add_generation_prompt and continue_final_message:
            raise InvalidRequestError("continue_final_message continues the last message, add_generation_prompt starts "
                                      "a new one: set add_generation_prompt to false", param="continue_final_message")
        kwargs = dict(chat_template_kwargs or {})
        owned = sorted(set(kwargs) & renderer_parameters(self.tokenizer))
        if owned:
            raise InvalidRequestError(f"chat_template_kwargs cannot set {', '.join(owned)}: the renderer's own "
                                      "parameters are set by the request's fields", param="chat_template_kwargs")
        return self.tokenizer.apply_chat_template(string_contents(conversation), tools=tools, documents=documents,
                                                  chat_template=chat_template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=continue_final_message, **kwargs)


def renderer_parameters(tokenizer: PreTrainedTokenizerBase) -> set[str]:
    """The named parameters of the tokenizer's `apply_chat_template` (not template variables)."""
    signature = inspect.signature(tokenizer.apply_chat_template)
    return {name for name, p in signature.parameters.items()
            if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)}
