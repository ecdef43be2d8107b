"""What the tests share, so that no test module imports another: tiny random models and their
transformers references, greedy runs and how closely they must agree, pool checks, and scenarios that
more than one layer's tests replay.

Fixtures built on these live in tests/conftest.py; servers in serving_helpers.py, GGUF files in
gguf_writer.py, attention references in attention_utils.py."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from conveyor import LLM, ContinuousBatchingConfig, SamplingParams
from conveyor.cache.allocator import FullAttentionCacheAllocator
from conveyor.cache.pool import NUM_RESERVED_CHUNKS, CachePool
from conveyor.layers.moe import SparseMoe
from conveyor.layers.quantization.linear import QuantLinear, bf16_kernel_max_rows

# -- tiny models ------------------------------------------------------------------------------------
VOCAB = 300
WINDOW = 8  # sliding window of the tiny sliding/hybrid models
TINY_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                   initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
GRANITE_HYBRID = TINY_COMMON | dict(
    num_hidden_layers=4, layer_types=["mamba", "mamba", "attention", "mamba"], mamba_n_heads=4, mamba_d_head=32,
    mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4, mamba_chunk_size=8, shared_intermediate_size=96,
    embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=4.0)
TINY_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**TINY_COMMON, tie_word_embeddings=False),
    "llama_tied": lambda: transformers.LlamaConfig(**TINY_COMMON, tie_word_embeddings=True),
    # Weights at a real model's scale (logits spread like a trained model's, not the large random ones
    # above): what the precision tests measure quality on.
    "llama_smooth": lambda: transformers.LlamaConfig(**(TINY_COMMON | {"initializer_range": 0.05}),
                                                     tie_word_embeddings=True),
    "qwen2": lambda: transformers.Qwen2Config(**TINY_COMMON, tie_word_embeddings=False),
    "qwen3": lambda: transformers.Qwen3Config(**TINY_COMMON, head_dim=32, tie_word_embeddings=False),
    "mistral": lambda: transformers.MistralConfig(**TINY_COMMON, sliding_window=None, tie_word_embeddings=False),
    # SmolLM3: layer 2 of 2 without RoPE (the released models: every fourth)
    "smollm3": lambda: transformers.SmolLM3Config(**TINY_COMMON, no_rope_layer_interval=2, tie_word_embeddings=False),
    "olmo2": lambda: transformers.Olmo2Config(**TINY_COMMON),
    "olmo3": lambda: transformers.Olmo3Config(  # layers: sliding, sliding, sliding, full (YaRN)
        **(TINY_COMMON | {"num_hidden_layers": 4}), sliding_window=WINDOW, rope_parameters={
            "full_attention": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                               "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    "granite": lambda: transformers.GraniteConfig(**TINY_COMMON, embedding_multiplier=3.0, residual_multiplier=0.5,
                                                  attention_multiplier=0.1, logits_scaling=4.0),
    # RoPE over consecutive pairs (reordered at load): ERNIE 4.5 with biases on every projection; GLM-4 and
    # GLM-4-0414 (norms after the blocks) rotating the first half of each head, q/k/v biases
    "ernie4_5": lambda: transformers.Ernie4_5Config(**TINY_COMMON, head_dim=16, use_bias=True,
                                                    tie_word_embeddings=False),
    "glm": lambda: transformers.GlmConfig(**TINY_COMMON, head_dim=16),
    "glm4": lambda: transformers.Glm4Config(**TINY_COMMON, head_dim=16),
    # Ministral 3: YaRN, and the queries scaled by Llama 4's temperature past 16 tokens (the released: 16,384)
    # Ministral 8B: sliding and full layers by `layer_types`; Seed-OSS: q/k/v biases, none on o
    "ministral": lambda: transformers.MinistralConfig(**TINY_COMMON, head_dim=16, sliding_window=WINDOW,
                                                      layer_types=["sliding_attention", "full_attention"],
                                                      rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
    "seed_oss": lambda: transformers.SeedOssConfig(**TINY_COMMON, head_dim=16),
    "internlm3": lambda: transformers.InternLM3Config(**TINY_COMMON, head_dim=16),
    "ministral3": lambda: transformers.Ministral3Config(**TINY_COMMON, head_dim=16, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}),
    # EXAONE 4.0: norms after the blocks, per-head q/k norms; the 32B's form: sliding layers, then a full NoPE one
    "exaone4": lambda: transformers.Exaone4Config(**(TINY_COMMON | {"num_hidden_layers": 4}), head_dim=16,
                                                  sliding_window=WINDOW, sliding_window_pattern=4,
                                                  tie_word_embeddings=False),
    "exaone4_global": lambda: transformers.Exaone4Config(**TINY_COMMON, head_dim=16, sliding_window=None,  # (1.2B)
                                                         layer_types=["full_attention"] * 2),
    # Hunyuan: q/k norms per head after RoPE; RoPE's base stretched by a fixed NTK alpha
    "hunyuan": lambda: transformers.HunYuanDenseV1Config(**TINY_COMMON, head_dim=16, rope_parameters={
        "rope_type": "dynamic", "alpha": 1000.0, "rope_theta": 10000.0, "factor": 1.0}),
    # Cohere: one LayerNorm feeding attention and the MLP side by side, RoPE over consecutive pairs, scaled
    # logits; Command R+'s q/k norms per head; Command R7B's sliding layers beside full NoPE ones
    "cohere": lambda: transformers.CohereConfig(**TINY_COMMON, logit_scale=0.25, use_qk_norm=True),
    "cohere2": lambda: transformers.Cohere2Config(**(TINY_COMMON | {"num_hidden_layers": 4}), logit_scale=0.25,
                                                  sliding_window=WINDOW),
    # StarCoder2: LayerNorms and every projection with biases, a plain GELU MLP, a sliding window
    "starcoder2": lambda: transformers.Starcoder2Config(**TINY_COMMON, sliding_window=WINDOW,
                                                        rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
    # Arcee's AFM: an MLP of no gate, relu(up(x)) squared
    "arcee": lambda: transformers.ArceeConfig(**TINY_COMMON, rope_parameters={"rope_type": "default",
                                                                              "rope_theta": 1e4}),
    "llama_rope_llama3": lambda: transformers.LlamaConfig(**TINY_COMMON, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2_rope_linear": lambda: transformers.Qwen2Config(**TINY_COMMON, rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    # LFM2: short-convolution layers (kernel 3, their state in the pool) around one attention layer, whose q/k
    # norms come before RoPE; the MLP's width adjusted (int(2 * 128 / 3) rounded up to 32: 96)
    "lfm2": lambda **kw: transformers.Lfm2Config(**(TINY_COMMON | {"num_hidden_layers": 4} | kw), block_multiple_of=32,
                                                 layer_types=["conv", "conv", "full_attention", "conv"]),
    # Granite 4.0-H: Mamba-2 layers (4 heads of 32, 2 groups, a state of 16, chunks of 8: the test prompts span
    # several) around one NoPE attention layer, the shared MLP after each; Granite's multipliers
    "granitemoehybrid": lambda **kw: transformers.GraniteMoeHybridConfig(**(GRANITE_HYBRID | kw), num_local_experts=0),
    # Sliding-window and hybrid models, windows far shorter than the test prompts.
    "mistral_sliding": lambda: transformers.MistralConfig(**TINY_COMMON, sliding_window=WINDOW,
                                                          tie_word_embeddings=False),
    "gemma": lambda: transformers.GemmaConfig(**TINY_COMMON, head_dim=16),  # (Gemma 1: Llama's layer, Gemma's norms)
    "gemma2": lambda: transformers.Gemma2Config(  # layers: sliding, full, sliding, full
        **(TINY_COMMON | {"num_hidden_layers": 4}), head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
        attn_logit_softcapping=3.0, final_logit_softcapping=5.0),
    "gemma3": lambda: transformers.Gemma3TextConfig(  # 5 sliding layers, then 1 full: groups of one layer
        **(TINY_COMMON | {"num_hidden_layers": 6}), head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
        rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 100000.0, "factor": 2.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}),
}

# Mixture-of-experts models (`moe_models`), kept out of TINY_CONFIGS so that only their tests build them.
MOE_COMMON = TINY_COMMON | {"tie_word_embeddings": False}
MOE_CONFIGS = {
    "mixtral": lambda **kw: transformers.MixtralConfig(**(MOE_COMMON | kw | {"intermediate_size": 64}),
                                                       num_local_experts=4, num_experts_per_tok=2),
    # q/k normalized over the whole projection, q/k/v clipped, q/k/v/o biases
    "olmoe": lambda **kw: transformers.OlmoeConfig(**(MOE_COMMON | kw | {"intermediate_size": 64}), num_experts=4,
                                                   num_experts_per_tok=2, clip_qkv=4.0, attention_bias=True),
    # a shared expert with its sigmoid gate; weights not renormalized; layer 1 dense; q/k/v biases
    "qwen2_moe": lambda **kw: transformers.Qwen2MoeConfig(
        **(MOE_COMMON | kw), moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=8,
        num_experts_per_tok=3, mlp_only_layers=[1]),
    # Granite's multipliers; the softmax over the top-k logits alone
    "granitemoe": lambda **kw: transformers.GraniteMoeConfig(
        **(MOE_COMMON | kw | {"intermediate_size": 64}), num_local_experts=4, num_experts_per_tok=2,
        embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=4.0),
    # RoPE over consecutive pairs; layer 0 dense; experts chosen with a correction bias; two shared experts
    "ernie4_5_moe": lambda **kw: transformers.Ernie4_5_MoeConfig(
        **(MOE_COMMON | kw | {"num_hidden_layers": 3}), head_dim=16, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, moe_num_shared_experts=2, moe_layer_start_index=1, moe_layer_interval=1),
    # LFM2-MoE: LFM2's conv and attention layers, the first dense, then 8 experts chosen by sigmoid scores plus a
    # per-expert bias (made non-zero by the tests), 3 renormalized and scaled
    "lfm2_moe": lambda **kw: transformers.Lfm2MoeConfig(
        **(MOE_COMMON | {"num_hidden_layers": 3, "routed_scaling_factor": 1.5} | kw), moe_intermediate_size=32,
        num_experts=8, num_experts_per_tok=3, num_dense_layers=1, layer_types=["conv", "full_attention", "conv"]),
    # Granite 4.0-H with experts (h-tiny's form): a Mamba and an attention layer (with RoPE), 4 experts routed by a
    # softmax over the top-2 logits beside the shared MLP
    "granitemoehybrid": lambda **kw: transformers.GraniteMoeHybridConfig(
        **(GRANITE_HYBRID | {"num_hidden_layers": 2, "layer_types": ["mamba", "attention"], "intermediate_size": 32,
                             "tie_word_embeddings": False} | kw),
        num_local_experts=4, num_experts_per_tok=2, position_embedding_type="rope"),
    # per-head q/k norms, 4 of 8 experts renormalized
    "qwen3_moe": lambda **kw: transformers.Qwen3MoeConfig(
        **(MOE_COMMON | kw), head_dim=32, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=4,
        norm_topk_prob=True),
}

# RoPE that depends on the sequence length (LongRoPE, dynamic NTK), switching at ROPE_SWITCH tokens.
ROPE_SWITCH = 32  # LongRoPE's original_max_position_embeddings, and the dynamic model's max_position_embeddings


def longrope(rotary_dim: int) -> dict:
    half = rotary_dim // 2
    return {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [1.5 + 0.7 * i for i in range(half)]}


PHI3 = TINY_COMMON | {"max_position_embeddings": 128}
ROPE_BY_LENGTH_CONFIGS = {
    # Phi-3-*-128k: full rotary, LongRoPE, untied head.
    "phi3_longrope": lambda: transformers.Phi3Config(**PHI3, original_max_position_embeddings=ROPE_SWITCH,
                                                     rope_scaling=longrope(16)),
    # Phi-4-mini: 3/4 of each head rotates, LongRoPE, tied embeddings.
    "phi4_mini": lambda: transformers.Phi3Config(**PHI3, original_max_position_embeddings=ROPE_SWITCH,
                                                 partial_rotary_factor=0.75, rope_scaling=longrope(12),
                                                 tie_word_embeddings=True),
    # Phi-4 (14B): plain RoPE; Phi-3-mini-4k: a sliding window.
    "phi4": lambda: transformers.Phi3Config(**PHI3),
    "phi3_sliding": lambda: transformers.Phi3Config(**PHI3, sliding_window=8),
    # Llama with dynamic NTK: its context is max_position_embeddings x factor.
    "llama_dynamic": lambda: transformers.LlamaConfig(**(TINY_COMMON | {"max_position_embeddings": ROPE_SWITCH}),
                                                      rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                                                       "factor": 2.0}),
}


def tiny_tokenizer(vocab_size: int = VOCAB) -> transformers.PreTrainedTokenizerFast:
    """Word-level tokenizer: token i is the word "w{i}"; 0-2 are unk/bos/eos."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, vocab_size)}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>")


