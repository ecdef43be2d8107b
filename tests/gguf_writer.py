"""Tiny Hugging Face models written as GGUF files the way llama.cpp's converter (`convert_hf_to_gguf.py`)
writes each architecture: its metadata, gguf's own tensor-name map for the architecture, Llama's Q/K row
permutation to llama.cpp's RoPE layout, Gemma's norms stored plus one, Phi-3's fused tensors and LongRoPE
factor tensors, Llama 3's RoPE factors as `rope_freqs`; matrices in a type of gguf's own quantizer. And a
small random GGUF written tensor by tensor, for loader tests that need no Hugging Face model."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers

from conveyor.models.lfm2 import mlp_width

from tests.utils import VOCAB, TinyModel
from tools import random_gguf

QType = gguf.GGMLQuantizationType


def hf_state(model: transformers.PreTrainedModel, head: bool = False) -> dict[str, np.ndarray]:
    """The tensors a checkpoint directory holds (a tied head is not stored, unless `head`)."""
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings and not head:
        state.pop("lm_head.weight", None)
    return state


def toy_vocab(writer: gguf.GGUFWriter) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"w{i}" for i in range(VOCAB)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def llama3_factors(config: transformers.PretrainedConfig, rope: dict) -> np.ndarray:
    """What `convert_hf_to_gguf.py` computes for Llama 3's scaling, op for op."""
    dim = config.hidden_size // config.num_attention_heads
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high, old = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"], 8192
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


