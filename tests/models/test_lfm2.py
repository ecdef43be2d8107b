"""LFM2's conv layers (`layers.short_conv`), their state a ring in the KV pool: greedy ids equal
transformers' with chunked prefill across every ring layout (a row in one slot or two, a ring within a page
or across pages), requests offloaded and resumed, speculation asked for; the state's pages bounded and all
returned; the default mode's error measured; what the rings cannot hold refused by name. LFM2-MoE's routing.
LoRA adapters by LFM2's own module names."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conveyor import LLM, ContinuousBatchingConfig, LoRARequest
from conveyor.cache.sliding_allocator import StateCacheAllocator
from conveyor.errors import ConfigError
from conveyor.layers.short_conv import state_slots_per_row
from conveyor.models.sharding import plan_shards

from tests.utils import (MOE_CONFIGS, PAGE, TINY_CONFIGS, TinyModel, all_free, assert_greedy_match,
                         assert_mode_within_tolerance, assert_next_turn_resumes, assert_offloads_resume,
                         assert_prefix_sharing_keeps_outputs, assert_state_kept_at_intervals, compare_greedy, greedy,
                         hf_greedy, make_lora_adapter, random_prompts)

PROMPTS = random_prompts([1, 2, 9, 30, 47], seed=7)
MAX_NEW = 16

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def two_slot_rows(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """One KV head of 16: a slot holds 32 values, a conv row of 64 takes two."""
    return TinyModel("lfm2", tmp_path_factory.mktemp("lfm2-kv1"), TINY_CONFIGS["lfm2"](num_key_value_heads=1))


@pytest.mark.parametrize("config", [{"page_size": 16}, {"page_size": 4, "max_batch_tokens": 7},
                                    {"page_size": 2, "max_batch_tokens": 5}, {"page_size": 3, "max_batch_tokens": 1}],
                         ids=["page16", "page4-chunk7", "page2-chunk5", "page3-chunk1"])
@pytest.mark.parametrize("kv_heads", [2, 1])
def test_conv_rings_match_transformers(tiny_models: dict[str, TinyModel], two_slot_rows: TinyModel, kv_heads: int,
                                       config: dict) -> None:
    """Chunks from one token to longer than the ring, rings of 3 or 6 slots in pages of 2 to 16."""
    model = tiny_models["lfm2"] if kv_heads == 2 else two_slot_rows
    llm = model.llm(**config)
    engine = llm.engine
    ring = engine.model.cache_windows["conv"]
    assert ring == {2: 3, 1: 6}[kv_heads] == 3 * state_slots_per_row(64, kv_heads, 16)
    compare_greedy(model.reference, llm, PROMPTS, [MAX_NEW] * len(PROMPTS), str(config))
    assert all_free(llm) and engine.pool.num_free + engine.allocator.num_cached_blocks == engine.pool.num_usable


def test_conv_state_pages_stay_bounded(tiny_models: dict[str, TinyModel]) -> None:
    llm = tiny_models["lfm2"].llm(page_size=2, allow_block_sharing=False)
    engine = llm.engine
    conv = next(a for a in engine.allocator.allocators if isinstance(a, StateCacheAllocator))
    assert conv.ring_blocks == 2 and conv.num_groups == 3 and engine.block_sharing is False
    engine.add_request(engine.make_request("long", PROMPTS[4], greedy(30)))
    lengths = []
    while engine.has_unfinished_requests():
        engine.step()
        if conv.holds("long"):
            lengths.append(len(conv.block_table("long")))
    assert max(lengths) == 2  # 77 tokens, one ring of two pages per conv group
    llm.generate([PROMPTS[3]] * 2, greedy(2), use_tqdm=False)
    stats = llm.stats()
    assert stats.prefix_cache_hit_tokens == 0
    assert all_free(llm)


def test_prefix_caching_resumes_from_conv_state_snapshots(tiny_models: dict[str, TinyModel]) -> None:
    """`shared_prefix_scenario` (page 4, chunks of 24 tokens): a hit ends where a pass ended on a page
    boundary (the state is kept there): b at 24 tokens (not 40), c at 48, d at 24 (not 44), e at 56."""
    assert_prefix_sharing_keeps_outputs(tiny_models["lfm2"], (6 + 12 + 6 + 14) * PAGE)


@pytest.mark.parametrize("config", [{"page_size": 3, "max_batch_tokens": 5},
                                    {"page_size": 4, "max_batch_tokens": 13, "use_async_batching": True}],
                         ids=["page3-chunk5", "page4-async"])
def test_a_next_turn_resumes_from_the_conv_state(tiny_models: dict[str, TinyModel], two_slot_rows: TinyModel,
                                                 config: dict) -> None:
    assert_next_turn_resumes(two_slot_rows if config["page_size"] == 3 else tiny_models["lfm2"], config)


def test_a_shared_beginning_resumes_where_a_state_was_kept(tiny_models: dict[str, TinyModel]) -> None:
    assert_state_kept_at_intervals(tiny_models["lfm2"])


@pytest.mark.parametrize("swap", [False, True], ids=["soft-reset", "swap"])
def test_offloaded_requests_resume_with_their_state(tiny_models: dict[str, TinyModel], swap: bool) -> None:
    """A pool too small for all five: requests are offloaded and resumed (their rings swapped out and back
    with their attention pages, or recomputed) and give the same tokens."""
    assert_offloads_resume(tiny_models["lfm2"], PROMPTS, MAX_NEW, swap, num_blocks=40)


def test_speculation_stays_off_and_outputs_unchanged(tiny_models: dict[str, TinyModel]) -> None:
    """A rejected draft would have overwritten ring rows the next step reads: no proposals are made."""
    model = tiny_models["lfm2"]
    llm = model.llm(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                        "prompt_lookup_min": 1})
    prompts = [p * 3 for p in PROMPTS[2:4]]  # (repeats an n-gram proposer would draft from)
    outs = llm.generate(prompts, greedy(MAX_NEW), use_tqdm=False)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        ref, logits = hf_greedy(model.reference, prompt, MAX_NEW)
        assert_greedy_match(out.token_ids, ref, logits, f"speculation prompt {i}")
    assert llm.stats().spec_decode_num_draft_tokens == 0
    assert all_free(llm)


def test_what_conv_layers_cannot_take_is_refused_by_name(tiny_models: dict[str, TinyModel]) -> None:
    """A quantized KV cache (the state is kept in the model's dtype) and tensor parallelism (the conv layers
    are not split), before anything starts."""
    with pytest.raises(ConfigError, match=r"kv_cache_dtype 'int8' is not supported for lfm2's conv layers "
                                          r"\(supported: auto\)"):
        tiny_models["lfm2"].llm(dtype="bfloat16", kv_cache_dtype="int8")
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2: lfm2's convolution layers are not split"):
        plan_shards(tiny_models["lfm2"].reference.config, 2)


@pytest.fixture(scope="module")
def smooth_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyModel]:
    """At a trained model's weight scale, as the precision tests' `llama_smooth`. LFM2-MoE at the released
    models' routed_scaling_factor of 1 and, as `make_smooth_gpt_oss`, its residual stream large against one
    expert's output (embeddings x5), as in a trained model: else the tiny model's top-3 of 8 sits at near-ties
    that rounding flips (int8: 0.149 in log-probability at x1, 0.047 at x5)."""
    configs = {"lfm2": TINY_CONFIGS["lfm2"](initializer_range=0.05),
               "lfm2_moe": MOE_CONFIGS["lfm2_moe"](initializer_range=0.05, routed_scaling_factor=1.0)}
    models = {kind: TinyModel(kind, tmp_path_factory.mktemp(f"{kind}-smooth"), config)
              for kind, config in configs.items()}
    moe = models["lfm2_moe"]
    with torch.no_grad():
        moe.reference.model.embed_tokens.weight.mul_(5.0)
    moe.reference.save_pretrained(moe.path)
    return models


@pytest.mark.parametrize("quantization", ["none", "int8"])
@pytest.mark.parametrize("kind", ["lfm2", "lfm2_moe"])
def test_default_modes_stay_within_the_measured_error(smooth_models: dict[str, TinyModel], kind: str,
                                                      quantization: str) -> None:
    """bf16 (conv states in bf16 too) and int8 weights against the fp32 exact path, by the limits every
    family's modes are held to."""
    assert_mode_within_tolerance(smooth_models[kind], quantization)


