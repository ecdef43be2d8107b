"""Tests for `conveyor bench roofline` / `step` (conveyor.bench.roofline) on a tiny random Llama.

The dense ceiling is only a fair floor if it is the same model: one decode step through
`DenseDecodeAttention`, over K/V copied out of Conveyor's paged cache, must give the logits that
Conveyor's own paged step gives.
"""

from __future__ import annotations

import json

import pytest
import torch

from conveyor import SamplingParams
from conveyor.bench import main
from conveyor.bench.roofline import (DenseDecodeAttention, dense_decode_step, run_step,
                                     step_config)
from conveyor.request import RequestState

from .conftest import TinyModel, random_prompts

BATCH, CONTEXT = 3, 15


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return TinyModel("llama", tmp_path_factory.mktemp("roofline_llama"))


def dense_from_paged(engine, requests, length: int) -> list[torch.Tensor]:
    """Positions 0 .. length-1 of each request's K/V, copied from the paged pool into dense
    `[2, batch, kv_heads, length + 1, head_dim]` tensors (position `length` is left for the new token)."""
    page = engine.pool.page_size
    caches = []
    for kv in engine.pool.kv:
        dense = torch.full((2, len(requests), kv.shape[2], length + 1, kv.shape[3]), float("nan"), dtype=kv.dtype)
        for b, r in enumerate(requests):
            slots = torch.tensor([blk * page + o for blk in engine.allocator.block_table(r.request_id)
                                  for o in range(page)][:length])
            dense[:, b, :, :length] = kv[:, slots].transpose(1, 2)
        caches.append(dense)
    return caches


def test_dense_decode_matches_paged_step(tiny: TinyModel) -> None:
    # Small pages and two decode steps before the check: each request's blocks are interleaved with
    # the others' in the pool, so the copy below really follows the block tables.
    llm = tiny.llm(page_size=4, max_batch_tokens=64)
    engine = llm.engine
    free = engine.allocator.num_free_blocks
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    requests = [engine.make_request(f"r{i}", p, params) for i, p in enumerate(random_prompts([CONTEXT] * BATCH))]
    for r in requests:
        engine.add_request(r)
    engine.step()  # every prompt prefills in this one pass
    assert all(r.state is RequestState.DECODING for r in requests)
    engine.step()
    engine.step()
    length = CONTEXT + 2  # tokens with K/V in the cache; the last generated token's is not yet there
    assert all(r.num_computed_tokens == length and r.num_tokens == length + 1 for r in requests)
    tables = [engine.allocator.block_table(r.request_id) for r in requests]
    assert any(t[-1] != t[-2] + 1 for t in tables), tables

    dense_kv = dense_from_paged(engine, requests, length)
    ids = torch.tensor([r.output_token_ids[-1] for r in requests])
    dense_logits, dense_tokens = dense_decode_step(engine.model, ids, dense_kv, length, DenseDecodeAttention())

    captured = {}
    sampler = engine.runner.sampler

    def capture(logits, reqs):
        captured["logits"], captured["ids"] = logits.clone(), [r.request_id for r in reqs]
        return sampler(logits, reqs)

    engine.runner.sampler = capture
    try:
        stepped = engine.step()
    finally:
        engine.runner.sampler = sampler
    assert len(stepped) == BATCH
    order = [captured["ids"].index(r.request_id) for r in requests]
    paged_logits = captured["logits"][order]
    torch.testing.assert_close(dense_logits, paged_logits, atol=1e-4, rtol=0)
    assert dense_tokens.tolist() == [r.output_token_ids[-1] for r in requests]
    # The dense backend wrote the new token's K/V where the paged step wrote it.
    written = dense_from_paged(engine, requests, length + 1)  # now position `length` is in the pool too
    for dense, paged in zip(dense_kv, written):
        torch.testing.assert_close(dense[:, :, :, length], paged[:, :, :, length], atol=1e-5, rtol=0)
    for r in requests:
        engine.cancel_request(r.request_id)
    assert engine.allocator.num_free_blocks == free


