"""Granite 4.0's Mamba-2 layers (`layers.mamba2`), their state (the convolution's ring, then the SSM state in
fp32) a fixed run of KV pool slots: greedy ids equal transformers' with chunked prefill from one token to longer
than the scan's chunks, dense and with experts, requests offloaded and resumed; the state's pages fixed and all
returned; the scan's chunked form against the recurrence in fp64; the default modes' error measured; what the
state cannot take refused by name. The attention-only Granite 4.0 models (granite-4.0-micro's form)."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch

from conveyor import LLM, ContinuousBatchingConfig, LoRARequest
from conveyor.cache.sliding_allocator import StateCacheAllocator
from conveyor.errors import ConfigError
from conveyor.kernels import cpu_ssm_ops
from conveyor.layers.attention import AttentionMetadata
from conveyor.layers.mamba2 import Mamba2Mixer, chunk_scan, read_state, state_slots, write_state
from conveyor.layers.short_conv import read_rows
from conveyor.models.granite_hybrid import GraniteHybridForCausalLM
from conveyor.models.sharding import plan_shards

from tests.gguf_writer import write_gguf
from tests.utils import (BF16_TOLERANCE, MOE_CONFIGS, QUANT_MODES, TINY_CONFIGS, TinyModel, all_free,
                         PAGE, assert_greedy_match, assert_mode_within_tolerance, assert_next_turn_resumes,
                         assert_offloads_resume, assert_prefix_scenario_matches, assert_prefix_sharing_keeps_outputs,
                         assert_state_kept_at_intervals,
                         compare_greedy, greedy, greedy_ids, hf_greedy, make_lora_adapter, next_token_logprobs,
                         random_prompts)

PROMPTS = random_prompts([1, 2, 9, 30, 47], seed=7)
MAX_NEW = 16

pytestmark = pytest.mark.usefixtures("one_thread")


def long_memory(model: TinyModel) -> TinyModel:
    """Decays of 0.96-0.996 a token (transformers' initial A and dt_bias forget within a few tokens, so a state
    lost between chunks would hardly show), saved again."""
    with torch.no_grad():
        for name, param in model.reference.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.log(torch.linspace(0.02, 0.2, param.numel())))
            elif name.endswith("dt_bias"):
                param.fill_(-1.5)
    model.reference.save_pretrained(model.path)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyModel]:
    configs = {"dense": TINY_CONFIGS["granitemoehybrid"](), "experts": MOE_CONFIGS["granitemoehybrid"]()}
    return {kind: long_memory(TinyModel("granitemoehybrid", tmp_path_factory.mktemp(f"granite-hybrid-{kind}"), config))
            for kind, config in configs.items()}


@pytest.mark.parametrize("config", [{"page_size": 16}, {"page_size": 4, "max_batch_tokens": 7},
                                    {"page_size": 2, "max_batch_tokens": 5}, {"page_size": 3, "max_batch_tokens": 1}],
                         ids=["page16", "page4-chunk7", "page2-chunk5", "page3-chunk1"])
@pytest.mark.parametrize("kind", ["dense", "experts"])
def test_mamba_states_match_transformers(models: dict[str, TinyModel], kind: str, config: dict) -> None:
    """Chunks of 1 to 47 tokens starting anywhere in the scan's chunks of 8, decode rows beside them; the state
    (ring rows of 3 slots, then 32 slots of fp32) within pages or across them."""
    model = models[kind]
    llm = model.llm(**config)
    engine = llm.engine
    assert engine.model.cache_windows == {"mamba": 4 * 3 + 32}
    compare_greedy(model.reference, llm, PROMPTS, [MAX_NEW] * len(PROMPTS), f"{kind} {config}")
    assert all_free(llm) and engine.pool.num_free + engine.allocator.num_cached_blocks == engine.pool.num_usable


def test_state_pages_are_fixed_from_the_first_token(models: dict[str, TinyModel]) -> None:
    """A request holds its state's run of pages whole from its first token to its last, however long it grows."""
    llm = models["dense"].llm(page_size=4)
    engine = llm.engine
    state = next(a for a in engine.allocator.allocators if isinstance(a, StateCacheAllocator))
    assert state.attention_type == "mamba" and state.ring_blocks == 11 and state.num_groups == 3
    engine.add_request(engine.make_request("long", PROMPTS[4], greedy(30)))
    lengths = set()
    while engine.has_unfinished_requests():
        engine.step()
        if state.holds("long"):
            lengths.add(len(state.block_table("long")))
    assert lengths == {11}
    assert all_free(llm)


