"""Multi-LoRA against transformers + peft (fp32, greedy): two adapters and the base interleaved in one batch,
each request equal to its reference; a Phi-3 adapter on the fused q/k/v and gate/up; adapters that do not
fit the model refused at load, naming the limit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conveyor import LLM, BeamSearchParams, ContinuousBatchingConfig, LoRARequest, SamplingParams
from conveyor.errors import ConfigError, InvalidRequestError
from conveyor.models.decode_stack import DecodeStack
from tests.utils import (
    INVARIANT,
    MOE_CONFIGS,
    ROPE_BY_LENGTH_CONFIGS,
    USER_CHAT_TEMPLATE,
    VOCAB,
    TinyModel,
    all_free,
    assert_greedy_match,
    greedy,
    hf_greedy,
    make_lora_adapter,
    random_prompts,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def adapters(tiny_llama: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[LoRARequest, object]]:
    """Two adapters of the tiny Llama: all seven projections at rank 8, and q/v/down at rank 4 with rsLoRA."""
    a_dir, b_dir = tmp_path_factory.mktemp("lora_a"), tmp_path_factory.mktemp("lora_b")
    ref_a = make_lora_adapter(tiny_llama.reference, a_dir, seed=1)
    ref_b = make_lora_adapter(tiny_llama.reference, b_dir, seed=2, rank=4, targets=["q_proj", "v_proj", "down_proj"],
                              use_rslora=True)
    return {"a": (LoRARequest("a", 1, str(a_dir)), ref_a), "b": (LoRARequest("b", 2, str(b_dir)), ref_b)}


@pytest.fixture(scope="module")
def lora_llm(tiny_llama: TinyModel) -> LLM:
    return LLM(tiny_llama.path, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
               config=ContinuousBatchingConfig(num_blocks=256, max_batch_tokens=64))


def test_adapters_and_base_in_one_batch_equal_peft(lora_llm: LLM, tiny_llama: TinyModel, adapters: dict) -> None:
    prompts = random_prompts([5, 17, 9, 33, 3, 12], seed=3)
    which = ["a", None, "b", "a", None, "b"]
    max_new = [10, 8, 12, 6, 9, 7]
    outs = lora_llm.generate(prompts, [greedy(n) for n in max_new], use_tqdm=False,
                             lora_request=[adapters[w][0] if w else None for w in which])
    base_alone = lora_llm.generate([prompts[1], prompts[4]], [greedy(max_new[1]), greedy(max_new[4])],
                                   use_tqdm=False)
    for i, (prompt, w, n, out) in enumerate(zip(prompts, which, max_new, outs)):
        reference = adapters[w][1] if w else tiny_llama.reference
        ref, logits = hf_greedy(reference, prompt, n)
        assert_greedy_match(out.token_ids, ref, logits, f"prompt {i} adapter {w}")
    adapted = [o.token_ids for o, w in zip(outs, which) if w]
    base_refs = [hf_greedy(tiny_llama.reference, p, n)[0] for p, n, w in zip(prompts, max_new, which) if w]
    assert adapted != base_refs  # the adapters change the outputs (else the test proves nothing)
    assert [outs[1].token_ids, outs[4].token_ids] == [o.token_ids for o in base_alone]  # neighbours change nothing
    assert all_free(lora_llm)


@pytest.mark.cuda
def test_adapters_on_cuda_equal_peft(tiny_llama: TinyModel, adapters: dict) -> None:
    """The CUDA path (the Triton kernel for decode steps, the PyTorch path for prefill chunks), fp32."""
    llm = LLM(tiny_llama.path, dtype="float32", device="cuda", enable_lora=True, max_loras=2, max_lora_rank=8,
              config=ContinuousBatchingConfig(num_blocks=256, max_batch_tokens=64))
    prompts = random_prompts([5, 17, 9, 12], seed=4)
    which = ["a", None, "b", "a"]
    outs = llm.generate(prompts, [greedy(8)] * 4, use_tqdm=False,
                        lora_request=[adapters[w][0] if w else None for w in which])
    for i, (prompt, w, out) in enumerate(zip(prompts, which, outs)):
        ref, logits = hf_greedy(adapters[w][1] if w else tiny_llama.reference, prompt, 8)
        assert_greedy_match(out.token_ids, ref, logits, f"prompt {i} adapter {w}")
    assert all_free(llm)


def test_more_adapters_than_slots_wait_for_one(lora_llm: LLM, adapters: dict, tmp_path: Path,
                                               tiny_llama: TinyModel) -> None:
    """A third adapter with both slots in use waits until a request frees one, then runs right."""
    ref_c = make_lora_adapter(tiny_llama.reference, tmp_path, seed=4, rank=2, targets=["o_proj", "up_proj"])
    c = LoRARequest("c", 3, str(tmp_path))
    prompts = random_prompts([6, 6, 6, 6], seed=5)
    lora = [adapters["a"][0], adapters["b"][0], c, adapters["a"][0]]
    outs = lora_llm.generate(prompts, greedy(5), use_tqdm=False, lora_request=lora)
    ref, logits = hf_greedy(ref_c, prompts[2], 5)
    assert_greedy_match(outs[2].token_ids, ref, logits, "adapter c")
    assert not lora_llm.engine.lora.waiting and sum(lora_llm.engine.lora.slot_users) == 0
    assert all_free(lora_llm)


def test_prefix_cache_keys_blocks_by_adapter(lora_llm: LLM, adapters: dict) -> None:
    """A prompt computed under adapter a is not reused for b nor the base; under a again it is."""
    prompt = random_prompts([40], seed=7)[0]
    lora_llm.generate([prompt], greedy(2), use_tqdm=False, lora_request=adapters["a"][0])
    hits = []
    for lora in (adapters["b"][0], None, adapters["a"][0]):
        before = lora_llm.stats().prefix_cache_hit_tokens
        lora_llm.generate([prompt], greedy(2), use_tqdm=False, lora_request=lora)
        hits.append(lora_llm.stats().prefix_cache_hit_tokens - before)
    assert hits[0] == 0 and hits[1] == 0 and hits[2] > 0, hits
    assert all_free(lora_llm)


def test_phi3_fused_projections(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Phi-3 checkpoints hold qkv_proj and gate_up_proj fused: one adapter over the whole projection."""
    model = TinyModel("phi4", tmp_path_factory.mktemp("phi4"), ROPE_BY_LENGTH_CONFIGS["phi4"]())
    path = tmp_path_factory.mktemp("phi_lora")
    reference = make_lora_adapter(model.reference, path, seed=6,
                                  targets=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    llm = LLM(model.path, dtype="float32", enable_lora=True, config=ContinuousBatchingConfig(num_blocks=128))
    prompts = random_prompts([7, 20], seed=8)
    outs = llm.generate(prompts, greedy(8), use_tqdm=False, lora_request=[LoRARequest("phi", 1, str(path)), None])
    for out, prompt, ref_model in zip(outs, prompts, (reference, model.reference)):
        ref, logits = hf_greedy(ref_model, prompt, 8)
        assert_greedy_match(out.token_ids, ref, logits, "phi3")
    assert all_free(llm)
    llm.shutdown()


@pytest.mark.parametrize("kind", ["ernie4_5", "glm4"])
def test_pair_rope_families_reorder_the_adapters_q_and_k_rows(tiny_models: dict[str, TinyModel], kind: str,
                                                                tmp_path: Path) -> None:
    """ERNIE 4.5 and GLM-4 hold q's and k's rows reordered for RoPE (`models.pair_rope`): an adapter's B rows on
    q_proj and k_proj move with them (GLM-4: gate/up stored fused, one adapter over both)."""
    model = tiny_models[kind]
    mlp = ["gate_up_proj"] if kind == "glm4" else ["gate_proj", "up_proj"]
    reference = make_lora_adapter(model.reference, tmp_path, seed=7,
                                  targets=["q_proj", "k_proj", "v_proj", "o_proj", *mlp, "down_proj"])
    llm = LLM(model.path, dtype="float32", enable_lora=True, config=ContinuousBatchingConfig(num_blocks=128))
    prompts = random_prompts([7, 20], seed=8)
    outs = llm.generate(prompts, greedy(8), use_tqdm=False, lora_request=[LoRARequest(kind, 1, str(tmp_path)), None])
    for out, prompt, ref_model in zip(outs, prompts, (reference, model.reference)):
        ref, logits = hf_greedy(ref_model, prompt, 8)
        assert_greedy_match(out.token_ids, ref, logits, kind)
    assert all_free(llm)
    llm.shutdown()


def write_adapter(path: Path, config: dict, tensors: dict[str, torch.Tensor]) -> LoRARequest:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8} | config))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return LoRARequest(path.name, 9, str(path))


