"""Phi-3/Phi-4 and the RoPE scalings that depend on the sequence length (LongRoPE, dynamic NTK): greedy ids
identical to transformers (fp32, eager) for prompts and generations on both sides of the thresholds, with
chunked prefill, prefix caching, mixed batches and async batching; bf16 and int8 within the precision
tests' tolerance; unsupported configs and broken checkpoints rejected by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from conveyor import LLM, ContinuousBatchingConfig, SamplingParams
from conveyor.errors import ConfigError
from conveyor.layers.rotary import RotaryEmbedding, with_lengths
from conveyor.models.sharding import plan_shards

from tests.utils import (BF16_AGREEMENT, BF16_TOLERANCE, QUANT_MODES, ROPE_BY_LENGTH_CONFIGS, ROPE_SWITCH,
                         TINY_CONFIGS, TinyModel, agreement, assert_greedy_match, greedy_ids, hf_greedy,
                         next_token_logprobs, random_prompts)

pytestmark = pytest.mark.usefixtures("one_thread")  # transformers' generate too: 40x faster on a busy 2-core box

# Prompts and generations below, at and past 32 tokens (the dynamic model's context is 64).
LENGTHS = [5, 20, 31, 32, 33, 45]
MAX_NEW = [40, 20, 6, 9, 12, 12]


class Model(TinyModel):
    """One of `ROPE_BY_LENGTH_CONFIGS` saved to `path`, with its transformers reference."""

    def __init__(self, kind: str, path: Path, initializer_range: float = 0.2) -> None:
        config = ROPE_BY_LENGTH_CONFIGS[kind]()
        config.initializer_range = initializer_range
        super().__init__(kind, path, config)

    def reference_greedy(self, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
        """transformers' continuation of one prompt, alone (its dynamic RoPE keeps state between calls: fresh)."""
        inner = self.reference.model
        inner.rotary_emb = type(inner.rotary_emb)(self.reference.config)
        return hf_greedy(self.reference, prompt, n)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Model]:
    return {kind: Model(kind, tmp_path_factory.mktemp(kind)) for kind in ROPE_BY_LENGTH_CONFIGS}


def run_and_compare(model: Model, llm: LLM, prompts: list[list[int]], max_new: list[int], label: str) -> None:
    """Greedy outputs against the reference prompt by prompt, each reference run with a fresh RoPE (dynamic NTK
    keeps state between calls); every block back after."""
    params = [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True) for n in max_new]
    for i, (prompt, n, out) in enumerate(zip(prompts, max_new, llm.generate(prompts, params, use_tqdm=False))):
        ref, logits = model.reference_greedy(prompt, n)
        assert_greedy_match(out.token_ids, ref, logits, f"{label} prompt {i} ({len(prompt)} tokens)")
    allocator = llm.engine.allocator
    assert allocator.num_free_blocks == allocator.num_total_blocks


@pytest.mark.parametrize("kind", list(ROPE_BY_LENGTH_CONFIGS))
def test_matches_transformers(models: dict[str, Model], kind: str) -> None:
    """One mixed batch, prompts chunked in pieces of 16 tokens, pages of 4; then whole prompts."""
    model = models[kind]
    prompts = random_prompts(LENGTHS, seed=7)
    run_and_compare(model, model.llm(max_batch_tokens=16, page_size=4), prompts, MAX_NEW, f"{kind} chunked")
    run_and_compare(model, model.llm(max_batch_tokens=256), prompts, MAX_NEW, f"{kind} whole")


def test_the_lengths_are_what_decides(models: dict[str, Model]) -> None:
    """The Llama family's `max_model_len` is the dynamic context; without each request's length the
    prompts past the threshold would be rotated with the wrong frequencies (the check can fail)."""
    model = models["llama_dynamic"]
    llm = model.llm()
    assert llm.engine.max_model_len == 2 * ROPE_SWITCH and llm.engine.model.rope_by_length
    prompt = random_prompts([45], seed=3)[0]
    plain = RotaryEmbedding(model.reference.config, 16)
    positions = torch.arange(45)
    cos_by_length, _ = plain(with_lengths(positions, torch.full_like(positions, 45)), torch.float32)
    cos_by_position, _ = plain(positions, torch.float32)
    assert not torch.equal(cos_by_length, cos_by_position)
    run_and_compare(model, llm, [prompt], [10], "dynamic 45")