@pytest.mark.parametrize("swap", [False, True], ids=["recompute", "swap"])
def test_offloaded_requests_resume_with_their_state(models: dict[str, TinyModel], swap: bool) -> None:
    """A pool too small for all five: requests are offloaded and resumed (their states swapped out and back
    with their attention pages, or recomputed from their tokens) and give the same tokens."""
    assert_offloads_resume(models["dense"], PROMPTS, MAX_NEW, swap, num_blocks=80)


def recurrence(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
               d: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan one token at a time: `S = exp(dt * A) * S + dt * B * x`, `y = S . C + D * x`, each head with
    its group's B and C."""
    rep = x.shape[1] // b.shape[1]
    b, c = b.repeat_interleave(rep, dim=1), c.repeat_interleave(rep, dim=1)
    ys = []
    for t in range(x.shape[0]):
        decay = torch.exp(dt[t] * a)[:, None, None]
        state = decay * state + (dt[t][:, None, None] * b[t][:, None, :]) * x[t][..., None]
        ys.append((state @ c[t][..., None]).squeeze(-1) + d[:, None] * x[t])
    return torch.stack(ys), state


@pytest.mark.parametrize("tokens", [1, 7, 8, 21])
@pytest.mark.parametrize("chunk", [1, 4, 8])
@pytest.mark.parametrize("start", ["zeros", "state"])
def test_chunked_scan_equals_the_recurrence(tokens: int, chunk: int, start: str) -> None:
    """The chunked form (what a prefill chunk takes) against the step-by-step recurrence (a decode row's), fp64,
    4 heads in 2 groups, from no state or a non-zero one: outputs and final state."""
    g = torch.Generator().manual_seed(tokens * 10 + chunk)
    heads, groups, p, n = 4, 2, 3, 5
    x = torch.randn(tokens, heads, p, generator=g, dtype=torch.float64)
    b, c = (torch.randn(tokens, groups, n, generator=g, dtype=torch.float64) for _ in range(2))
    dt = torch.rand(tokens, heads, generator=g, dtype=torch.float64)
    a = -2 * torch.rand(heads, generator=g, dtype=torch.float64)
    d = torch.randn(heads, generator=g, dtype=torch.float64)
    state = torch.randn(heads, p, n, generator=g, dtype=torch.float64) if start == "state" else None
    y, final = chunk_scan(x, dt, a, b, c, d, state, chunk)
    y_ref, final_ref = recurrence(x, dt, a, b, c, d, torch.zeros(heads, p, n, dtype=torch.float64)
                                  if state is None else state)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, final_ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_states_keep_their_fp32_bits_in_any_pool(dtype: torch.dtype) -> None:
    """An fp32 state stored over a bf16 pool's slots (each slot's K half, then its V half) reads back bit for bit,
    and writes nothing outside its slots."""
    pool = torch.zeros(2, 64, 2, 8, dtype=dtype)
    s = state_slots(100, 2, 8, pool.element_size())
    assert s == (4 if dtype == torch.float32 else 7)  # (400 bytes over slots of 128 or 64)
    slots = torch.stack([torch.arange(s), torch.arange(63, 63 - s, -1)])
    states = torch.randn(2, 100)
    write_state(pool, slots, states)
    assert torch.equal(read_state(pool, slots, 100), states)
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots.flatten()] = False
    assert not pool[:, untouched].any()


def test_what_mamba_layers_cannot_take_is_refused_by_name(models: dict[str, TinyModel]) -> None:
    """A quantized KV cache (the states are kept exact) and tensor parallelism (the layers are not split)."""
    with pytest.raises(ConfigError, match=r"kv_cache_dtype 'int8' is not supported for granitemoehybrid's mamba "
                                          r"layers \(supported: auto\)"):
        models["dense"].llm(dtype="bfloat16", kv_cache_dtype="int8")
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2: granitemoehybrid's Mamba-2 layers and shared MLP "
                                          r"are not split"):
        plan_shards(models["dense"].reference.config, 2)


@pytest.fixture(scope="module")
def smooth_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyModel]:
    """At a trained model's weight scale, as the precision tests' `llama_smooth`."""
    configs = {"dense": TINY_CONFIGS["granitemoehybrid"](initializer_range=0.05),
               "experts": MOE_CONFIGS["granitemoehybrid"](initializer_range=0.05)}
    return {kind: TinyModel("granitemoehybrid", tmp_path_factory.mktemp(f"smooth-{kind}"), config)
            for kind, config in configs.items()}