def test_bad_adapters_are_refused_naming_the_limit(lora_llm: LLM, tmp_path: Path) -> None:
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    good = {f"{q}.lora_A.weight": torch.zeros(4, 64), f"{q}.lora_B.weight": torch.zeros(64, 4)}
    cases = {
        "rank": ({"r": 16}, {f"{q}.lora_A.weight": torch.zeros(16, 64), f"{q}.lora_B.weight": torch.zeros(64, 16)},
                 "max_lora_rank=8"),
        "target": ({}, {"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64),
                        "base_model.model.lm_head.lora_B.weight": torch.zeros(300, 4)}, "supported target_modules"),
        "shape": ({}, {f"{q}.lora_A.weight": torch.zeros(4, 32), f"{q}.lora_B.weight": torch.zeros(64, 4)},
                  "does not match the base model"),
        "layer": ({}, {k.replace("layers.0", "layers.7"): v for k, v in good.items()}, "not in the model's LoRA layers"),
        "dora": ({"use_dora": True}, good, "DoRA"),
    }
    for name, (config, tensors, message) in cases.items():
        lora = write_adapter(tmp_path / name, config, tensors)
        with pytest.raises(ConfigError, match=message):
            lora_llm.generate([[5, 6]], greedy(1), use_tqdm=False, lora_request=lora)
    with pytest.raises(ConfigError, match="is not a directory"):
        lora_llm.generate([[5, 6]], greedy(1), use_tqdm=False, lora_request=LoRARequest("x", 5, str(tmp_path / "no")))
    assert all_free(lora_llm) and not lora_llm.engine.requests