def positive(d: dict, keys: list[str]) -> None:
    for key in keys:
        assert d[key] > 0, f"{key} = {d[key]}"


def test_step_report_has_every_figure(tiny: TinyModel) -> None:
    from conveyor import LLM

    llm = LLM(tiny.path, dtype="float32", config=step_config(4, 10, 2 + 1 + 4))
    free = llm.engine.allocator.num_free_blocks
    report = run_step(llm, batch=4, context=10, steps=2, warmup_steps=1, repeats=2, warmup=1)
    assert llm.engine.allocator.num_free_blocks == free and not llm.engine.has_unfinished_requests()
    assert report["benchmark"] == "step" and report["batch"] == 4 and report["context"] == 10
    mm, dense, step = report["matmul"], report["dense"], report["step"]
    assert [s["name"] for s in mm["shapes"]] == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"]
    for s in mm["shapes"]:
        positive(s, ["time_s", "gflops", "count"])
    # 2 x (2 layers x (qkv 128x64 + o 64x64 + gate_up 256x64 + down 64x128) + LM head 300x64)
    assert mm["flops_per_token"] == 2 * (2 * (128 * 64 + 64 * 64 + 256 * 64 + 64 * 128) + 300 * 64)
    positive(mm, ["time_per_step_s", "gflops", "tok_per_s"])
    positive(dense, ["step_s", "forward_s", "lm_head_argmax_s", "tok_per_s"])
    positive(step, ["step_s", "forward_s", "prepare_s", "lm_head_s", "sampling_s", "lm_head_sampling_s",
                    "rest_s", "outside_forward_s", "outside_forward_fraction", "host_fraction", "tok_per_s",
                    "prefill_s"])
    assert step["start_context"] == [10, 10] and step["timed_context"] == [11, 12]
    assert step["prefill_steps"] == 1 and len(step["step_samples_s"]) == 2
    assert step["forward_s"] < step["step_s"] and 0 < step["outside_forward_fraction"] < 1
    positive(report["ratios"], ["dense_over_linear_ceiling", "step_over_dense", "forward_over_dense_forward",
                                "step_over_dense_per_step"])
    assert dense["interleaved"] and dense["repeats"] == step["steps"]
    assert set(report["targets"]) == {"step_over_dense_max", "step_over_dense_met", "outside_forward_fraction_max",
                                      "outside_forward_met"}
    json.dumps(report)
    # the hooks are gone: the model and runner are their plain selves again
    assert "forward" not in vars(llm.engine.model) and "prepare" not in vars(llm.engine.runner)


def test_roofline_cli_writes_report(tiny: TinyModel, tmp_path, capsys) -> None:
    out = tmp_path / "roofline.json"
    assert main(["roofline", "--model", str(tiny.path), "--batch", "4", "--context", "6", "--repeats", "2",
                 "--warmup", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Dense ceiling" in printed and "linear-only ceiling" in printed
    report = json.loads(out.read_text())
    assert report["benchmark"] == "roofline" and set(report) >= {"model", "environment", "matmul", "dense", "ratios"}
    assert report["dense"]["tok_per_s"] > 0 and report["matmul"]["tok_per_s"] > 0


def test_step_cli_prints_split_and_ratio(tiny: TinyModel, tmp_path, capsys) -> None:
    out = tmp_path / "step.json"
    assert main(["step", "--model", str(tiny.path), "--batch", "3", "--context", "5", "--steps", "2",
                 "--warmup-steps", "1", "--repeats", "2", "--warmup", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "step / dense ceiling" in printed and "outside the model forward" in printed
    assert json.loads(out.read_text())["ratios"]["step_over_dense"] > 0


def test_rejects_bad_arguments() -> None:
    with pytest.raises(SystemExit):
        main(["roofline", "--batch", "0"])