# A chat template given in place of the model's own: other marker words, so a test sees which one applied.
USER_CHAT_TEMPLATE = ("{% for m in messages %}w7 {{ m['content'] }} w8 {% endfor %}"
                      "{% if add_generation_prompt %}w9{% endif %}")


# AMX CPUs take bf16 prefill to oneDNN's AMX matmul and to the attention kernel's tiles, neither of them
# batch-invariant (models/batch_invariance.py): a test that compares two runs' bits asks for it there.
INVARIANT: dict[str, bool] = {"batch_invariant": True} if bf16_kernel_max_rows() is not None else {}


class TinyModel:
    """A random HF model saved to `path` (from `TINY_CONFIGS[kind]`, or `config`); `reference` is the
    same model in transformers (eager, fp32)."""

    def __init__(self, kind: str, path: Path, config: transformers.PretrainedConfig | None = None) -> None:
        """`config`: another test's model (`kind` then only names it); else `TINY_CONFIGS[kind]`."""
        torch.manual_seed(0)
        config = config if config is not None else TINY_CONFIGS[kind]()
        config._attn_implementation = "eager"
        config._experts_implementation = "eager"  # mixture-of-experts models: the loop over experts
        self.reference = transformers.AutoModelForCausalLM.from_config(config).eval()
        self.reference.generation_config.eos_token_id = None
        self.reference.save_pretrained(path)
        tiny_tokenizer().save_pretrained(path)
        self.path = path

    def llm(self, dtype: str = "float32", quantization: str | None = None, **config: object) -> LLM:
        """The model in Conveyor; fp32 by default, the exact path the reference is compared with."""
        return LLM(self.path, dtype=dtype, quantization=quantization,
                   config=ContinuousBatchingConfig(**{"num_blocks": 256, **config}))