def test_lora_off_refuses_adapters(tiny_llama: TinyModel, adapters: dict) -> None:
    llm = tiny_llama.llm()
    with pytest.raises(InvalidRequestError, match="enable_lora"):
        llm.generate([[5, 6]], greedy(1), use_tqdm=False, lora_request=adapters["a"][0])
    with pytest.raises(ConfigError, match="without enable_lora"):
        LLM(tiny_llama.path, max_loras=2)
    llm.shutdown()


def test_quantized_base_with_an_adapter(tiny_llama: TinyModel, adapters: dict) -> None:
    """int8 weights in bf16: the adapter's delta adds to the quantized base's output (bf16 adapters), and the
    first greedy tokens follow peft's fp32 reference as the base model's follow transformers'."""
    llm = LLM(tiny_llama.path, dtype="bfloat16", quantization="int8", enable_lora=True, max_loras=2,
              config=ContinuousBatchingConfig(num_blocks=128))
    prompts = random_prompts([6, 11, 19, 25, 8, 14], seed=9)
    lora, reference = adapters["a"]
    outs = llm.generate(prompts, greedy(1), use_tqdm=False, lora_request=lora)
    base = llm.generate(prompts, greedy(1), use_tqdm=False)
    expected = [hf_greedy(reference, p, 1)[0] for p in prompts]
    assert sum(o.token_ids == e for o, e in zip(outs, expected)) >= 5
    assert [o.token_ids for o in outs] != [o.token_ids for o in base]
    assert all_free(llm)
    llm.shutdown()


