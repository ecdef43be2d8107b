"""Image-text checkpoints (Gemma 3's, Mistral 3's, Qwen2.5-VL's and Qwen3-VL's `*ForConditionalGeneration`, as
`google/gemma-3-4b-it`, Mistral Small 3.x and `Qwen/Qwen2.5-VL-7B-Instruct` ship) run as their language model
alone: its tensors read under a `*ForCausalLM`'s names, the vision tower's and the projector's never read; greedy
ids equal transformers' image-text model on text prompts (fp32; Qwen's multimodal RoPE positions every section of
a text token alike)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from conveyor import LLM, ContinuousBatchingConfig, SamplingParams
from conveyor.models.loader import load_checkpoint

from tests.utils import TinyModel, all_free, assert_greedy_match, hf_greedy, random_prompts, tiny_tokenizer

IMAGE_TOKEN = 299  # (never in the prompts below: no image features are asked for)
TEXT_TYPES = {"gemma3": "gemma3_text", "mistral": "mistral", "ministral3": "ministral3", "qwen2": "qwen2_5_vl_text",
              "qwen3": "qwen3_vl_text"}


def image_text_model(text: transformers.PreTrainedModel, kind: str) -> transformers.PreTrainedModel:
    """The image-text wrapper of `kind` around a tiny vision tower, with `text`'s language model weights."""
    torch.manual_seed(3)
    if kind == "gemma3":
        vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                 num_attention_heads=2, image_size=28, patch_size=14)
        config = transformers.Gemma3Config(text_config=text.config.to_dict(), vision_config=vision.to_dict(),
                                           mm_tokens_per_image=4, image_token_index=IMAGE_TOKEN,
                                           boi_token_index=297, eoi_token_index=298)
        model = transformers.Gemma3ForConditionalGeneration(config)
    elif kind.startswith("qwen"):
        half = text.config.head_dim // 2 if kind == "qwen3" else text.config.hidden_size // 8  # (head_dim / 2)
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [half - 2 * (half * 3 // 8),
                                                                                 half * 3 // 8, half * 3 // 8]}
        text_config = text.config.to_dict() | {"rope_parameters": rope}
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14)
        if kind == "qwen2":
            config = transformers.Qwen2_5_VLConfig(text_config=text_config, image_token_id=IMAGE_TOKEN,
                                                   vision_config=vision | {"fullatt_block_indexes": [0]})
            model = transformers.Qwen2_5_VLForConditionalGeneration(config)
        else:
            config = transformers.Qwen3VLConfig(text_config=text_config, image_token_id=IMAGE_TOKEN,
                                                vision_config=vision | {"deepstack_visual_indexes": [0]})
            model = transformers.Qwen3VLForConditionalGeneration(config)
    else:
        vision = transformers.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                  num_attention_heads=2, image_size=28, patch_size=14, head_dim=16)
        config = transformers.Mistral3Config(text_config=text.config.to_dict(), vision_config=vision.to_dict(),
                                             image_token_index=IMAGE_TOKEN)
        model = transformers.Mistral3ForConditionalGeneration(config)
    model.config.text_config._attn_implementation = "eager"
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    return model.eval()


@pytest.mark.parametrize("kind", ["gemma3", "mistral", "ministral3", "qwen2", "qwen3"])
def test_an_image_text_checkpoint_runs_its_language_model(tiny_models: dict[str, TinyModel], kind: str,
                                                          tmp_path: Path) -> None:
    reference = image_text_model(tiny_models[kind].reference, kind)
    reference.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    checkpoint = load_checkpoint(tmp_path, tokenizer=False)
    assert checkpoint.config.model_type == TEXT_TYPES[kind]
    assert all(name.startswith(("model.layers.", "model.embed_tokens.", "model.norm.", "lm_head."))
               for name in checkpoint.state_dict)  # the vision tower and the projector are not read
    llm = LLM(tmp_path, dtype="float32", config=ContinuousBatchingConfig(num_blocks=128, max_batch_tokens=16))
    prompts = [[t for t in p if t != IMAGE_TOKEN] for p in random_prompts([4, 11, 23, 37], seed=17)]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ref, logits = hf_greedy(reference, prompt, 10)
        assert_greedy_match(out.token_ids, ref, logits, f"{kind} image-text checkpoint")
    assert len({tuple(o.token_ids) for o in outs}) > 1  # (the prompts lead different ways: a real comparison)
    assert all_free(llm)