@pytest.mark.parametrize("quantization", ["none", "int8"])
@pytest.mark.parametrize("kind", ["dense", "experts"])
def test_default_modes_stay_within_the_measured_error(smooth_models: dict[str, TinyModel], kind: str,
                                                      quantization: str) -> None:
    """bf16 (the SSM state still fp32) and int8 weights against the fp32 exact path, by the limits every
    family's modes are held to."""
    assert_mode_within_tolerance(smooth_models[kind], quantization)


@pytest.mark.parametrize("kind", ["dense", "experts"])
def test_long_memory_states_keep_bf16_within_its_error(smooth_models: dict[str, TinyModel], kind: str,
                                                       tmp_path: Path) -> None:
    """The same models with states that last (`long_memory`), where a state's rounding would add up: the next
    tokens' log-probabilities in bf16 within bf16's limit of the exact path. (Greedy agreement is not asserted
    here: this tiny model's long-memory continuations pass near-ties, and its bf16 runs part from the exact
    path only where the top two logits are within 0.013, measured.)"""
    model = long_memory(TinyModel("granitemoehybrid", tmp_path, smooth_models[kind].reference.config))
    prompts = random_prompts([5, 9, 14, 20, 3, 30, 11, 7, 25, 16, 8, 12], seed=41)
    err = (next_token_logprobs(model.llm(dtype="bfloat16"), prompts) - next_token_logprobs(model.llm(), prompts))
    assert err.abs().max().item() < BF16_TOLERANCE


def test_attention_only_granite4_shares_prefixes(tmp_path: Path) -> None:
    """granite-4.0-micro's form: every layer attention with RoPE, the shared MLP: equal to transformers, and
    with no state layers its blocks are shared by prefix caching."""
    config = TINY_CONFIGS["granitemoehybrid"](layer_types=["attention"] * 4, position_embedding_type="rope")
    model = TinyModel("granitemoehybrid", tmp_path, config)
    llm = model.llm(page_size=4, max_batch_tokens=24)
    assert llm.engine.model.cache_windows == {} and llm.engine.block_sharing
    assert_prefix_scenario_matches(llm, model.reference)
    assert llm.stats().prefix_cache_hit_tokens > 0


@pytest.mark.parametrize("kind", ["dense", "experts"])
def test_prefix_caching_resumes_from_mamba_state_snapshots(models: dict[str, TinyModel], kind: str) -> None:
    """`shared_prefix_scenario` (page 4, chunks of 24 tokens): a hit ends where a pass ended on a page
    boundary (the state is kept there): b at 24 tokens (not 40), c at 48, d at 24 (not 44), e at 56."""
    assert_prefix_sharing_keeps_outputs(models[kind], (6 + 12 + 6 + 14) * PAGE)


@pytest.mark.parametrize("config", [{"page_size": 3, "max_batch_tokens": 5},
                                    {"page_size": 4, "max_batch_tokens": 13, "use_async_batching": True}],
                         ids=["page3-chunk5", "page4-async"])
def test_a_next_turn_resumes_from_the_mamba_state(models: dict[str, TinyModel], config: dict) -> None:
    assert_next_turn_resumes(models["dense"], config)


def test_a_shared_beginning_resumes_where_a_state_was_kept(models: dict[str, TinyModel]) -> None:
    assert_state_kept_at_intervals(models["dense"])


def test_layer_types_by_either_name_and_unknown_ones_refused() -> None:
    """The Hub's configs say "mamba" / "attention", transformers' own "linear_attention" / "full_attention"; a
    type the layers do not have is refused by name."""
    config = TINY_CONFIGS["granitemoehybrid"]()
    assert GraniteHybridForCausalLM(config).layer_types == ["mamba", "mamba", "full_attention", "mamba"]
    config.layer_types = ["linear_attention", "full_attention", "sliding_attention", "mamba"]
    with pytest.raises(ValueError, match=r"granitemoehybrid layer types \['sliding_attention'\] are not supported"):
        GraniteHybridForCausalLM(config)


