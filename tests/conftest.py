"""Shared fixtures: tiny random Hugging Face models saved as directories, and the transformers reference."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# Without CUDA, Triton kernels run under its interpreter, which must be on before anything imports
# triton (llguidance's torch helpers do, through conveyor.structured), so for the whole session.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
import transformers
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from conveyor import LLM, ContinuousBatchingConfig

VOCAB = 300
WINDOW = 8  # sliding window of the tiny sliding/hybrid models
TINY_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                   initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
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
    "llama_rope_llama3": lambda: transformers.LlamaConfig(**TINY_COMMON, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2_rope_linear": lambda: transformers.Qwen2Config(**TINY_COMMON, rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    # Sliding-window and hybrid models, windows far shorter than the test prompts.
    "mistral_sliding": lambda: transformers.MistralConfig(**TINY_COMMON, sliding_window=WINDOW,
                                                          tie_word_embeddings=False),
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
    # per-head q/k norms, 4 of 8 experts renormalized
    "qwen3_moe": lambda **kw: transformers.Qwen3MoeConfig(
        **(MOE_COMMON | kw), head_dim=32, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=4,
        norm_topk_prob=True),
}


def tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Word-level tokenizer: token i is the word "w{i}"; 0-2 are unk/bos/eos."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, VOCAB)}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>")


class TinyModel:
    """A random HF model saved to `path` (from `TINY_CONFIGS[kind]`, or `make_config`); `reference` is the
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `cuda` are skipped where no CUDA device is visible (they are not CPU coverage)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyModel]:
    return {kind: TinyModel(kind, tmp_path_factory.mktemp(kind)) for kind in TINY_CONFIGS}


@pytest.fixture(scope="session")
def moe_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyModel]:
    return {kind: TinyModel(kind, tmp_path_factory.mktemp(kind), make()) for kind, make in MOE_CONFIGS.items()}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models: dict[str, TinyModel]) -> TinyModel:
    return tiny_models["llama"]


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


@torch.inference_mode()
def hf_greedy(model: transformers.PreTrainedModel, prompt: list[int], max_new_tokens: int,
              **kwargs: object) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation of one unpadded prompt, with its raw logits per step."""
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0, **kwargs)
    return out.sequences[0, len(prompt):].tolist(), torch.stack(out.logits)[:, 0].float()


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


def agreement(ours: list[list[int]], ref: list[list[int]]) -> float:
    """Fraction of generated tokens before each sequence's first difference from the reference."""
    same = 0
    for a, b in zip(ours, ref):
        for x, y in zip(a, b):
            if x != y:
                break
            same += 1
    return same / sum(map(len, ref))


@pytest.fixture(scope="module")
def one_thread():
    """Engines stepped on the test's thread (and Triton's interpreter) are much faster with one intra-op
    thread on a shared 2-core box."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
