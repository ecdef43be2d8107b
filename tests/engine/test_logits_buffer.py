"""The runner's reused logits buffer (`step_buffers.LogitsBuffer`): a quantized LM head writes each
step's logits into one buffer instead of a fresh tensor, with the same tokens; rows kept for
speculative verification, which outlive their step, get their own tensor."""

from __future__ import annotations

import pytest
import torch

from conveyor import SamplingParams
from conveyor.engine.step_buffers import LogitsBuffer
from conveyor.layers.quantization.linear import QuantMatmul, matmul_ops
from conveyor.layers.quantization.tensors import quantize_int8
from conveyor.models.base import CausalLM

from tests.utils import INVARIANT, NGRAM, TinyModel, copy_prompts, random_prompts

pytestmark = pytest.mark.skipif(matmul_ops() is None, reason="native kernels unavailable")


def test_buffer_grows_and_hands_out_views() -> None:
    logits = LogitsBuffer(10)
    first = logits.take(3)
    assert first.shape == (3, 10) and first.is_contiguous() and logits.buffer.shape == (4, 10)
    assert logits.take(4).data_ptr() == first.data_ptr(), "a step that fits reuses the buffer"
    assert logits.take(9).shape == (9, 10) and logits.buffer.shape == (16, 10)
    assert LogitsBuffer(None).take(3) is None, "a head that writes into no buffer gets none"


def test_quant_head_writes_into_out() -> None:
    head = QuantMatmul([quantize_int8(torch.randn(100, 64))], out_dtype=torch.float32)
    x = torch.randn(7, 64)
    out = torch.full((7, 100), float("nan"))
    assert head(x, out=out).data_ptr() == out.data_ptr()
    assert torch.equal(out, head(x))
    with pytest.raises(ValueError, match=r"\[7, 100\]"):
        head(x, out=torch.empty(7, 99))
    with pytest.raises(ValueError, match="contiguous"):
        head(x, out=torch.empty(100, 7).T)


def head_calls(monkeypatch: pytest.MonkeyPatch, fresh: bool = False) -> list[tuple[int, int | None]]:
    """(rows, data pointer of `out` or None) of every `compute_logits` call; `fresh`: drop the buffer."""
    calls: list[tuple[int, int | None]] = []
    original = CausalLM.compute_logits

    def recorded(self, hidden, out=None):
        out = None if fresh else out
        calls.append((hidden.shape[0], None if out is None else out.data_ptr()))
        return original(self, hidden, out)

    monkeypatch.setattr(CausalLM, "compute_logits", recorded)
    return calls


def test_sampled_steps_reuse_one_buffer_with_the_same_tokens(tiny_models: dict[str, TinyModel],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    llm = tiny_models["llama"].llm(dtype="bfloat16", quantization="int8", **INVARIANT)
    prompts = random_prompts([5, 17, 9, 30, 12], seed=71)
    params = [SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.95, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    calls = head_calls(monkeypatch)
    reused = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    pointers = {ptr for _, ptr in calls}
    assert len(calls) > 10 and None not in pointers and len(pointers) <= 2, pointers  # at most one regrowth
    head_calls(monkeypatch, fresh=True)
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == reused
    alloc = llm.engine.allocator
    assert alloc.num_free_blocks == alloc.num_total_blocks


def test_verified_rows_get_their_own_logits(tiny_models: dict[str, TinyModel], monkeypatch: pytest.MonkeyPatch) -> None:
    llm = tiny_models["llama_smooth"].llm(dtype="bfloat16", quantization="int8", max_batch_tokens=32,
                                          speculative_config=NGRAM)
    calls = head_calls(monkeypatch)
    greedy = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    llm.generate(copy_prompts()[:3], greedy, use_tqdm=False)
    assert llm.engine.speculator.stats()["num_drafts"] > 0
    assert calls and all(ptr is None for _, ptr in calls), "steps that verify proposals keep their logits"