@pytest.mark.parametrize("kind", ["dense", "experts"])
def test_gguf_files_load_like_the_directory(smooth_models: dict[str, TinyModel], kind: str, tmp_path: Path,
                                            gguf_tokenizer: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp's `granitehybrid` file (A stored as `-exp(A_log)`, the shared MLP split, the experts' gate/up
    split): F32 gives the directory's SSM parameters bit for bit and its greedy ids; Q8_0 blocks kept for the
    kernels stay within int8's tolerance of the directory holding the same rounded weights (at a trained model's
    weight scale, which that tolerance is measured on; states that last)."""
    model = long_memory(TinyModel("granitemoehybrid", tmp_path / "hf", smooth_models[kind].reference.config))
    f32, q8 = tmp_path / "f32.gguf", tmp_path / "q8_0.gguf"
    write_gguf(f32, model.reference, "granitehybrid", gguf.GGMLQuantizationType.F32)
    write_gguf(q8, model.reference, "granitehybrid", gguf.GGMLQuantizationType.Q8_0)
    config = {"page_size": 4, "max_batch_tokens": 16}
    from_file = LLM(f32, dtype="float32", config=ContinuousBatchingConfig(num_blocks=256, **config))
    from_dir = model.llm(**config)
    assert from_file.engine.model.config.layer_types == model.reference.config.layer_types
    mixers = [[layer.mamba for layer in m.engine.model.layers if hasattr(layer, "mamba")]
              for m in (from_file, from_dir)]
    assert len(mixers[0]) == len(mixers[1]) > 0
    for ours, theirs in zip(*mixers):
        for name in ("A", "D", "dt_bias", "conv_weight", "norm_weight"):
            assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    assert greedy_ids(from_file, PROMPTS) == greedy_ids(from_dir, PROMPTS)
    assert all_free(from_file)
    rounded = TinyModel("granitemoehybrid", tmp_path / "q8-hf", model.reference.config)
    q8_0, weights = gguf.GGMLQuantizationType.Q8_0, model.reference.state_dict()
    with torch.no_grad():
        for name, param in rounded.reference.named_parameters():
            value = weights[name]
            if param.ndim >= 2 and not name.endswith("norm.weight") and param.shape[-1] % 32 == 0:
                value = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(value.numpy(), q8_0), q8_0))
            param.copy_(value.view(param.shape))
    rounded.reference.save_pretrained(rounded.path)
    monkeypatch.setattr("conveyor.layers.precision.cpu_flags", lambda: frozenset({"avx2"}))  # (fp32 around int8)
    kept = LLM(q8, dtype="auto", config=ContinuousBatchingConfig(num_blocks=256, **config))
    monkeypatch.undo()
    assert kept.quantization == "gguf"
    err = (next_token_logprobs(kept, PROMPTS) - next_token_logprobs(rounded.llm(**config), PROMPTS)).abs().max()
    assert err.item() < QUANT_MODES["int8"][0][0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_decode_rows_equal_the_pytorch_ones(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Mamba layer's decode rows through the native kernel (rings and states in place in the pool) against
    its op-by-op PyTorch path, from the same pool: the outputs and the states to fp32's rounding (libm's
    exponentials, not PyTorch's), the rings' new rows bit for bit; a row at position 0 starts from zeros
    whatever its pages hold."""
    if cpu_ssm_ops() is None:
        pytest.skip("no native kernels here")
    g = torch.Generator().manual_seed(3)
    mixer = Mamba2Mixer(48, heads=4, head_dim=8, state=16, groups=2, kernel=4, conv_bias=True, proj_bias=False,
                        eps=1e-5, time_step_limit=None)
    with torch.no_grad():
        for param in mixer.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.3)
    mixer = mixer.to(dtype)
    mixer.set_ssm_parameters(-torch.rand(4, generator=g) * 4, torch.randn(4, generator=g), torch.randn(4, generator=g))
    page, kv_heads, head_dim = 4, 2, 16
    pool = torch.randn(2, 40 * page, kv_heads, head_dim, generator=g).to(dtype)
    tables = torch.randperm(40, generator=g)[:18].view(3, 6)
    meta = AttentionMetadata(slot_mapping=torch.zeros(3, dtype=torch.long), page_size=page, num_decodes=3,
                             decode_positions=torch.tensor([7, 0, 2]))
    meta.decode_block_tables = tables
    x = torch.randn(3, 48, generator=g).to(dtype)
    native_pool, torch_pool = pool.clone(), pool.clone()
    y_native = mixer(x, native_pool, meta)
    monkeypatch.setattr("conveyor.layers.mamba2.cpu_ssm_ops", lambda: None)
    meta.state = None
    y_torch = mixer(x, torch_pool, meta)
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(y_native.float(), y_torch.float(), **tolerance)
    r, s = mixer.state_slots(kv_heads, head_dim, pool.element_size())
    for row in range(3):
        slots = tables[row].repeat_interleave(page) * page + torch.arange(page).repeat(6)
        ring, state = slots[:4 * r].view(4, r), slots[4 * r:4 * r + s]
        assert torch.equal(read_rows(native_pool, ring, mixer.conv_dim), read_rows(torch_pool, ring, mixer.conv_dim))
        torch.testing.assert_close(read_state(native_pool, state[None], 512), read_state(torch_pool, state[None], 512),
                                   rtol=1e-5, atol=1e-5)


