"""The LM head fused with greedy sampling (`CausalLM.greedy_tokens`): taken only where every row is
plain greedy, and the tokens are those of the unfused head and the sampler."""

from __future__ import annotations

import pytest

from conveyor import SamplingParams
from conveyor.layers.quantization.linear import matmul_ops
from conveyor.models.base import CausalLM

from tests.utils import INVARIANT, TinyModel, random_prompts

pytestmark = pytest.mark.skipif(matmul_ops() is None, reason="native kernels unavailable")


def fused_calls(monkeypatch: pytest.MonkeyPatch, enabled: bool = True) -> list[int]:
    calls: list[int] = []
    original = CausalLM.greedy_tokens

    def counted(self, hidden):
        calls.append(hidden.shape[0])
        return original(self, hidden) if enabled else None

    monkeypatch.setattr(CausalLM, "greedy_tokens", counted)
    return calls


def test_fused_greedy_equals_the_sampler(tiny_models: dict[str, TinyModel], monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = random_prompts([5, 17, 9, 30], seed=61)
    greedy = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    llm = tiny_models["llama"].llm(dtype="bfloat16", quantization="int8", **INVARIANT)
    calls = fused_calls(monkeypatch)
    fused = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert calls, "plain greedy batches should take the fused head"
    fused_calls(monkeypatch, enabled=False)
    assert [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == fused
    alloc = llm.engine.allocator
    assert alloc.num_free_blocks == alloc.num_total_blocks


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=4, temperature=0, logprobs=2),
    SamplingParams(max_new_tokens=4, temperature=0, repetition_penalty=1.3),
    SamplingParams(max_new_tokens=4, temperature=0, min_tokens=4),
    SamplingParams(max_new_tokens=4, temperature=0, logit_bias={3: 5.0}),
    SamplingParams(max_new_tokens=4, temperature=0.8, seed=1),
], ids=["logprobs", "penalty", "min_tokens", "logit_bias", "sampled"])
def test_rows_that_need_logits_keep_them(tiny_models: dict[str, TinyModel], monkeypatch: pytest.MonkeyPatch,
                                          params: SamplingParams) -> None:
    llm = tiny_models["llama"].llm(dtype="bfloat16", quantization="int8")
    calls = fused_calls(monkeypatch)
    plain = SamplingParams(max_new_tokens=4, temperature=0)
    llm.generate(random_prompts([6, 6], seed=62), [plain, params], use_tqdm=False)
    assert not calls, "a batch with one row that needs its logits must not fuse the head"