# gpt-oss's SwiGLU clamp (7.0 in the released models): low enough that the tiny model's gates reach it.
GPT_OSS_LIMIT = 2.0


def gpt_oss_config(**overrides: object) -> transformers.GptOssConfig:
    """4 layers, sliding and full alternating (transformers' default `layer_types`), YaRN (factor 4 over
    128 original positions), 8 experts, top-2."""
    return transformers.GptOssConfig(**(MOE_COMMON | {"num_hidden_layers": 4, "intermediate_size": 32,
                                                      "swiglu_limit": GPT_OSS_LIMIT} | overrides),
                                     head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=WINDOW,
                                     rope_parameters={
                                         "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128})


def make_gpt_oss(path: Path, embed_scale: float = 1.0, **overrides: object) -> TinyModel:
    """The tiny gpt-oss with sinks from -2 to 4 per layer (transformers initializes them near 0) and
    non-zero expert biases (initialized to 0), its embeddings times `embed_scale`, saved again."""
    model = TinyModel("gpt_oss", path, gpt_oss_config(**overrides))
    g = torch.Generator().manual_seed(5)
    scale = model.reference.config.initializer_range
    with torch.no_grad():
        model.reference.model.embed_tokens.weight.mul_(embed_scale)
        for layer in model.reference.model.layers:
            sinks = layer.self_attn.sinks
            sinks.copy_(torch.linspace(-2.0, 4.0, sinks.numel())[torch.randperm(sinks.numel(), generator=g)])
            for bias in (layer.mlp.experts.gate_up_proj_bias, layer.mlp.experts.down_proj_bias):
                bias.copy_(torch.randn(bias.shape, generator=g) * scale)
    model.reference.save_pretrained(path)
    return model


def make_smooth_gpt_oss(path: Path) -> TinyModel:
    """The tiny gpt-oss at a trained model's weight scale (as the precision tests' `llama_smooth`), the
    residual stream large against one expert's output as in a trained model: top-2 routing softmaxed over
    the two gives each expert half the block, so in a random model at this scale a near-tie that the
    rounding flips (bf16, int8 activations) swaps half of a layer's MLP (transformers' own bf16 run parted
    from its fp32 one by 0.58 in log-probability with the residual at the weights' scale)."""
    return make_gpt_oss(path, embed_scale=20.0, initializer_range=0.05)


# -- prompts, greedy runs and the transformers reference ----------------------------------------------
LENGTHS = [1, 5, 17, 33, 64, 100, 7, 250]  # prompt lengths of the reference comparisons
MAX_NEW = [12, 3, 20, 9, 16, 1, 24, 10]  # and the tokens each generates


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def greedy(n: int, ignore_eos: bool = True, **kw: object) -> SamplingParams:
    """Greedy sampling of `n` tokens (all `n` unless `ignore_eos=False`)."""
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=ignore_eos, **kw)


def greedy_ids(llm: LLM, prompts: list[list[int]], n: int = 12) -> list[list[int]]:
    """Each prompt's `n` greedy tokens, in one `generate`."""
    return [o.token_ids for o in llm.generate(prompts, greedy(n), use_tqdm=False)]


@torch.inference_mode()
def hf_greedy(model: transformers.PreTrainedModel, prompt: list[int], max_new_tokens: int,
              **kwargs: object) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation of one unpadded prompt, with its raw logits per step (on the CPU),
    on the model's device."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0, **kwargs)
    return out.sequences[0, len(prompt):].tolist(), torch.stack(out.logits)[:, 0].float().cpu()


def assert_greedy_match(ours: list[int], ref: list[int], ref_logits: torch.Tensor, label: str = "") -> None:
    """Token-for-token equality; a first difference is accepted only as a numerical tie
    (reference top-2 logits within 1e-4), which is reported as a warning."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            top2 = ref_logits[i].topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap < 1e-4, f"{label}: first difference at token {i}: ours {a}, reference {b} (top-2 gap {gap:.3g})"
            warnings.warn(f"{label}: numerical tie at token {i} (top-2 gap {gap:.2e}); ours {a}, reference {b}")
            return
    assert len(ours) == len(ref), f"{label}: length {len(ours)} vs reference {len(ref)}"


def run_and_compare(model: TinyModel, llm: LLM, prompts: list[list[int]], max_new: list[int], label: str) -> None:
    """`llm`'s greedy outputs, all in one batch, against the model's transformers reference, prompt by prompt."""
    compare_greedy(model.reference, llm, prompts, max_new, label)


def compare_greedy(reference: transformers.PreTrainedModel, llm: LLM, prompts: list[list[int]], max_new: list[int],
                   label: str) -> None:
    """`llm`'s greedy outputs, all in one batch, against `reference`'s, prompt by prompt."""
    params = [greedy(n) for n in max_new]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for i, (prompt, n, out) in enumerate(zip(prompts, max_new, outputs)):
        ref, logits = hf_greedy(reference, prompt, n)
        assert out.finish_reason == "length"
        assert out.prompt_token_ids == prompt
        assert_greedy_match(out.token_ids, ref, logits, f"{label} prompt {i}")


def assert_offloads_resume(model: "TinyModel", prompts: list[list[int]], max_new: int, swap: bool,
                           num_blocks: int) -> None:
    """A pool of `num_blocks` too small for all of `prompts` (pages of 4, 16 tokens a step): requests are
    offloaded and resumed (their pages swapped out and back, or recomputed) and give the reference's tokens;
    every block back."""
    llm = model.llm(page_size=4, num_blocks=num_blocks, max_batch_tokens=16, cpu_offload_space=1.0 if swap else 0.0)
    compare_greedy(model.reference, llm, prompts, [max_new] * len(prompts), f"offload swap={swap}")
    stats = llm.stats()
    assert stats.offloads > 0 and (stats.swap_ins > 0) == swap
    assert all_free(llm)


def agreement(ours: list[list[int]], ref: list[list[int]]) -> float:
    """Fraction of generated tokens before each sequence's first difference from the reference."""
    same = 0
    for a, b in zip(ours, ref):
        for x, y in zip(a, b):
            if x != y:
                break
            same += 1
    return same / sum(map(len, ref))


def next_token_logprobs(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    """`[prompts, vocab]` log-probabilities of each prompt's next token."""
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=1, temperature=0, logprobs=VOCAB), use_tqdm=False)
    table = torch.empty(len(prompts), VOCAB)
    for i, out in enumerate(outs):
        entry = out.logprobs[0]
        table[i] = torch.tensor([entry[t] for t in range(VOCAB)])
    return table


