"""The native decode stack computes what the eager layers compute, bit for bit (a request's tokens and
logprobs do not depend on which path its steps took), is used exactly where it applies, and leaves the
cache as the eager path does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.layers.quantization import linear as quant_linear
from conveyor.models.decode_stack import MAX_ROWS, DecodeStack, ThreadChooser

from tests.utils import MOE_CONFIGS, TINY_CONFIGS, VOCAB, TinyModel, make_gpt_oss, random_prompts


def run(llm: LLM, prompts: list[list[int]], n: int = 10) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy tokens, and the full log-probabilities of every generated position."""
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, logprobs=VOCAB),
                        use_tqdm=False)
    lps = torch.tensor([[[step[t] for t in range(VOCAB)] for step in o.logprobs] for o in outs])
    return [o.token_ids for o in outs], lps


def counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows of every stack call from now on."""
    calls: list[int] = []
    original = DecodeStack.__call__

    def spy(self, x, *args):
        calls.append(x.shape[0])
        return original(self, x, *args)

    monkeypatch.setattr(DecodeStack, "__call__", spy)
    return calls


@pytest.mark.parametrize(("dtype", "quantization"), [("auto-fp32", "int8"), ("bfloat16", "int8"),
                                                    ("bfloat16", "none")])
def test_stack_matches_the_eager_layers(tiny_models: dict[str, TinyModel], dtype: str, quantization: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same tokens and log-probabilities to the bit, decode rows through the stack and prefill chunks
    eager, in a batch whose size changes as requests finish, in fp32 compute and in bf16."""
    model = tiny_models["llama_smooth"]
    if dtype == "auto-fp32":
        monkeypatch.setattr("conveyor.layers.precision.cpu_flags", lambda: frozenset({"avx2"}))
    prompts = random_prompts([5, 17, 9, 30, 3], seed=51)
    native = model.llm(dtype=dtype.removesuffix("-fp32"), quantization=quantization, max_batch_tokens=16, page_size=4)
    monkeypatch.setenv("CONVEYOR_DECODE_STACK", "0")
    eager = model.llm(dtype=dtype.removesuffix("-fp32"), quantization=quantization, max_batch_tokens=16, page_size=4)
    monkeypatch.undo()
    assert native.engine.model.decode_stack is not None and eager.engine.model.decode_stack is None
    calls = counting(monkeypatch)
    ids, lps = run(native, prompts)
    assert calls and max(calls) <= len(prompts), "decode steps should go through the stack"
    ref_ids, ref_lps = run(eager, prompts)
    assert ids == ref_ids
    assert torch.equal(lps, ref_lps)
    for llm in (native, eager):
        assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_total_blocks


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_row_and_head_splits_agree(tiny_models: dict[str, TinyModel], threads: int,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches of 1, 2 and 5 rows with 1-3 threads: rows split across threads, or (fewer rows than
    threads) the (row, head) pairs of attention; the same bits as the eager layers."""
    monkeypatch.setattr("conveyor.layers.precision.cpu_flags", lambda: frozenset({"avx2"}))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = tiny_models["llama_smooth"]
        native = model.llm(dtype="auto", quantization="int4")
        monkeypatch.setenv("CONVEYOR_DECODE_STACK", "0")
        eager = model.llm(dtype="auto", quantization="int4")
        for n in (1, 2, 5):
            prompts = random_prompts([7 + i for i in range(n)], seed=60 + n)
            ids, lps = run(native, prompts, n=6)
            ref_ids, ref_lps = run(eager, prompts, n=6)
            assert ids == ref_ids
            assert torch.equal(lps, ref_lps)
    finally:
        torch.set_num_threads(before)


def test_stack_only_where_it_applies(tiny_models: dict[str, TinyModel], monkeypatch: pytest.MonkeyPatch) -> None:
    smooth = tiny_models["llama_smooth"]
    assert smooth.llm(dtype="float32").engine.model.decode_stack is None  # the exact path: dense fp32 weights
    assert smooth.llm(dtype="bfloat16", quantization="none").engine.model.decode_stack is not None  # dense bf16
    assert tiny_models["qwen3"].llm(dtype="bfloat16", quantization="int8").engine.model.decode_stack is not None  # q/k norms
    assert tiny_models["gemma2"].llm(dtype="bfloat16", quantization="int8").engine.model.decode_stack is None
    assert tiny_models["qwen2"].llm(dtype="bfloat16", quantization="int4").engine.model.decode_stack is not None  # biases
    monkeypatch.setattr(quant_linear, "matmul_ops", lambda: None)
    assert smooth.llm(dtype="bfloat16", quantization="int8").engine.model.decode_stack is None


def test_big_decode_batches_stay_eager(tiny_models: dict[str, TinyModel], monkeypatch: pytest.MonkeyPatch) -> None:
    llm = tiny_models["llama_smooth"].llm(dtype="bfloat16", quantization="int4", max_requests_per_batch=MAX_ROWS + 8)
    calls = counting(monkeypatch)
    prompts = random_prompts([4] * (MAX_ROWS + 4), seed=52)
    llm.generate(prompts, SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
    assert not calls, f"{MAX_ROWS + 4} decode rows are over the stack's {MAX_ROWS}"


@pytest.mark.parametrize(("kind", "dtype"), [("mistral_sliding", "auto"), ("qwen2", "auto"), ("smollm3", "auto"),
                                           ("qwen3", "auto"), ("qwen3", "bfloat16"), ("lfm2", "auto"),
                                           ("lfm2", "bfloat16"), ("lfm2_kv1", "bfloat16"), ("granite", "auto"),
                                           ("granite", "bfloat16"), ("granitemoehybrid", "auto"),
                                           ("granitemoehybrid", "bfloat16")])
def test_sliding_window_biases_norms_and_convolutions(tiny_models: dict[str, TinyModel], kind: str, dtype: str,
                                                      monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Mistral with a window far shorter than the prompts (ring slots), Qwen2's q/k/v biases, SmolLM3's
    layer without RoPE, Qwen3's per-head q/k norms, LFM2's short convolutions beside attention layers with
    q/k norms (rings of 3 slots in pages of 4, and with one KV head rows of two slots, rings across
    pages), Granite's residual multiplier, Granite 4.0-H's Mamba-2 layers (rings and states across pages)
    beside a NoPE attention layer: the same bits as the eager layers, in fp32 compute and bf16."""
    if dtype == "auto":
        monkeypatch.setattr("conveyor.layers.precision.cpu_flags", lambda: frozenset({"avx2"}))
    prompts = random_prompts([20, 13, 31], seed=53)
    model = (TinyModel("lfm2", tmp_path, TINY_CONFIGS["lfm2"](num_key_value_heads=1)) if kind == "lfm2_kv1"
             else tiny_models[kind])
    native = model.llm(dtype=dtype, quantization="int8", page_size=4)
    monkeypatch.setenv("CONVEYOR_DECODE_STACK", "0")
    eager = model.llm(dtype=dtype, quantization="int8", page_size=4)
    monkeypatch.delenv("CONVEYOR_DECODE_STACK")
    assert native.engine.model.decode_stack is not None and eager.engine.model.decode_stack is None
    assert native.dtype == (torch.float32 if dtype == "auto" else torch.bfloat16)
    calls = counting(monkeypatch)
    ids, lps = run(native, prompts, n=16)
    assert calls, "decode steps should go through the stack"
    ref_ids, ref_lps = run(eager, prompts, n=16)
    assert ids == ref_ids
    assert torch.equal(lps, ref_lps)


def test_thread_chooser_follows_the_timings() -> None:
    """With both cores free two threads win; when two threads turn slow (a busy neighbour), the next
    probe of one thread wins, and two threads come back at their first probe that measures faster."""
    chooser = ThreadChooser(2, probe_every=4, window=3)
    speed = {2: 1.0, 1: 1.8}
    picks = []
    for call in range(60):
        if call == 20:
            speed[2] = 50.0  # the neighbour arrives
        if call == 40:
            speed[2] = 1.0
        n = chooser.choose()
        picks.append(n)
        chooser.record(speed[n])
    assert picks[12:20].count(2) >= 6
    assert picks[30:40].count(1) >= 7
    assert picks[44:60].count(2) == 12  # all but the probes of one thread, from the first probe on
    assert ThreadChooser(1).choose() == 1


def test_ministral3_queries_past_the_original_length_leave_the_stack(tiny_models: dict[str, TinyModel],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Ministral 3 scales its queries past `original_max_position_embeddings` (16 here), which the stack does not:
    decode steps below it take the stack, those past it the eager layers; the same bits as eager throughout."""
    monkeypatch.setattr("conveyor.layers.precision.cpu_flags", lambda: frozenset({"avx2"}))
    prompts = random_prompts([5, 9, 3], seed=54)  # decoding from below 16 tokens to past it
    model = tiny_models["ministral3"]
    native = model.llm(dtype="auto", quantization="int8", page_size=4)
    monkeypatch.setenv("CONVEYOR_DECODE_STACK", "0")
    eager = model.llm(dtype="auto", quantization="int8", page_size=4)
    monkeypatch.undo()
    monkeypatch.setattr("conveyor.layers.precision.cpu_flags", lambda: frozenset({"avx2"}))
    assert native.engine.model.decode_stack is not None
    calls = counting(monkeypatch)
    ids, lps = run(native, prompts, n=16)
    assert 0 < len(calls) < 16, "the steps below 16 tokens take the stack, the later ones not"
    ref_ids, ref_lps = run(eager, prompts, n=16)
    assert ids == ref_ids
    assert torch.equal(lps, ref_lps)


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe", "granitemoe", "ernie4_5_moe", "lfm2_moe",
                                  "granitemoehybrid", "gpt_oss"])
@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_mixtures_of_experts_in_the_stack(kind: str, dtype: str, monkeypatch: pytest.MonkeyPatch,
                                          tmp_path: Path) -> None:
    """Each routing rule (softmax renormalized or not, the top-k logits' softmax, a choosing bias over the
    softmax or over sigmoid scores), shared experts gated and not, dense layers beside sparse ones, attention,
    conv and Mamba layers around them: the same bits through the stack as through the eager layers (each
    calling the same native block), in fp32 compute and bf16; gpt-oss's attention sinks, sliding layers, biases and
    clamped experts too; the expert-load observer sees the stack's steps."""
    if dtype == "auto":
        monkeypatch.setattr("conveyor.layers.precision.cpu_flags", lambda: frozenset({"avx2"}))
    model = make_gpt_oss(tmp_path) if kind == "gpt_oss" else TinyModel(kind, tmp_path, MOE_CONFIGS[kind]())
    with torch.no_grad():  # (choosing biases large enough to reorder the experts)
        for name, tensor in [*model.reference.named_parameters(), *model.reference.named_buffers()]:
            if name.endswith(("expert_bias", "e_score_correction_bias")):
                tensor.copy_(torch.linspace(0.3, -0.3, tensor.numel()).reshape(tensor.shape))
    model.reference.save_pretrained(model.path)
    prompts = random_prompts([20, 13, 31, 4], seed=54)
    native = model.llm(dtype=dtype, quantization="int8", page_size=4)
    monkeypatch.setenv("CONVEYOR_DECODE_STACK", "0")
    eager = model.llm(dtype=dtype, quantization="int8", page_size=4)
    monkeypatch.delenv("CONVEYOR_DECODE_STACK")
    stack = native.engine.model.decode_stack
    assert stack is not None and stack.moes and eager.engine.model.decode_stack is None
    loads: list[list[int]] = []
    stack.moes[0].observer = loads.append
    calls = counting(monkeypatch)
    ids, lps = run(native, prompts, n=12)
    assert calls, "decode steps should go through the stack"
    assert sum(sum(counts) for counts in loads) == stack.moes[0].top_k * (sum(len(p) for p in prompts) + 11 * 4)
    ref_ids, ref_lps = run(eager, prompts, n=12)
    assert ids == ref_ids
    assert torch.equal(lps, ref_lps)
    for llm in (native, eager):
        assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_total_blocks