def stack_calls_with_adapters(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """From now on, for every decode stack call, whether it had adapter rows."""
    calls: list[bool] = []
    original = DecodeStack.__call__

    def spy(self: DecodeStack, x: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(len(args) > 5 and args[5] is not None)
        return original(self, x, *args)

    monkeypatch.setattr(DecodeStack, "__call__", spy)
    return calls


@pytest.mark.parametrize(("dtype", "quantization"), [("auto-fp32", "int8"), ("bfloat16", "int8"),
                                                    ("bfloat16", "none")])
def test_decode_stack_with_adapters_equals_the_eager_lora_path(tiny_llama: TinyModel, adapters: dict, dtype: str,
                                                               quantization: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode steps with adapter rows run on the native decode stack (counted) and give the eager LoRA
    path's tokens and log-probabilities to the bit, in fp32 compute and in bf16, two adapters (one on
    q/v/down only) and the base in one batch that shrinks as requests finish."""
    if dtype == "auto-fp32":
        monkeypatch.setattr("conveyor.layers.precision.cpu_flags", lambda: frozenset({"avx2"}))

    def make() -> LLM:
        return LLM(tiny_llama.path, dtype=dtype.removesuffix("-fp32"), quantization=quantization, enable_lora=True,
                   max_loras=2, max_lora_rank=8,
                   config=ContinuousBatchingConfig(num_blocks=256, max_batch_tokens=16, **INVARIANT))

    native = make()
    monkeypatch.setenv("CONVEYOR_DECODE_STACK", "0")
    eager = make()
    monkeypatch.delenv("CONVEYOR_DECODE_STACK")
    assert native.engine.model.decode_stack is not None and eager.engine.model.decode_stack is None
    adapted_calls = stack_calls_with_adapters(monkeypatch)
    prompts = random_prompts([5, 17, 9, 30, 3], seed=52)
    lora = [adapters[w][0] if w else None for w in ("a", None, "b", "a", "b")]
    params = [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, logprobs=VOCAB) for n in (8, 5, 10, 6, 9)]

    def run(llm: LLM, requests: list[LoRARequest | None]) -> tuple[list[list[int]], list[torch.Tensor]]:
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=requests)
        return ([o.token_ids for o in outs],
                [torch.tensor([[step[t] for t in range(VOCAB)] for step in o.logprobs]) for o in outs])

    ids, lps = run(native, lora)
    assert any(adapted_calls), "decode steps with adapter rows should run on the stack"
    ref_ids, ref_lps = run(eager, lora)
    assert ids == ref_ids
    assert all(torch.equal(a, b) for a, b in zip(lps, ref_lps))
    _, base_lps = run(native, [None] * len(prompts))
    assert all(not torch.equal(lps[i], base_lps[i]) for i, r in enumerate(lora) if r)  # the deltas do change them
    assert torch.equal(lps[1], base_lps[1])  # the base row is unchanged by its neighbours' adapters
    for llm in (native, eager):
        assert all_free(llm)
        llm.shutdown()


def test_adapters_on_a_mixture_of_experts_attention_in_the_stack(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3-MoE with an adapter on q/k/v/o: steps with adapter rows stay on the native decode stack, its sparse
    blocks inside it, and give the eager LoRA path's tokens and log-probabilities to the bit (bf16, int8)."""
    model = TinyModel("qwen3_moe", tmp_path / "model", MOE_CONFIGS["qwen3_moe"]())
    make_lora_adapter(model.reference, tmp_path / "a", seed=1, targets=["q_proj", "k_proj", "v_proj", "o_proj"])
    adapter = LoRARequest("a", 1, str(tmp_path / "a"))

    def make() -> LLM:
        return LLM(model.path, dtype="bfloat16", quantization="int8", enable_lora=True, max_loras=1, max_lora_rank=8,
                   config=ContinuousBatchingConfig(num_blocks=256, max_batch_tokens=16))

    native = make()
    monkeypatch.setenv("CONVEYOR_DECODE_STACK", "0")
    eager = make()
    monkeypatch.delenv("CONVEYOR_DECODE_STACK")
    stack = native.engine.model.decode_stack
    assert stack is not None and stack.moes and stack.lora and eager.engine.model.decode_stack is None
    adapted_calls = stack_calls_with_adapters(monkeypatch)
    prompts, lora = random_prompts([5, 17, 9], seed=52), [adapter, None, adapter]
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True, logprobs=VOCAB)
    outs = [llm.generate(prompts, params, use_tqdm=False, lora_request=lora) for llm in (native, eager)]
    assert any(adapted_calls), "decode steps with adapter rows should run on the stack"
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
    for a, b in zip(*outs):
        assert torch.equal(torch.tensor([[s[t] for t in range(VOCAB)] for s in a.logprobs]),
                           torch.tensor([[s[t] for t in range(VOCAB)] for s in b.logprobs]))
    for llm in (native, eager):
        assert all_free(llm)
        llm.shutdown()


def test_padded_steps_keep_each_row_on_its_adapter(lora_llm: LLM, tiny_llama: TinyModel, adapters: dict) -> None:
    """Padded steps (as CUDA graphs run them) put padding rows between the decodes and the prefills: the
    rows after them still run with their own adapters."""
    padded = LLM(tiny_llama.path, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
                 config=ContinuousBatchingConfig(num_blocks=256, max_batch_tokens=64, pad_steps=True,
                                                 q_padding_interval_size=8))
    prompts = random_prompts([3, 21, 7, 30], seed=10)
    lora = [adapters["a"][0], None, adapters["b"][0], adapters["a"][0]]
    params = [greedy(n) for n in (9, 4, 12, 6)]  # finishing at different steps: decodes beside prefill chunks
    ours = [o.token_ids for o in padded.generate(prompts, params, use_tqdm=False, lora_request=lora)]
    assert ours == [o.token_ids for o in lora_llm.generate(prompts, params, use_tqdm=False, lora_request=lora)]
    assert all_free(padded)
    padded.shutdown()


def test_chat_and_beam_search_take_an_adapter(lora_llm: LLM, adapters: dict) -> None:
    """`llm.chat(..., lora_request=)` and `llm.beam_search(..., lora_request=)` (vLLM's): a width-1 beam search is
    the greedy search, so both equal peft's greedy tokens under adapter a."""
    conversation = [{"role": "user", "content": "w5 w6 w7"}]
    ids = lora_llm.render_chat(conversation, chat_template=USER_CHAT_TEMPLATE)
    ref, logits = hf_greedy(adapters["a"][1], ids, 6)
    [out] = lora_llm.chat(conversation, greedy(6), use_tqdm=False, chat_template=USER_CHAT_TEMPLATE,
                          lora_request=adapters["a"][0])
    assert out.prompt_token_ids == ids
    assert_greedy_match(out.token_ids, ref, logits, "chat under adapter a")
    [beams] = lora_llm.beam_search([ids], BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True),
                                   lora_request=adapters["a"][0])
    assert_greedy_match(beams.sequences[0].tokens[len(ids):], ref, logits, "beam search under adapter a")
    assert all_free(lora_llm)