# -- how close the inexact modes must stay ------------------------------------------------------------
# Measured on the tiny "llama_smooth" model (tied head; weights at a trained model's scale), with a
# 2-4x margin: the largest next-token log-probability error allowed and the least greedy agreement
# (fraction of generated tokens before each sequence's first difference). bf16 against fp32
# (measured 0.011 and 1.0):
BF16_TOLERANCE, BF16_AGREEMENT = 0.04, 0.8
# Quantized modes (dtype "auto" resolved to fp32 as on a CPU without native bf16, and bf16), first
# against the fp32 exact path run on the same quantized-then-dequantized weights (what the kernels and
# the int8 activations add: measured 0.019/0.88 int8, 0.12/0.79 int4), then against the fp32 model
# itself (the weights' quantization too: measured 0.025/0.92 int8, 0.31-0.40/0.59 int4).
QUANT_MODES = {"int8": ((0.06, 0.7), (0.08, 0.7)), "int4": ((0.3, 0.6), (0.8, 0.4))}


def assert_mode_within_tolerance(model: TinyModel, quantization: str) -> LLM:
    """The model in bf16 with `quantization` ("none" for dense bf16) against fp32 by the limits above;
    returns the bf16 LLM, its (first sparse block's, where it has one) experts checked to be in that format."""
    prompts = random_prompts([5, 9, 14, 20, 3, 30, 11, 7, 25, 16, 8, 12], seed=41)
    fp32 = model.llm()
    llm = model.llm(dtype="bfloat16", quantization=quantization)
    block = next((mlp for layer in llm.engine.model.layers if (mlp := getattr(layer, "mlp", None)) is not None), None)
    assert quantization == "none" or block is None or isinstance(block.experts[0].gate_up_proj, QuantLinear)
    tolerance, least = (BF16_TOLERANCE, BF16_AGREEMENT) if quantization == "none" else QUANT_MODES[quantization][1]
    err = (next_token_logprobs(llm, prompts) - next_token_logprobs(fp32, prompts)).abs().max().item()
    assert err < tolerance, f"bf16/{quantization}: log-prob error {err:.3f}"
    rate = agreement(greedy_ids(llm, prompts), greedy_ids(fp32, prompts))
    assert rate >= least, f"bf16/{quantization}: greedy agreement {rate:.2f}"
    assert all_free(llm)
    return llm


