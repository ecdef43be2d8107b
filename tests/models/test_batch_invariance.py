"""Batch invariance: a request's tokens and logprobs are the same bits alone, in a batch of 64 and with its
prompt cut into other chunks; by default in bf16 on CPU where every bf16 row count stays on the native kernels
(not AMX), guaranteed with batch_invariant=True
(models/batch_invariance.py)."""

from __future__ import annotations

import pytest
import torch

from conveyor import ContinuousBatchingConfig, SamplingParams
from conveyor.errors import ConfigError
from conveyor.layers.quantization.linear import bf16_kernel_max_rows

from tests.utils import INVARIANT, TinyModel, random_prompts

PROMPT = random_prompts([150], seed=7)[0]  # several 64-position key blocks, pages of 16
OTHERS = random_prompts([5 + (37 * i) % 200 for i in range(63)], seed=8)


def outputs(model: TinyModel, prompts: list[list[int]], params: SamplingParams, dtype: str, quantization: str | None,
            **config: object) -> tuple[list[int], list[float]]:
    """The first prompt's token ids and the logprob of each."""
    llm = model.llm(dtype=dtype, quantization=quantization, **config)
    try:
        out = llm.generate(prompts, params, use_tqdm=False)[0]
    finally:
        llm.shutdown()
    return out.token_ids, [entry[token] for token, entry in zip(out.token_ids, out.logprobs)]


def check_invariance(model: TinyModel, temperature: float, dtype: str, quantization: str | None,
                     **config: object) -> None:
    params = SamplingParams(max_new_tokens=24, temperature=temperature, seed=3, ignore_eos=True, logprobs=1)
    alone = outputs(model, [PROMPT], params, dtype, quantization, max_batch_tokens=64, **config)
    assert len(alone[0]) == 24
    batched = outputs(model, [PROMPT] + OTHERS, params, dtype, quantization, max_batch_tokens=64, **config)
    assert batched == alone  # token ids and logprobs, bit for bit
    rechunked = outputs(model, [PROMPT], params, dtype, quantization, max_batch_tokens=23, **config)
    assert rechunked == alone


@pytest.mark.parametrize(("kind", "quantization"), [
    ("llama", None),            # bf16 weights in the native GEMM's tiles; decode steps through the native stack
    ("llama", "int8"),          # int8 weights, activations quantized per row
    ("qwen3", None),            # q/k norms (no native stack)
    ("mistral_sliding", None),  # a sliding window shorter than a page
    ("gemma2", None),           # soft-capping, sliding and full layers, PyTorch norms and GELU
])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_bf16_is_batch_invariant_by_default(tiny_models: dict[str, TinyModel], kind: str, quantization: str | None,
                                            temperature: float) -> None:
    if bf16_kernel_max_rows() is not None:
        pytest.skip("AMX CPUs take oneDNN's AMX matmul above 128 bf16 rows and prefill attention on the tiles: "
                    "batch invariance needs batch_invariant=True there (tested below)")
    check_invariance(tiny_models[kind], temperature, "bfloat16", quantization)


@pytest.mark.parametrize(("dtype", "quantization"), [("bfloat16", "int4"), ("bfloat16", None), ("auto-fp32", "int8")])
def test_batch_invariant_true_holds_on_every_cpu(tiny_llama: TinyModel, dtype: str, quantization: str | None,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Also fp32 compute over quantized weights (dtype 'auto' on a CPU without bf16 dot products): every
    linear is the native kernel."""
    if dtype == "auto-fp32":
        monkeypatch.setattr("conveyor.layers.precision.cpu_flags", lambda: frozenset({"avx2"}))
    dtype = dtype.removesuffix("-fp32")
    llm = tiny_llama.llm(dtype=dtype, quantization=quantization, batch_invariant=True)
    assert llm.engine.model.decode_stack is not None  # it computes what the eager layers compute
    assert llm.engine.runner.attention.amx is False  # prefill attention in decode's arithmetic (AMX CPUs)
    llm.shutdown()
    check_invariance(tiny_llama, 0.0, dtype, quantization, batch_invariant=True)


def test_batch_invariance_refuses_what_it_cannot_keep(tiny_llama: TinyModel) -> None:
    with pytest.raises(ConfigError, match="dense float32 linear"):
        tiny_llama.llm(dtype="float32", batch_invariant=True)
    with pytest.raises(ConfigError, match="native CPU attention kernels"):
        tiny_llama.llm(dtype="bfloat16", batch_invariant=True, attention_backend="torch")


def test_vllm_switch_turns_it_on(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ContinuousBatchingConfig().batch_invariant is False
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert ContinuousBatchingConfig().batch_invariant is True
    assert ContinuousBatchingConfig(batch_invariant=False).batch_invariant is False
    with pytest.raises(ConfigError, match="batch_invariant must be"):
        ContinuousBatchingConfig(batch_invariant="yes")


def test_linear_rows_do_not_depend_on_their_neighbours(tiny_llama: TinyModel) -> None:
    """A row's projection is the same bits in any batch (activations quantized per row, K summed in one order
    at every row count): what the engine tests above rest on. AMX CPUs keep every row count there only when
    batch invariance is asked for (above 128 rows oneDNN's AMX matmul runs otherwise)."""
    llm = tiny_llama.llm(dtype="bfloat16", quantization="int8", **INVARIANT)
    try:
        proj = llm.engine.model.layers[0].qkv_proj
        x = torch.randn(70, proj.in_features, generator=torch.Generator().manual_seed(0)).bfloat16()
        whole = proj(x)
        for rows in (slice(0, 1), slice(5, 6), slice(3, 40), slice(69, 70)):
            assert torch.equal(proj(x[rows]), whole[rows])
    finally:
        llm.shutdown()
