"""Image-text checkpoints run as their language model alone (docs/models.md): text in, text out. Their
config's `text_config` is the language model's; their tensors are read under a `*ForCausalLM`'s names and the
vision tower's and the projector's are never read. Requests with images are refused by the server's chat
handling (text content parts only)."""

from __future__ import annotations

import logging

import transformers

logger = logging.getLogger(__name__)

# Image-text checkpoints whose language model Conveyor runs alone (text in, text out; images are refused):
# the wrapper's model type -> its language model's (Mistral 3: Mistral Small 3.x's, or Ministral 3's). (Qwen's
# multimodal RoPE gives text alone the positions of plain RoPE: every section reads the same position.)
MULTIMODAL_TEXT = {"gemma3": ("gemma3_text",), "mistral3": ("mistral", "ministral3"), "qwen2_vl": ("qwen2_vl_text",),
                   "qwen2_5_vl": ("qwen2_5_vl_text",), "qwen3_vl": ("qwen3_vl_text",)}
# Their language model's tensor names (transformers' layouts) -> a `*ForCausalLM`'s; the rest (vision tower,
# projector) is not read.
_LANGUAGE_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                      ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."),
                      ("model.layers.", "model.layers."), ("model.embed_tokens.", "model.embed_tokens."),
                      ("model.norm.", "model.norm."))


def text_config(config: transformers.PretrainedConfig) -> transformers.PretrainedConfig:
    """An image-text checkpoint's language model config (`MULTIMODAL_TEXT`), else `config`."""
    text = getattr(config, "text_config", None)
    if text is None or text.model_type not in MULTIMODAL_TEXT.get(config.model_type, ()):
        return config
    text.multimodal_type = config.model_type  # (says where its tensors are)
    logger.info("%s is an image-text checkpoint: running its language model (%s) alone; requests with images are "
                "not supported", config.model_type, text.model_type)
    return text


def language_model_name(name: str) -> str | None:
    """A `*ForCausalLM` name for an image-text checkpoint's tensor, None for the parts not read."""
    for prefix, replacement in _LANGUAGE_PREFIXES:
        if name.startswith(prefix):
            return replacement + name[len(prefix):]
    return None