def assert_grouped_equals_loop(block: SparseMoe, dtype: torch.dtype, weights: Callable[[torch.Tensor], Any],
                               fp32_tol: float = 1e-6) -> None:
    """`block` (hidden 64) with random weights moved into `weights`' tiles (biases kept): the native block
    (router, routing, experts, shared expert) against its PyTorch ops and loop over experts on 40 rows. fp32:
    the same sums; bf16 (where the loop rounds each expert's intermediates to bf16 and the block keeps them in
    fp32): both against the fp32 computation on the same bf16 weights, the block no further from it."""
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    reference = copy.deepcopy(block).to(dtype).float().requires_grad_(False)
    for expert in [*block.experts, *([block.shared_expert] if block.shared_expert is not None else [])]:
        for name in ("gate_up_proj", "down_proj"):
            dense = getattr(expert, name)
            tiled = QuantLinear([weights(dense.weight)], bias=dense.bias is not None, dtype=dtype)
            if dense.bias is not None:
                tiled.bias.data.copy_(dense.bias.data)
            setattr(expert, name, tiled)
    block = block.to(dtype)
    assert block.group_experts()
    x = torch.randn(40, 64).to(dtype)
    grouped, loads = block(x), []
    block.observer = loads.append
    block.block = None
    loop = block(x)
    assert sum(1 for n in loads[0] if n) >= 5
    if dtype == torch.float32:
        torch.testing.assert_close(grouped, loop, rtol=fp32_tol, atol=fp32_tol)
    else:
        exact = reference(x.float())
        native_err, loop_err = ((y.float() - exact).abs() for y in (grouped, loop))
        assert native_err.max() < 0.05 and loop_err.max() < 0.08, (native_err.max(), loop_err.max())
        assert native_err.mean() <= loop_err.mean(), (native_err.mean(), loop_err.mean())


