"""Mixture-of-experts GGUF files as llama.cpp's converter writes them (stacked `ffn_*_exps`, the router
`ffn_gate_inp`, Qwen2-MoE's `*_shexp`, Mixtral as `llama` with experts and its Q/K rows permuted):
written with the `gguf` package from the tiny checkpoints and loaded back, F32 and Q8_0."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import safetensors.torch
import torch
import transformers

from conveyor import LLM, SamplingParams
from conveyor.config import ContinuousBatchingConfig
from conveyor.layers.quantization.linear import QuantLinear
from conveyor.layers.quantization.tensors import GGMLType, QuantizedTensor
from conveyor.models.loader import load_checkpoint
from conveyor.models.moe import expert_count, hf_expert_names

from tests.gguf_writer import gguf_header
from tests.utils import (MOE_CONFIGS, VOCAB, TinyModel, agreement, assert_greedy_match, greedy_ids, hf_greedy,
                         next_token_logprobs, random_prompts)

pytestmark = pytest.mark.usefixtures("one_thread")

ARCHITECTURES = {"mixtral": "llama", "olmoe": "olmoe", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe",
                 "granitemoe": "granitemoe", "ernie4_5_moe": "ernie4_5-moe"}


def split_granite_experts(sd: dict, config: transformers.PretrainedConfig) -> dict:
    """Granite MoE's stacked experts by Mixtral's names, as llama.cpp's converter splits them (gate/up in two)."""
    sd = dict(sd)
    for i in range(config.num_hidden_layers):
        m = f"model.layers.{i}.block_sparse_moe."
        inputs, outputs = sd.pop(m + "input_linear.weight"), sd.pop(m + "output_linear.weight")
        sd[m + "gate.weight"] = sd.pop(m + "router.layer.weight")
        half = inputs.shape[1] // 2
        for e in range(config.num_local_experts):
            sd[f"{m}experts.{e}.w1.weight"], sd[f"{m}experts.{e}.w3.weight"] = inputs[e][:half], inputs[e][half:]
            sd[f"{m}experts.{e}.w2.weight"] = outputs[e]
    return sd