def test_lfm2_moe_chooses_experts_by_sigmoid_scores_and_its_bias(tmp_path: Path) -> None:
    """LFM2-MoE's per-expert bias moves which experts a token takes (not their weights): drawn large enough to
    reorder them, outputs still equal transformers' (sigmoid scores, renormalized, scaled by 1.5)."""
    model = TinyModel("lfm2_moe", tmp_path, MOE_CONFIGS["lfm2_moe"]())
    with torch.no_grad():
        for name, param in model.reference.named_buffers():
            if name.endswith("expert_bias"):
                param.copy_(torch.linspace(0.3, -0.3, param.numel()))
    model.reference.save_pretrained(model.path)
    llm = model.llm(max_batch_tokens=16, page_size=4)
    assert [type(layer.mlp).__name__ for layer in llm.engine.model.layers] == ["NoneType", "SparseMoe", "SparseMoe"]
    compare_greedy(model.reference, llm, PROMPTS, [MAX_NEW] * len(PROMPTS), "lfm2_moe")
    assert all_free(llm)


LFM2_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "in_proj", "w1", "w2", "w3"]


def test_lora_adapters_on_every_lfm2_projection_equal_peft(tiny_models: dict[str, TinyModel], tmp_path: Path) -> None:
    """PEFT adapters by LFM2's own module names (attention's q/k/v and out_proj, the conv layers' in_proj and
    out_proj, the MLP's w1/w3/w2): two adapters and the base interleaved in one batch, each request equal to
    transformers + peft."""
    model = tiny_models["lfm2"]
    refs = {"a": make_lora_adapter(model.reference, tmp_path / "a", seed=1, targets=LFM2_LORA_TARGETS),
            "b": make_lora_adapter(model.reference, tmp_path / "b", seed=2, rank=4, targets=["in_proj", "w2"])}
    requests = {"a": LoRARequest("a", 1, str(tmp_path / "a")), "b": LoRARequest("b", 2, str(tmp_path / "b"))}
    llm = LLM(model.path, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
              config=ContinuousBatchingConfig(num_blocks=256, max_batch_tokens=16, page_size=4))
    which = ["a", None, "b", "a", "b"]
    outs = llm.generate(PROMPTS, greedy(MAX_NEW), use_tqdm=False,
                        lora_request=[requests[w] if w else None for w in which])
    for i, (prompt, w, out) in enumerate(zip(PROMPTS, which, outs)):
        ref, logits = hf_greedy(refs[w] if w else model.reference, prompt, MAX_NEW)
        assert_greedy_match(out.token_ids, ref, logits, f"lfm2 prompt {i} adapter {w}")
    base = [hf_greedy(model.reference, p, MAX_NEW)[0] for p, w in zip(PROMPTS, which) if w]
    assert [o.token_ids for o, w in zip(outs, which) if w] != base  # the adapters change the outputs
    assert all_free(llm)


def test_lora_rows_on_conv_layers_leave_the_decode_stack(tiny_models: dict[str, TinyModel], tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The native stack's conv rows add no adapter deltas: steps with such adapter rows run eagerly, the
    same bits as without the stack."""
    model = tiny_models["lfm2"]
    make_lora_adapter(model.reference, tmp_path / "a", seed=3, targets=LFM2_LORA_TARGETS)
    request = LoRARequest("a", 1, str(tmp_path / "a"))

    def run(**env: str) -> list[list[int]]:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        llm = LLM(model.path, dtype="bfloat16", quantization="int8", enable_lora=True, max_lora_rank=8,
                  config=ContinuousBatchingConfig(num_blocks=256, page_size=4))
        assert (llm.engine.model.decode_stack is not None) == (not env)
        outs = llm.generate(PROMPTS, greedy(MAX_NEW), use_tqdm=False, lora_request=[request, None, request, None,
                                                                                    request])
        assert all_free(llm)
        return [o.token_ids for o in outs]

    assert run() == run(CONVEYOR_DECODE_STACK="0")