# -- the KV pool --------------------------------------------------------------------------------------
def all_free(llm: LLM) -> bool:
    """Every block of the engine's pool is back (free or cached)."""
    return llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_total_blocks


def idle(llm: LLM) -> bool:
    """Every block back and no request left, as `llm.stats()` reports it."""
    stats = llm.stats()
    return stats.free_blocks == stats.total_blocks and not llm.engine.requests


def make_pool(num_chunks: int, page_size: int = 4) -> CachePool:
    """A CPU pool of one layer and one 1-wide head: room for the allocators' bookkeeping only."""
    return CachePool(num_chunks, page_size, num_layers=1, num_kv_heads=1, head_dim=1,
                     dtype=torch.float32, device=torch.device("cpu"))


def check_allocator_invariants(alloc: FullAttentionCacheAllocator) -> None:
    """Every block is uninitialized, held or cached, exactly one of them; ref counts are the holders;
    the hash index is one to one, over held and cached blocks only; a cached block is indexed or a tail
    (never held, never indexed); reserved chunks are never used."""
    pool, cache = alloc.pool, alloc.prefix_cache
    uninit = list(pool._free)
    cached = list(cache._cached)
    holders: dict[int, int] = {}
    for table in alloc.block_tables.values():
        assert len(table) == len(set(table)), "a block twice in one table"
        for b in table:
            holders[b] = holders.get(b, 0) + 1
    assert holders == alloc.ref_counts, "ref counts differ from the number of tables holding each block"
    assert all(n >= 1 for n in alloc.ref_counts.values())
    every = uninit + list(holders) + cached
    assert len(every) == len(set(every)), "a block in two states at once"
    assert sorted(every) == list(range(NUM_RESERVED_CHUNKS, pool.num_chunks)), "blocks lost, or reserved ones used"
    assert alloc.num_free_blocks == len(uninit) + len(cached)
    assert pool.num_free + alloc.num_cached_blocks + len(holders) == alloc.num_total_blocks
    assert {d: b for b, d in cache._digest_of.items()} == cache._block_of, "hash index not one to one"
    tails = set(cache._tail_of)
    assert set(cached) <= set(cache._digest_of) | tails, "a cached block neither indexed nor a tail"
    assert tails <= set(cached) and not tails & set(cache._digest_of), "a tail held, lost, or with a digest"
    assert {b for held in cache._tails.values() for b in held} == tails, "the tail index disagrees"
    assert set(cache._digest_of) <= set(holders) | set(cached), "an uninitialized block kept its digest"
    if not alloc.block_sharing:
        assert not cache._digest_of and not cached
        assert all(n == 1 for n in alloc.ref_counts.values()), "a block held twice without sharing"


# -- scenarios ----------------------------------------------------------------------------------------
PAGE = 4  # the page size shared_prefix_scenario is laid out for