@pytest.mark.parametrize("kind", ["llama_dynamic", "phi3_longrope"])
def test_rope_frequencies_are_transformers_own(models: dict[str, Model], kind: str) -> None:
    """Per-token inverse frequencies, bit for bit those transformers computes for that sequence length."""
    config = models[kind].reference.config
    rotary = RotaryEmbedding(config, 16, partial_rotary=True)
    lengths = torch.arange(1, 4 * ROPE_SWITCH)
    ours = rotary.inv_freq_for(lengths)
    for i, length in enumerate(lengths.tolist()):
        if kind == "llama_dynamic":  # transformers passes the length as a tensor (max(position_ids) + 1)
            ref, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=torch.tensor(length))
            ref = ref if length > ROPE_SWITCH else ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu")[0]
        else:
            ref, _ = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=length)
        assert torch.equal(ours[i], ref), f"{kind}: length {length}"


def test_longrope_switch_recomputes_like_transformers(models: dict[str, Model]) -> None:
    """transformers' Phi-3 drops its cache when a generation passes the original length and recomputes
    every token with the long factors; so does the engine (synchronous and async batching)."""
    model = models["phi3_longrope"]
    prompts = random_prompts([10, 28, 31], seed=11)
    for async_batching in (False, True):
        llm = model.llm(page_size=4, use_async_batching=async_batching)
        run_and_compare(model, llm, prompts, [30, 12, 5], f"switch async={async_batching}")
    assert llm.engine.model.rope_switch == ROPE_SWITCH


@pytest.mark.parametrize(("kind", "long_hits"), [("phi3_longrope", 24), ("llama_dynamic", 0)])
def test_prefix_cache_shares_only_equal_rotations(models: dict[str, Model], kind: str, long_hits: int) -> None:
    """A prompt up to the threshold and one past it rotate their shared prefix differently: no block is
    shared between them. Two long prompts share it under LongRoPE (one long set), not under dynamic NTK
    (each length its own frequencies)."""
    model = models[kind]
    llm = model.llm(page_size=4, max_batch_tokens=64)
    prefix = random_prompts([24], seed=5)[0]
    short, long, longer = (prefix + tail for tail in random_prompts([4, 12, 16], seed=6))
    hits = []
    for prompt in (short, long, longer):
        before = llm.stats().prefix_cache_hit_tokens
        run_and_compare(model, llm, [prompt], [4], f"{kind} prefix")
        hits.append(llm.stats().prefix_cache_hit_tokens - before)
    assert hits == [0, 0, long_hits]
    again = llm.stats().prefix_cache_hit_tokens
    run_and_compare(model, llm, [short[:-1] + [7]], [4], f"{kind} short again")
    assert llm.stats().prefix_cache_hit_tokens - again == 24  # short prompts share as ever


@pytest.fixture(scope="module")
def smooth(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Model]:
    """Weights at a trained model's scale (what the precision tests measure on)."""
    return {kind: Model(kind, tmp_path_factory.mktemp(f"{kind}_smooth"), initializer_range=0.05)
            for kind in ("phi4_mini", "phi3_longrope")}


@pytest.mark.parametrize(("kind", "dtype", "quantization"), [
    ("phi4_mini", "bfloat16", None), ("phi4_mini", "auto", "int8"), ("phi4_mini", "bfloat16", "int8"),
    ("phi3_longrope", "bfloat16", "int8")])  # full rotary: the native decode stack, positions carrying lengths
def test_precision_modes_stay_close(smooth: dict[str, Model], kind: str, dtype: str, quantization: str | None) -> None:
    """bf16 and int8 against the fp32 exact path, within the limits test_precision sets for Llama (prompts
    past LongRoPE's threshold included). Sixteen prompts: over eight, one early difference moved the
    greedy agreement by a tenth, and the same arithmetic passed or failed by the CPU the reference ran on."""
    prompts = random_prompts([5, 12, 20, 30, 34, 40, 8, 25] * 2, seed=41)
    fp32, other = smooth[kind].llm(), smooth[kind].llm(dtype=dtype, quantization=quantization)
    assert (other.engine.model.decode_stack is not None) == (kind == "phi3_longrope")
    tolerance, least = (BF16_TOLERANCE, BF16_AGREEMENT) if quantization is None else QUANT_MODES[quantization][1]
    err = (next_token_logprobs(other, prompts) - next_token_logprobs(fp32, prompts)).abs().max().item()
    assert err < tolerance, f"{dtype}/{quantization}: log-prob error {err:.3f}"
    rate = agreement(greedy_ids(other, prompts), greedy_ids(fp32, prompts))
    assert rate >= least, f"{dtype}/{quantization}: greedy agreement {rate:.2f}"