def gguf_header(path: Path, arch: str, config: transformers.PretrainedConfig) -> gguf.GGUFWriter:
    """A writer with the shape keys every architecture's converter writes (the KV heads' where there are
    such: not an encoder's)."""
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(mlp_width(config) if config.model_type == "lfm2" else config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    if config.model_type in ("lfm2", "lfm2_moe", "granitemoehybrid"):  # (KV heads a layer, none in a state layer)
        w.add_head_count_kv([config.num_key_value_heads * (t in ("full_attention", "attention"))
                             for t in config.layer_types])
    elif getattr(config, "num_key_value_heads", None) is not None:
        w.add_head_count_kv(config.num_key_value_heads)
    return w


def write_gguf(path: Path, model: transformers.PreTrainedModel, arch: str, types: QType | dict[str, QType],
               vocab: Callable[[gguf.GGUFWriter], None] = toy_vocab, drop: tuple[str, ...] = (),
               extra: Callable[[gguf.GGUFWriter], None] | None = None, head: bool = False) -> None:
    """`model` as llama.cpp's converter writes it for `arch`: matrices in `types` (one type, F32 or a block
    type, or one per GGUF tensor kind such as "attn_q", the rest F32); the vocabulary `vocab` writes; GGUF
    tensors `drop` left out and `extra` metadata added (broken files); `head`: an `output` tensor even for a
    tied head (the converter writes none)."""
    config = model.config
    rope = dict(config.rope_parameters)
    full = rope.get("full_attention", rope)
    w = gguf_header(path, arch, config)
    if arch in ("command-r", "cohere2"):  # (LayerNorms)
        w.add_layer_norm_eps(config.layer_norm_eps)
        w.add_logit_scale(config.logit_scale)
    elif arch == "starcoder2":
        w.add_layer_norm_eps(config.norm_epsilon)
    elif arch in ("lfm2", "lfm2moe"):
        w.add_layer_norm_rms_eps(config.norm_eps)
        w.add_shortconv_l_cache(config.conv_L_cache)
    else:
        w.add_layer_norm_rms_eps(config.rms_norm_eps)
    if arch == "cohere2":
        w.add_sliding_window(config.sliding_window)
    if arch == "hunyuan-dense":  # (the converter's base stretched by the NTK alpha, no scaling)
        dim = config.head_dim
        w.add_rope_freq_base(full["rope_theta"] * full["alpha"] ** (dim / (dim - 2)))
        full = {"rope_type": "default"}
    elif arch != "gemma2":  # (the Gemma 2 converter writes no base: llama.cpp's default 10000)
        w.add_rope_freq_base(full["rope_theta"])
    if getattr(config, "head_dim", None) and arch != "phi3":
        w.add_key_length(config.head_dim)
        w.add_value_length(config.head_dim)
    if full["rope_type"] == "llama3":  # the converter's Llama 3 factors, a tensor
        w.add_tensor("rope_freqs.weight", llama3_factors(config, full))
    if full["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    elif full["rope_type"] == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(full["factor"])
        w.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
        if "beta_fast" in full:
            w.add_rope_scaling_yarn_beta_fast(full["beta_fast"])
        if "beta_slow" in full:
            w.add_rope_scaling_yarn_beta_slow(full["beta_slow"])
    if arch == "mistral3" and "llama_4_scaling_beta" in full:  # (Ministral 3)
        w.add_rope_scaling_yarn_log_mul(full["mscale_all_dim"])
        w.add_attn_temperature_scale(full["llama_4_scaling_beta"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(config.attn_logit_softcapping)
        w.add_final_logit_softcapping(config.final_logit_softcapping)
        w.add_sliding_window(config.sliding_window)
    if arch == "gemma3":
        w.add_sliding_window(config.sliding_window)
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    if arch in ("olmo2", "exaone4") and getattr(config, "sliding_window", None):  # OLMo 3, EXAONE 4.0 32B
        w.add_sliding_window(config.sliding_window)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in config.layer_types])
    if arch in ("granite", "granitehybrid"):  # (the converter's names for the multipliers)
        w.add_attention_scale(config.attention_multiplier)
        w.add_embedding_scale(config.embedding_multiplier)
        w.add_residual_scale(config.residual_multiplier)
        w.add_logit_scale(config.logits_scaling)
    tensors = hf_state(model, head)
    if arch == "lfm2moe":
        tensors = lfm2_moe_tensors(w, config, tensors)
    if arch == "granitehybrid":
        tensors = granite_hybrid_tensors(w, config, tensors)
    if arch == "glm4":  # (the rotated dimensions: half of each head)
        w.add_rope_dimension_count(int(config.head_dim * full["partial_rotary_factor"]))
    if arch == "phi3":
        head_dim = config.hidden_size // config.num_attention_heads
        w.add_rope_dimension_count(int(head_dim * full.get("partial_rotary_factor", 1.0)))
        w.add_rope_scaling_orig_ctx_len(full.get("original_max_position_embeddings", config.max_position_embeddings))
        w.add_sliding_window(config.sliding_window or 0)
        if full["rope_type"] == "longrope":
            original = full["original_max_position_embeddings"]
            scale = config.max_position_embeddings / original
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
            for kind in ("long", "short"):
                if f"rope_factors_{kind}.weight" not in drop:
                    w.add_tensor(f"rope_factors_{kind}.weight", np.asarray(full[f"{kind}_factor"], dtype=np.float32))
    vocab(w)
    if extra is not None:
        extra(w)
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch),
                                     config.num_hidden_layers)
    for name, data in tensors.items():
        gguf_name = name if name.startswith("blk.") else names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, f"{arch}: no GGUF name for {name}"
        if gguf_name in drop:
            continue
        permuted = ("llama", "smollm3", "granite", "granitehybrid", "mistral3", "arcee")  # (llama.cpp's RoPE layout)
        if arch in permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            rows = data.shape[0] // heads // 2
            data = data.reshape(heads, 2, rows, *data.shape[1:]).swapaxes(1, 2).reshape(data.shape)
        if arch in ("gemma", "gemma2", "gemma3") and name.endswith("norm.weight"):
            data = data + 1
        if arch in ("lfm2", "lfm2moe") and name.endswith("conv.conv.weight"):  # (the converter's `[hidden, L]`)
            data = data.squeeze(1)
        qtype = types.get(gguf_name.split(".")[-2], QType.F32) if isinstance(types, dict) else types
        # (Command R+'s q/k norms are 2-D; LFM2's conv kernels too narrow for blocks: F32, as llama.cpp keeps them)
        if data.ndim >= 2 and qtype != QType.F32 and not name.endswith("norm.weight") and data.shape[-1] % 32 == 0:
            w.add_tensor(gguf_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name, data.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def lfm2_moe_tensors(w: gguf.GGUFWriter, config: transformers.PretrainedConfig,
                     tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """LFM2-MoE's experts stacked, and its expert keys, as llama.cpp's converter writes them."""
    w.add_expert_count(config.num_experts)
    w.add_expert_used_count(config.num_experts_per_tok)
    w.add_expert_feed_forward_length(config.moe_intermediate_size)
    w.add_leading_dense_block_count(config.num_dense_layers)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    out, inter = {}, config.moe_intermediate_size
    for name, data in tensors.items():  # (transformers holds each layer's experts stacked: gate/up, and down)
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith(".experts.gate_up_proj"):
            out[f"layers.{layer}.feed_forward.experts.w1.weight"] = data[:, :inter]
            out[f"layers.{layer}.feed_forward.experts.w3.weight"] = data[:, inter:]
        elif name.endswith(".experts.down_proj"):
            out[f"layers.{layer}.feed_forward.experts.w2.weight"] = data
        else:
            out[name + (".bias" if name.endswith(".expert_bias") else "")] = data
    return out


def granite_hybrid_tensors(w: gguf.GGUFWriter, config: transformers.PretrainedConfig,
                           tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Granite 4.0's keys and tensors as llama.cpp's converter writes them (`GraniteHybridModel`): the Mamba-2
    layers' shape, A as `-exp(A_log)`, the convolution squeezed, the norm a row per group; the shared MLP split
    into gate and up (`ffn_*` in a dense model, `ffn_*_shexp` beside experts); the experts' gate/up split."""
    inner = config.mamba_n_heads * config.mamba_d_head
    w.add_ssm_conv_kernel(config.mamba_d_conv)
    w.add_ssm_state_size(config.mamba_d_state)
    w.add_ssm_group_count(config.mamba_n_groups)
    w.add_ssm_inner_size(inner)
    w.add_ssm_time_step_rank(config.mamba_n_heads)
    w.add_expert_shared_feed_forward_length(config.shared_intermediate_size)
    w.add_rope_scaling_finetuned(config.position_embedding_type == "rope")
    experts = config.num_local_experts
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(config.num_experts_per_tok)
    out, shared, inter = {}, "_shexp" if experts else "", config.intermediate_size
    for name, data in tensors.items():
        parts = name.split(".")
        blk = f"blk.{parts[2]}." if name.startswith("model.layers.") else ""
        leaf = ".".join(parts[3:])
        if leaf == "mamba.A_log":
            out[f"{blk}ssm_a"] = -torch.exp(torch.from_numpy(data)).numpy()[:, None]
        elif leaf == "mamba.D":
            out[f"{blk}ssm_d"] = data[:, None]
        elif leaf == "mamba.dt_bias":
            out[f"{blk}ssm_dt.bias"] = data
        elif leaf == "mamba.conv1d.weight":
            out[f"{blk}ssm_conv1d.weight"] = data.squeeze(1)
        elif leaf == "mamba.norm.weight":
            out[f"{blk}ssm_norm.weight"] = data.reshape(config.mamba_n_groups, -1)
        elif leaf == "shared_mlp.input_linear.weight":
            half = data.shape[0] // 2
            out[f"{blk}ffn_gate{shared}.weight"], out[f"{blk}ffn_up{shared}.weight"] = data[:half], data[half:]
        elif leaf == "shared_mlp.output_linear.weight":
            out[f"{blk}ffn_down{shared}.weight"] = data
        elif leaf == "block_sparse_moe.experts.gate_up_proj":
            out[f"{blk}ffn_gate_exps.weight"], out[f"{blk}ffn_up_exps.weight"] = data[:, :inter], data[:, inter:]
        elif leaf == "block_sparse_moe.experts.down_proj":
            out[f"{blk}ffn_down_exps.weight"] = data
        elif leaf == "block_sparse_moe.router.weight":
            out[f"{blk}ffn_gate_inp.weight"] = data
        else:  # (named by gguf's map: attention, norms, the Mamba layers' projections and conv bias)
            out[name] = data
    return out


# attn_v in another type than q and k: a fused qkv of two segments, as K-quant files have.
GGUF_TYPES = {"attn_q": QType.Q4_1, "attn_k": QType.Q4_1, "attn_v": QType.Q8_0, "attn_output": QType.Q4_0,
              "ffn_gate": QType.Q4_1, "ffn_up": QType.Q4_1, "ffn_down": QType.Q8_0, "token_embd": QType.Q8_0,
              "output": QType.Q8_0}


def write_quantized_gguf(path: Path, model: TinyModel, types: dict[str, QType]) -> None:
    """The tiny Llama as llama.cpp writes it: Q/K rows permuted to its RoPE layout, matrices quantized
    with gguf's own quantizer (`types`: by GGUF tensor kind, the rest F32), the LM head its own tensor."""
    write_gguf(path, model.reference, "llama", types, head=True)


def tiny_head_dim(arch: str) -> int:
    """Qwen3's head_dim is independent of hidden/heads; 16 here, so it must come from key_length."""
    return 16 if arch == "qwen3" else 32 // 4


def write_tiny_gguf(path: Path, arch: str) -> None:
    """A small random-weight GGUF (float32, untied head) for architectures without a real fixture."""
    rng = np.random.default_rng(0)
    hidden, n_head, n_kv, ffn, vocab = 32, 4, 2, 48, 16
    head_dim = tiny_head_dim(arch)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(2)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    if arch == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(vocab)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def add(name: str, *shape: int) -> None:
        writer.add_tensor(name, rng.standard_normal(shape, dtype=np.float32))

    add("token_embd.weight", vocab, hidden)
    add("output_norm.weight", hidden)
    add("output.weight", vocab, hidden)
    add("rope_freqs.weight", head_dim // 2)  # not a model parameter: must be ignored
    for i in range(2):
        add(f"blk.{i}.attn_norm.weight", hidden)
        add(f"blk.{i}.attn_q.weight", n_head * head_dim, hidden)
        add(f"blk.{i}.attn_k.weight", n_kv * head_dim, hidden)
        add(f"blk.{i}.attn_v.weight", n_kv * head_dim, hidden)
        add(f"blk.{i}.attn_output.weight", hidden, n_head * head_dim)
        add(f"blk.{i}.ffn_norm.weight", hidden)
        add(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        add(f"blk.{i}.ffn_up.weight", ffn, hidden)
        add(f"blk.{i}.ffn_down.weight", hidden, ffn)
        if arch == "qwen2":
            add(f"blk.{i}.attn_q.bias", n_head * head_dim)
            add(f"blk.{i}.attn_k.bias", n_kv * head_dim)
            add(f"blk.{i}.attn_v.bias", n_kv * head_dim)
        if arch == "qwen3":
            add(f"blk.{i}.attn_q_norm.weight", head_dim)
            add(f"blk.{i}.attn_k_norm.weight", head_dim)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# The types gguf cannot quantize (the K-quants, the IQ4 types), and the byte offsets of each block's fp16
# scales (d, and dmin where there is one): their tensors are written as random blocks.
RANDOM_BLOCK_SCALES = {QType.Q2_K: (80, 82), QType.Q3_K: (108,), QType.Q4_K: (0, 2), QType.Q5_K: (0, 2),
                       QType.Q6_K: (208,), QType.IQ4_NL: (0,), QType.IQ4_XS: (0,)}


def random_blocks(qtype: QType, rows: int, cols: int, seed: int = 0, scale: float = 0.01) -> np.ndarray:
    """uint8 [rows, row bytes] of well-formed random blocks: every byte random but the fp16 scales,
    drawn from [0.5, 1.5] x `scale` (random bytes there would be infinities and NaNs)."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for at in RANDOM_BLOCK_SCALES[qtype]:
        d = (rng.uniform(0.5, 1.5, size=(rows, cols // block)) * scale).astype(np.float16)
        raw[..., at:at + 2] = d.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def write_random_block_gguf(path: Path, qtype: QType) -> int:
    """tools/random_gguf's tiny Llama with every matrix but the embedding (Q8_0) in random blocks of
    `qtype`; the bytes of those matrices in the file."""
    shape = random_gguf.SHAPES["tiny"]
    writer = gguf.GGUFWriter(path, shape.arch)
    random_gguf.header(writer, shape)
    matrix_bytes = 0
    for i, (name, dims, matrix) in enumerate(random_gguf.tensors(shape)):
        if not matrix:
            writer.add_tensor(name, np.ones(dims, dtype=np.float32))
        elif name == "token_embd.weight":
            values = np.random.default_rng(i).standard_normal(dims).astype(np.float32) * 0.02
            writer.add_tensor(name, gguf.quants.quantize(values, QType.Q8_0), raw_dtype=QType.Q8_0)
        else:
            data = random_blocks(qtype, *dims, seed=i, scale=1e-3)
            writer.add_tensor(name, data, raw_dtype=qtype)
            matrix_bytes += data.nbytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return matrix_bytes


def write_gpt_oss_gguf(path: Path, model: transformers.PreTrainedModel, experts: QType) -> None:
    """A gpt-oss model as llama.cpp's converter writes it: the experts' gate and up apart (the checkpoint
    interleaves their columns) as `nn.Linear` rows, stacked, in `experts` (MXFP4 as the released files), with
    their biases; the router with its bias; sinks; `post_attention_norm`; YaRN and the window as metadata."""
    config = model.config
    rope = dict(config.rope_parameters)
    w = gguf_header(path, "gpt-oss", config)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_expert_count(config.num_local_experts)
    w.add_expert_used_count(config.num_experts_per_tok)
    w.add_expert_feed_forward_length(config.intermediate_size)
    w.add_sliding_window(config.sliding_window)
    toy_vocab(w)
    state = hf_state(model, head=True)
    w.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", state["model.norm.weight"])
    w.add_tensor("output.weight", state["lm_head.weight"])
    names = {"input_layernorm.weight": "attn_norm.weight", "self_attn.sinks": "attn_sinks.weight",
             "post_attention_layernorm.weight": "post_attention_norm.weight",
             "mlp.router.weight": "ffn_gate_inp.weight", "mlp.router.bias": "ffn_gate_inp.bias"}
    for p in "qkvo":
        for kind in ("weight", "bias"):
            names[f"self_attn.{p}_proj.{kind}"] = f"attn_{'output' if p == 'o' else p}.{kind}"
    for i in range(config.num_hidden_layers):
        src = f"model.layers.{i}."
        for hf, name in names.items():
            w.add_tensor(f"blk.{i}.{name}", state[src + hf])
        gate_up, gate_up_bias = state[src + "mlp.experts.gate_up_proj"], state[src + "mlp.experts.gate_up_proj_bias"]
        stacked = {"ffn_gate_exps": gate_up[:, :, 0::2], "ffn_up_exps": gate_up[:, :, 1::2],
                   "ffn_down_exps": state[src + "mlp.experts.down_proj"]}
        biases = {"ffn_gate_exps": gate_up_bias[:, 0::2], "ffn_up_exps": gate_up_bias[:, 1::2],
                  "ffn_down_exps": state[src + "mlp.experts.down_proj_bias"]}
        for name, matrices in stacked.items():
            rows = np.ascontiguousarray(matrices.transpose(0, 2, 1))  # x @ W -> nn.Linear rows
            if experts == QType.F32:
                w.add_tensor(f"blk.{i}.{name}.weight", rows)
            else:
                w.add_tensor(f"blk.{i}.{name}.weight", gguf.quants.quantize(rows, experts), raw_dtype=experts)
            w.add_tensor(f"blk.{i}.{name}.bias", np.ascontiguousarray(biases[name]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