def write_moe_gguf(path: Path, model: TinyModel, qtype: GGMLType | None = None) -> None:
    """The tiny checkpoint as llama.cpp's converter writes it; `qtype` quantizes every matrix but the
    routers (which llama.cpp keeps F32) with gguf's own quantizer."""
    config = model.reference.config
    sd = {k: v.numpy() for k, v in safetensors.torch.load_file(model.path / "model.safetensors").items()}
    arch, kind = ARCHITECTURES[config.model_type], config.model_type
    block, gate, up, down = hf_expert_names(kind)
    head_dim = model.reference.model.layers[0].self_attn.head_dim
    writer = gguf_header(path, arch, config)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_expert_count(expert_count(config))
    writer.add_expert_used_count(config.num_experts_per_tok)
    if kind in ("qwen2_moe", "qwen3_moe", "ernie4_5_moe"):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if kind == "ernie4_5_moe":
        writer.add_expert_shared_count(config.moe_num_shared_experts)
        writer.add_leading_dense_block_count(config.moe_layer_start_index)
        writer.add_interleave_moe_layer_step(config.moe_layer_interval)
    if kind == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if kind == "olmoe":
        writer.add_clamp_kqv(config.clip_qkv)
    if kind == "granitemoe":  # (the converter's names for the multipliers)
        writer.add_attention_scale(config.attention_multiplier)
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_logit_scale(config.logits_scaling)
    if kind == "granitemoe":
        sd = split_granite_experts(sd, config)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"w{i}" for i in range(VOCAB)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def permute(w: np.ndarray, heads: int) -> np.ndarray:  # llama.cpp's Q/K row order for `llama`
        if arch not in ("llama", "granitemoe"):
            return w
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    def add(name: str, w: np.ndarray, quantize: bool = True) -> None:
        if qtype is None or w.ndim < 2 or not quantize:
            writer.add_tensor(name, w.astype(np.float32))
        else:
            writer.add_tensor(name, gguf.quants.quantize(w.astype(np.float32), qtype), raw_dtype=qtype)

    add("token_embd.weight", sd["model.embed_tokens.weight"])
    add("output_norm.weight", sd["model.norm.weight"])
    add("output.weight", sd["lm_head.weight"])
    for i in range(config.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        add(b + "attn_norm.weight", sd[p + "input_layernorm.weight"])
        add(b + "attn_q.weight", permute(sd[p + "self_attn.q_proj.weight"], config.num_attention_heads))
        add(b + "attn_k.weight", permute(sd[p + "self_attn.k_proj.weight"], config.num_key_value_heads))
        add(b + "attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        add(b + "attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        for n, gguf_name in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output")):
            if f"{p}self_attn.{n}_proj.bias" in sd:
                add(f"{b}{gguf_name}.bias", sd[f"{p}self_attn.{n}_proj.bias"])
        for n in "qk":
            if f"{p}self_attn.{n}_norm.weight" in sd:
                add(f"{b}attn_{n}_norm.weight", sd[f"{p}self_attn.{n}_norm.weight"])
        add(b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        m = f"{p}{block}."
        if f"{m}gate.weight" not in sd:  # a dense layer
            for n in ("gate", "up", "down"):
                add(f"{b}ffn_{n}.weight", sd[f"{m}{n}_proj.weight"])
            continue
        add(b + "ffn_gate_inp.weight", sd[m + "gate.weight"], quantize=False)
        for n, hf in (("gate", gate), ("up", up), ("down", down)):
            add(f"{b}ffn_{n}_exps.weight", np.stack([sd[f"{m}experts.{e}.{hf}.weight"]
                                                     for e in range(expert_count(config))]))
        if f"{m}shared_expert_gate.weight" in sd:
            for n in ("gate", "up", "down"):
                add(f"{b}ffn_{n}_shexp.weight", sd[f"{m}shared_expert.{n}_proj.weight"])
            add(b + "ffn_gate_inp_shexp.weight", sd[m + "shared_expert_gate.weight"].reshape(-1))
        if kind == "ernie4_5_moe":  # its shared experts (ungated) and the bias that chooses the experts
            for n in ("gate", "up", "down"):
                add(f"{b}ffn_{n}_shexp.weight", sd[f"{m}shared_experts.{n}_proj.weight"])
            add(b + "exp_probs_b.bias", sd[m + "moe_statics.e_score_correction_bias"].reshape(-1))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


PROMPTS = random_prompts([1, 6, 19, 40, 90, 11], seed=7)


def load_and_generate(path: Path, **kwargs: object) -> tuple[list[list[int]], LLM]:
    """The model at `path` loaded, and its greedy ids for PROMPTS (every block back after)."""
    llm = LLM(path, config=ContinuousBatchingConfig(num_blocks=256, max_batch_tokens=48), **kwargs)
    outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False)
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_total_blocks
    return [o.token_ids for o in outs], llm


@pytest.mark.parametrize("kind", list(ARCHITECTURES))  # (LFM2-MoE's conv layers: its file in test_gguf_families)
def test_f32_gguf_equals_the_directory(moe_models: dict[str, TinyModel], kind: str, tmp_path: Path,
                                       gguf_tokenizer: None) -> None:
    model = moe_models[kind]
    path = tmp_path / f"{kind}.gguf"
    write_moe_gguf(path, model)
    ckpt, directory = load_checkpoint(path), load_checkpoint(model.path)
    assert ckpt.config.model_type == kind
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                "norm_topk_prob", "mlp_only_layers", "clip_qkv"):
        assert getattr(ckpt.config, key, None) == getattr(directory.config, key, None), key
    expected = directory.state_dict if kind != "granitemoe" else split_granite_experts(directory.state_dict,
                                                                                       directory.config)
    assert ckpt.state_dict.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(ckpt.state_dict[name], tensor), name
    ours, _ = load_and_generate(path, dtype="float32")
    assert ours == load_and_generate(model.path, dtype="float32")[0]


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_q8_gguf_experts_stay_quantized(kind: str, tmp_path: Path, gguf_tokenizer: None) -> None:
    """Q8_0 experts: kept as the file's blocks (one `QuantLinear` per expert), the router dense; the exact
    path on the file equals transformers on its dequantized weights; the kernels stay close to it (on
    weights at a trained model's scale, as the precision tests measure)."""
    model = TinyModel(kind, tmp_path / "smooth", MOE_CONFIGS[kind](initializer_range=0.05))
    path = tmp_path / f"{kind}-q8.gguf"
    write_moe_gguf(path, model, GGMLType.Q8_0)
    kept, dense = load_checkpoint(path, keep_quantized=True), load_checkpoint(path)
    block, gate, _, _ = hf_expert_names(kind)
    expert = kept.state_dict[f"model.layers.0.{block}.experts.1.{gate}.weight"]
    assert isinstance(expert, QuantizedTensor) and expert.type_name == "Q8_0"
    assert torch.equal(expert.dequantize(), dense.state_dict[f"model.layers.0.{block}.experts.1.{gate}.weight"])
    # transformers on the same (dequantized) weights: the file's tensors saved as a model directory
    reference_dir = tmp_path / "dequantized"
    shutil.copytree(model.path, reference_dir)
    safetensors.torch.save_file(dense.state_dict, reference_dir / "model.safetensors", metadata={"format": "pt"})
    reference = transformers.AutoModelForCausalLM.from_pretrained(reference_dir, attn_implementation="eager",
                                                                  experts_implementation="eager").eval()
    exact, exact_llm = load_and_generate(path, dtype="float32")
    for i, (prompt, ids) in enumerate(zip(PROMPTS, exact)):
        ref, logits = hf_greedy(reference, prompt, len(ids))
        assert_greedy_match(ids, ref, logits, f"{kind} Q8_0 exact path, prompt {i}")
    ours, llm = load_and_generate(path)
    assert llm.quantization == "gguf"
    moe = llm.engine.model.layers[0].mlp
    assert isinstance(moe.experts[0].gate_up_proj, QuantLinear)
    assert moe.experts[0].gate_up_proj.kernel.segments[0].type_name == "Q8_0"
    assert not isinstance(moe.router, QuantLinear)
    err = (next_token_logprobs(llm, PROMPTS) - next_token_logprobs(exact_llm, PROMPTS)).abs().max().item()
    assert err < 0.1, f"Q8_0 kernels vs the file's dequantized weights: {err:.3f}"
    assert agreement(greedy_ids(llm, PROMPTS), greedy_ids(exact_llm, PROMPTS)) >= 0.6