def broken_copy(model: Model, root: Path, config: dict | None = None, drop: str | None = None) -> Path:
    """The model's directory with config fields replaced, or one tensor left out."""
    path = root / "broken"
    path.mkdir()
    for file in model.path.iterdir():
        (path / file.name).write_bytes(file.read_bytes())
    if config:
        (path / "config.json").write_text(json.dumps(json.loads((path / "config.json").read_text()) | config))
    if drop:
        tensors = safetensors.torch.load_file(path / "model.safetensors")
        del tensors[drop]
        safetensors.torch.save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


WIGGLE = {"rope_parameters": {"rope_type": "wiggle", "rope_theta": 10000.0}}


@pytest.mark.parametrize(("kind", "change", "message"), [
    ("llama_dynamic", dict(config=WIGGLE), "RoPE type 'wiggle' is not supported"),
    ("phi3_longrope", dict(config=WIGGLE), "(?s)Invalid config.json.*wiggle"),  # transformers' Phi-3 config rejects it
    ("phi3_longrope", dict(config={"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}),
     "model type 'gpt2' is not supported"),
    ("phi3_longrope", dict(config={"hidden_act": "gelu"}), "hidden_act 'gelu'"),
    ("phi3_longrope", dict(drop="model.layers.1.self_attn.qkv_proj.weight"), "layers.1.qkv_proj.weight"),
    ("llama_dynamic", dict(drop="model.layers.0.self_attn.k_proj.weight"),
     "no tensor 'model.layers.0.self_attn.k_proj"),
    ("phi4_mini", dict(drop="model.norm.weight"), "no tensor 'model.norm.weight'"),
])
def test_unsupported_or_broken_checkpoints_are_named(models: dict[str, Model], tmp_path: Path, kind: str,
                                                     change: dict, message: str) -> None:
    path = broken_copy(models[kind], tmp_path, **change)
    with pytest.raises(ValueError, match=message):
        LLM(path, dtype="float32", config=ContinuousBatchingConfig(num_blocks=16))


def test_tensor_parallelism_names_what_it_cannot_split(models: dict[str, Model]) -> None:
    config = models["phi4"].reference.config
    assert len(plan_shards(config, 1)) == 1
    with pytest.raises(ConfigError, match="phi3 checkpoints store gate/up and q/k/v fused"):
        plan_shards(config, 2)


def test_speculation_stops_at_the_longrope_switch(models: dict[str, Model]) -> None:
    """Proposals never cross the switch: a pass crossing it would verify against the short K/V the switch
    recomputes. The model drafts for itself, so every proposal is accepted, up to the switch too."""
    model = models["phi3_longrope"]
    prompts = random_prompts([20, 27, 30], seed=17)
    spec = {"method": "draft_model", "model": str(model.path), "num_speculative_tokens": 4, "disable_by_batch_size": 64}
    llm = model.llm(page_size=4, speculative_config=spec)
    run_and_compare(model, llm, prompts, [20, 12, 8], "self-drafted across the switch")
    assert llm.stats().spec_decode_num_accepted_tokens > 20


def test_frequencies_stay_float32_in_a_bf16_model() -> None:
    """A model cast to bf16 keeps its RoPE frequencies in fp32 (transformers' too): at position 100,000 the
    angles equal the fp32 ones (frequencies rounded to bf16 turn some by radians there); LongRoPE's and dynamic
    NTK's buffers stay fp32 too."""
    config = TINY_CONFIGS["llama"]()
    rotary = RotaryEmbedding(config, config.hidden_size // config.num_attention_heads)
    expected = rotary(torch.tensor([100_000]), torch.float32)
    rotary.to(torch.bfloat16)
    for ours, ref in zip(rotary(torch.tensor([100_000]), torch.float32), expected):
        torch.testing.assert_close(ours, ref, atol=0, rtol=0)
    for kind in ("phi3_longrope", "llama_dynamic"):
        config = ROPE_BY_LENGTH_CONFIGS[kind]()
        scaled = RotaryEmbedding(config, config.hidden_size // config.num_attention_heads).to(torch.bfloat16)
        assert {b.dtype for b in [*rotary.buffers(), *scaled.buffers()]} == {torch.float32}