GRANITE_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "out_proj", "input_linear", "output_linear"]


def test_lora_adapters_on_every_projection_equal_peft(models: dict[str, TinyModel], tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """PEFT adapters by Granite 4.0's module names (attention's q/k/v/o, the Mamba mixers' in_proj and out_proj,
    the shared MLP's input_linear and output_linear): two adapters and the base interleaved in one batch, each
    request equal to transformers + peft; in bf16 with int8 weights, steps with adapter rows on the Mamba layers
    leave the native stack (whose Mamba rows add no deltas): the same tokens as with the stack off."""
    model = models["dense"]
    refs = {"a": make_lora_adapter(model.reference, tmp_path / "a", seed=1, targets=GRANITE_LORA_TARGETS),
            "b": make_lora_adapter(model.reference, tmp_path / "b", seed=2, rank=4,
                                   targets=["in_proj", "output_linear"])}
    requests = {"a": LoRARequest("a", 1, str(tmp_path / "a")), "b": LoRARequest("b", 2, str(tmp_path / "b"))}
    which = ["a", None, "b", "a", "b"]

    def run(**options: object) -> list[list[int]]:
        llm = LLM(model.path, enable_lora=True, max_loras=2, max_lora_rank=8,
                  config=ContinuousBatchingConfig(num_blocks=256, max_batch_tokens=16, page_size=4), **options)
        outs = llm.generate(PROMPTS, greedy(MAX_NEW), use_tqdm=False,
                            lora_request=[requests[w] if w else None for w in which])
        assert all_free(llm)
        return [o.token_ids for o in outs]

    outs = run(dtype="float32")
    for i, (prompt, w, out) in enumerate(zip(PROMPTS, which, outs)):
        ref, logits = hf_greedy(refs[w] if w else model.reference, prompt, MAX_NEW)
        assert_greedy_match(out, ref, logits, f"granite prompt {i} adapter {w}")
    base = [hf_greedy(model.reference, p, MAX_NEW)[0] for p, w in zip(PROMPTS, which) if w]
    assert [o for o, w in zip(outs, which) if w] != base  # the adapters change the outputs
    stacked = run(dtype="bfloat16", quantization="int8")
    monkeypatch.setenv("CONVEYOR_DECODE_STACK", "0")
    assert stacked == run(dtype="bfloat16", quantization="int8")


@pytest.mark.parametrize("config", [{"page_size": 4, "max_batch_tokens": 7}, {"page_size": 16}],
                         ids=["chunk7", "whole"])
def test_time_step_limits_bind_in_the_scan_as_in_transformers(tmp_path: Path, config: dict) -> None:
    """A `time_step_limit` that binds: prompts' steps clamped in the scan, decode steps not (the Mamba kernels'
    and transformers' recurrent step take no limit), whichever path the rows take. (Prompts of 2 tokens and
    more: transformers runs a 1-token prompt through its recurrent step, unclamped.)"""
    model = long_memory(TinyModel("granitemoehybrid", tmp_path, TINY_CONFIGS["granitemoehybrid"](
        time_step_limit=(0.0, 0.1))))
    llm = model.llm(**config)
    compare_greedy(model.reference, llm, PROMPTS[1:], [MAX_NEW] * len(PROMPTS[1:]), f"time_step_limit {config}")
    assert all_free(llm)


def test_state_rows_wider_than_a_slot_half_take_the_pytorch_path(tmp_path: Path) -> None:
    """A state of 48 values a row (192 bytes) over a bf16 pool's slot halves of 64 bytes: the native rows and the
    stack cannot read it, so decode rows take the PyTorch path (no stack), and tokens stay transformers'
    (fp32, halves of 128 bytes: also the PyTorch path)."""
    model = long_memory(TinyModel("granitemoehybrid", tmp_path, TINY_CONFIGS["granitemoehybrid"](mamba_d_state=48)))
    assert model.llm(dtype="bfloat16", quantization="int8").engine.model.decode_stack is None
    llm = model.llm(page_size=4, max_batch_tokens=7)
    compare_greedy(model.reference, llm, PROMPTS, [MAX_NEW] * len(PROMPTS), "state of 48")
    assert all_free(llm)