def shared_prefix_scenario(llm: LLM, reference: transformers.PreTrainedModel,
                           logprobs: dict[str, list[float]] | None = None) -> dict[str, list[int]]:
    """Five requests over one 40-token base, joining while the first one runs (page size 4,
    24-token budget, so the first prompt prefills in three chunks):
    a: base + 10 tokens;  b: base + 7 others, added while a is mid-prefill;
    c: a's prompt again and d: its first 48 tokens (whole prompts cached), added once a decodes;
    e: a's prompt + its first 10 generated tokens, added once a has computed them.
    Returns each request's output ids, and their prompts under "prompts"; `logprobs`, if given, gets
    each request's tokens' log-probabilities."""
    engine = llm.engine
    base = random_prompts([40], seed=11)[0]
    tails = random_prompts([10, 7], seed=12)
    a_ref, _ = hf_greedy(reference, base + tails[0], 12)
    prompts = {"a": base + tails[0], "b": base + tails[1]}
    prompts |= {"c": prompts["a"], "d": prompts["a"][:48], "e": prompts["a"] + a_ref[:10]}
    max_new = {"a": 12, "b": 6, "c": 8, "d": 5, "e": 6}
    requests = {}

    def add(name: str) -> None:
        requests[name] = engine.make_request(name, prompts[name],
                                             greedy(max_new[name], logprobs=0 if logprobs is not None else None))
        engine.add_request(requests[name])

    add("a")
    engine.step()
    engine.step()
    add("b")  # a has 48 tokens computed, 12 blocks indexed: b shares 10 of them
    engine.step()
    assert requests["a"].output_token_ids and requests["b"].num_computed_tokens > 0
    full = getattr(engine.allocator, "full", engine.allocator)  # (a hybrid model's full-attention allocator)
    if engine.block_sharing and full is not None:  # (10 of them where only full attention decides)
        shared = requests["b"].num_cached_tokens // PAGE
        assert full.block_table("b")[:shared] == full.block_table("a")[:shared]
        assert full.block_table("b")[shared] != full.block_table("a")[shared]
    add("c")
    add("d")
    while len(requests["a"].output_token_ids) < 8:  # a's tokens up to 56 computed: 14 blocks indexed
        engine.step()
    add("e")
    while engine.has_unfinished_requests():
        engine.step()
    assert all(r.finish_reason == "length" for r in requests.values())
    if logprobs is not None:
        logprobs |= {name: [float(e[t]) for e, t in zip(r.logprobs, r.output_token_ids)]
                     for name, r in requests.items()}
    return {name: r.output_token_ids for name, r in requests.items()} | {"prompts": prompts}


def assert_prefix_scenario_matches(llm: LLM, reference: transformers.PreTrainedModel) -> None:
    """`shared_prefix_scenario`'s requests each equal to `reference`'s greedy continuation; every block back."""
    outputs = shared_prefix_scenario(llm, reference)
    for name, prompt in outputs.pop("prompts").items():
        ref, logits = hf_greedy(reference, prompt, len(outputs[name]))
        assert_greedy_match(outputs[name], ref, logits, f"prefix-cached request {name}")
    assert all_free(llm)


def assert_prefix_sharing_keeps_outputs(model: TinyModel, hits: int) -> LLM:
    """`shared_prefix_scenario` with prefix caching on and off: every prompt token looked up (none off), `hits`
    found in the cache (none off), the rest computed, nothing offloaded; outputs equal each other's and
    transformers', log-probabilities too (fp32); every block back. Returns the engine with caching on."""
    outputs, logprobs, llms = {}, {}, {}
    for sharing in (True, False):
        llm = llms[sharing] = model.llm(page_size=PAGE, max_batch_tokens=24, allow_block_sharing=sharing)
        assert llm.engine.block_sharing is sharing and llm.engine.allocator.block_sharing is sharing
        logprobs[sharing] = {}
        outputs[sharing] = shared_prefix_scenario(llm, model.reference, logprobs[sharing])
        stats = llm.stats()
        query = sum(len(p) for p in outputs[sharing]["prompts"].values())
        expected = hits if sharing else 0
        assert (stats.prefix_cache_query_tokens, stats.prefix_cache_hit_tokens, stats.prefill_tokens) == (
            query if sharing else 0, expected, query - expected)
        assert stats.soft_resets == 0
        assert all_free(llm) and (llm.engine.allocator.num_cached_blocks > 0) is sharing
    on, off = outputs[True], outputs[False]
    for name, prompt in on.pop("prompts").items():
        assert on[name] == off[name], f"request {name}: prefix caching changed the output"
        torch.testing.assert_close(torch.tensor(logprobs[True][name]), torch.tensor(logprobs[False][name]),
                                   rtol=0, atol=1e-4, msg=f"request {name}")
        ref, logits = hf_greedy(model.reference, prompt, len(on[name]))
        assert_greedy_match(on[name], ref, logits, f"request {name}")
    return llms[True]


