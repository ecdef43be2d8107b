"""Padded steps (static buffers, CUDA-graph shapes) give exactly the unpadded steps' outputs (fp32, on CPU).

Each step of a real workload runs twice on the same chunks, unpadded then padded: both from the same cache: the real rows'
hidden states and sampled logits must be bitwise equal, the cache outside the reserved chunks
exactly what the unpadded run wrote (padding writes only there), and the pool's free count untouched.
One-row steps are compared to 1e-5 only: unpadded they take MKL's single-row gemv, padded the
multi-row matmul (both paths are row-count invariant from 2 rows on, see models/linear.py).
"""

from __future__ import annotations

import pytest
import torch

from conveyor import SamplingParams
from conveyor.cache.pool import NUM_RESERVED_CHUNKS
from conveyor.engine.step_buffers import round_up, sample_bucket


def check_every_step(llm, compared: list[int]) -> None:
    """Wrap the runner so each step runs unpadded, then padded (whose result the engine keeps)."""
    runner, engine = llm.engine.runner, llm.engine
    buffers = runner.buffers
    assert buffers, "pad_steps=True gives the runner static buffers"

    def execute(chunks):
        runner.buffers = []
        plain = runner.prepare(chunks)
        runner.buffers = buffers
        padded = runner.prepare(chunks)
        free = engine.allocator.num_free_blocks
        reserved = NUM_RESERVED_CHUNKS * runner.page_size
        with torch.inference_mode():
            # Both passes start from the same cache: a sliding-window chunk overwrites ring slots its own
            # context reads, so running one step twice over one cache is not idempotent.
            start = [kv.clone() for kv in runner.pool.kv]
            h0 = runner.forward(plain)
            written = [kv[:, reserved:].view(torch.uint8).clone() for kv in runner.pool.kv]  # bits: uninitialised pool
            for kv, old in zip(runner.pool.kv, start):
                kv.copy_(old)
            h1 = runner.forward(padded)
        nd, total = plain.metas[0].num_decodes, plain.input_ids.numel()
        shape = padded.shape
        pad = shape.num_tokens - total
        assert shape.num_tokens == round_up(total, engine.config.q_padding_interval_size)
        assert shape.num_samples == sample_bucket(len(plain.samplers))
        assert shape.table_width % (engine.config.kv_padding_interval_size // engine.config.page_size) == 0
        real = torch.cat([h1[:nd], h1[nd + pad:]])
        if total > 1:
            assert torch.equal(real, h0), (real - h0).abs().max()
        else:
            torch.testing.assert_close(real, h0, atol=1e-5, rtol=0)
        n = len(plain.samplers)
        assert padded.sample_rows[:n].tolist() == [r if r < nd else r + pad for r in plain.sample_rows.tolist()]
        for kv, old in zip(runner.pool.kv, written):  # the same K/V as unpadded; padding only in the reserved chunks
            assert torch.equal(kv[:, reserved:].view(torch.uint8), old)
        assert engine.allocator.num_free_blocks == free
        compared.append(total)
        for kv, old in zip(runner.pool.kv, start):  # the engine's own pass, from the step's starting cache again
            kv.copy_(old)
        return runner.run(padded)

    runner.execute = execute


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_padded_steps_equal_unpadded(tiny_models, kind: str) -> None:
    model = tiny_models[kind]
    # (no prefix caching: a sliding window's snapshots are taken once per step, and each step is prepared twice here)
    padded = model.llm(pad_steps=True, max_batch_tokens=40, page_size=4, kv_padding_interval_size=16,
                       allow_block_sharing=False)
    plain = model.llm()
    compared: list[int] = []
    check_every_step(padded, compared)
    prompts = [[5 + i + j for j in range(n)] for i, n in enumerate((3, 17, 30, 9))]  # 30 chunks at 40 tokens
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    initial = padded.engine.allocator.num_free_blocks
    outs = padded.generate(prompts, params, use_tqdm=False)
    ref = plain.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert len(compared) > 12 and any(t > 4 for t in compared)
    assert padded.engine.allocator.num_free_blocks == initial
    torch.testing.assert_close([list(map(float, d.values())) for o in outs for d in o.logprobs],
                               [list(map(float, d.values())) for o in ref for d in o.logprobs], atol=1e-5, rtol=0)


def test_pad_steps_work_with_the_native_decode_stack(tiny_models) -> None:
    """Quantized weights take the native decode stack for decode batches: padding rows are harmless there."""
    model = tiny_models["llama"]
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    padded = model.llm(dtype="auto", quantization="int8", pad_steps=True)
    outs = [o.token_ids for o in padded.generate(prompts, params, use_tqdm=False)]
    assert outs == [o.token_ids for o in model.llm(dtype="auto", quantization="int8").generate(prompts, params, use_tqdm=False)]
    assert padded.engine.allocator.num_free_blocks == padded.engine.allocator.num_total_blocks