def assert_next_turn_resumes(model: TinyModel, config: dict) -> None:
    """A conversation's next turn (a 30-token prompt, its 8-token reply, 6 new tokens) resumes where the
    first turn's computed tokens end, on their last page boundary; its tokens and log-probabilities equal
    those without prefix caching (fp32: the state or window it resumed from was the right one) and
    transformers' tokens."""
    prompt, more = random_prompts([30, 6], seed=5)
    params = greedy(8, logprobs=0)
    runs = {}
    for sharing in (True, False):
        llm = model.llm(allow_block_sharing=sharing, **config)
        first = llm.generate([prompt], params, use_tqdm=False)[0]
        turn = prompt + first.token_ids + more
        second = llm.generate([turn], params, use_tqdm=False)[0]
        runs[sharing] = [first.token_ids, second.token_ids,
                         [e[t] for e, t in zip(second.logprobs, second.token_ids)]]
        page = config["page_size"]
        assert llm.stats().prefix_cache_hit_tokens == (((len(prompt) + 7) // page) * page if sharing else 0)
        assert all_free(llm)
    assert runs[True][:2] == runs[False][:2]
    torch.testing.assert_close(torch.tensor(runs[True][2]), torch.tensor(runs[False][2]), rtol=0, atol=1e-4)
    ref, logits = hf_greedy(model.reference, turn, 8)
    assert_greedy_match(runs[True][1], ref, logits, "next turn")


def assert_state_kept_at_intervals(model: TinyModel) -> None:
    """A model with state layers (page 4, passes of 24 tokens, a state kept every 8 tokens): a prompt's passes
    end at 8, 16, 24 and 30, and a second prompt sharing its first 20 tokens resumes at 16 (without the
    interval, at nothing: the first prompt's passes end at 24 and 30); tokens equal transformers'."""
    first, other = random_prompts([30, 10], seed=9)
    second = first[:20] + other
    llm = model.llm(page_size=4, max_batch_tokens=24)
    assert llm.engine.allocator.state_interval == 512  # (the default, past these prompts)
    llm.engine.allocator.state_interval = 8
    passes = []
    run = llm.engine.runner.run
    llm.engine.runner.run = lambda step: passes.append(int(step.input_ids.numel())) or run(step)
    outs = llm.generate([first], greedy(4), use_tqdm=False) + llm.generate([second], greedy(4), use_tqdm=False)
    assert passes[:4] == [8, 8, 8, 6]
    assert llm.stats().prefix_cache_hit_tokens == 16
    for prompt, out in zip((first, second), outs):
        ref, logits = hf_greedy(model.reference, prompt, 4)
        assert_greedy_match(out.token_ids, ref, logits, "state kept at intervals")
    assert all_free(llm)


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "disable_by_batch_size": 64}


def copy_prompts() -> list[list[int]]:
    """Prompts that repeat themselves (n-gram lookups hit), of lengths that need prefill chunks."""
    return [p * 3 for p in random_prompts([5, 9, 14, 30, 4], seed=1)] + random_prompts([7, 40], seed=2)


# -- plots ----------------------------------------------------------------------------------------------
def assert_png(path: Path) -> None:
    """`path` is a PNG file with a real plot in it (more than an empty canvas's bytes)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


# -- LoRA adapters ------------------------------------------------------------------------------------
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_lora_adapter(base: transformers.PreTrainedModel, path: Path, seed: int, rank: int = 8,
                      targets: list[str] | None = None, **options: Any) -> transformers.PreTrainedModel:
    """A random PEFT LoRA adapter of `base` (B not zero: init_lora_weights=False) saved to `path`; the
    reference is a copy of `base` with the adapter, in peft (eval, fp32). `options`: more LoraConfig fields."""
    import copy

    import peft

    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets or LORA_TARGETS,
                             init_lora_weights=False, lora_dropout=0.0, **options)
    model = peft.get_peft_model(copy.deepcopy(base), config).eval()
    with torch.no_grad():  # peft's random init is on the scale of the weights: a delta that moves the tokens
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.5)
    model.save_pretrained(path)
    return model


def smaps_fields(address: int) -> dict[str, list[str]]:
    """The /proc/self/smaps fields (name -> the words after it) of this process' mapping that holds
    `address`: its resident KiB (`Rss`), its flags (`VmFlags`), ..."""
    fields: dict[str, list[str]] | None = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head, *rest = line.split()
            if "-" in head and ":" not in head:  # a mapping's first line: its address range
                if fields is not None:
                    break
                lo, hi = (int(x, 16) for x in head.split("-"))
                fields = {} if lo <= address < hi else None
            elif fields is not None:
                fields[head.removesuffix(":")] = rest
    if fields is None:
        raise AssertionError(f"no mapping holds {address:#x}")
    return fields
