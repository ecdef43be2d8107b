"""Tests for `python -m tools.roofline ceiling` / `step` / `pair` (tools/roofline: measure, step, report,
bandwidth) on tiny random Llamas and mixture-of-experts models.

The dense ceiling is only a fair floor if it is the same model: one decode step through
`DenseDecodeAttention`, over K/V copied out of Conveyor's paged cache, must give the logits that
Conveyor's own paged step gives.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.kernels import cpu_matmul_ops, vector_flags
from conveyor.layers.quantization.linear import QuantLinear, QuantMatmul
from conveyor.request import RequestState
from conveyor.bench.bandwidth import (
    format_streaming,
    last_level_cache_bytes,
    read_bandwidth,
    streaming_report,
    weight_bytes,
)
from tools.roofline.cli import main
from tools.roofline.expert_load import sparse_blocks
from tools.roofline.measure import DenseDecodeAttention, dense_decode_step
from tools.roofline.report import format_report, run_step
from tools.roofline.step import step_config

from tests.utils import TinyModel, random_prompts

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
    sample = engine.runner.sampler.sample

    def capture(logits, reqs):
        captured["logits"], captured["ids"] = logits.clone(), [r.request_id for r in reqs]
        return sample(logits, reqs)

    engine.runner.sampler.sample = capture
    try:
        stepped = engine.step()
    finally:
        del engine.runner.sampler.sample
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
                                      "outside_forward_met", "streaming_fraction_min", "streaming_met"}
    # fp32 weights: 4 bytes per parameter of the linears and the head, the same count as the FLOPs
    assert report["streaming"]["weights"]["total_bytes"] == 4 * mm["params_per_token"]
    assert [s["weight_bytes"] for s in mm["shapes"]] == [4 * s["out_features"] * s["in_features"] for s in mm["shapes"]]
    assert (report["model"]["dtype"], report["model"]["quantization"]) == ("float32", "none")
    # fp32 dense layers: the FMA path, set against its measured peak on the same threads
    assert {s["peak_kind"] for s in mm["shapes"]} == {"fp32-fma"} and "dense" in mm["shapes"][0]["path"]
    peak = mm["peaks_gops"]["fp32-fma"]
    assert peak is None or all(s["fraction_of_peak"] == pytest.approx(s["gflops"] / peak) for s in mm["shapes"])
    json.dumps(report)
    # the hooks are gone: the model and runner are their plain selves again
    assert "forward" not in vars(llm.engine.model) and "prepare" not in vars(llm.engine.runner)


def test_roofline_cli_writes_report(tiny: TinyModel, tmp_path, capsys) -> None:
    out = tmp_path / "roofline.json"
    assert main(["ceiling", "--model", str(tiny.path), "--batch", "4", "--context", "6", "--repeats", "2",
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
        main(["ceiling", "--batch", "0"])


# -- weight streaming (conveyor/bench/bandwidth.py) ---------------------------------------------------
# 2 layers x (qkv 128x64 + o 64x64 + gate_up 256x64 + down 64x128), and the 300 x 64 head
LAYER_PARAMS = 2 * (128 * 64 + 64 * 64 + 256 * 64 + 64 * 128)
HEAD_PARAMS = 300 * 64


def quantized_tensors(model) -> list:
    """Every QuantizedTensor a decode step reads, found by walking the modules (not via streaming.py): the
    layers' linears, and the head as `compute_logits` calls it (not the untied `lm_head` module, never called)."""
    out = []
    for m in model.modules():
        if isinstance(m, QuantLinear) and m is not model.lm_head:
            out += m.kernel.segments
    head = model.lm_head_fn
    return out + (list(head.segments) if isinstance(head, QuantMatmul) else [])


@pytest.mark.parametrize("kind", ["llama", "llama_tied"])
@pytest.mark.parametrize("quantization, per_fp32", [("int8", (0.25, 0.30)), ("int4", (0.15, 0.17))])
def test_weight_bytes_of_quantized_models(tiny_models, kind, quantization, per_fp32) -> None:
    """Quantized: the stored bytes of every linear and the head (I8: a byte and a row scale per weight row;
    Q4_1: 20 bytes per 32 weights), tied head or not; fp32: 4 bytes per parameter."""
    dense = weight_bytes(tiny_models[kind].llm().engine.model)
    assert (dense["layers_bytes"], dense["lm_head_bytes"]) == (4 * LAYER_PARAMS, 4 * HEAD_PARAMS)
    assert dense["layer_formats"] == ["float32"] and dense["lm_head_format"] == "float32"
    model = tiny_models[kind].llm(dtype="auto", quantization=quantization).engine.model
    w = weight_bytes(model)
    assert w["total_bytes"] == sum(t.nbytes for t in quantized_tensors(model))
    assert per_fp32[0] < w["total_bytes"] / dense["total_bytes"] < per_fp32[1]
    expected = "I8" if quantization == "int8" else "Q4_1"
    assert w["layer_formats"] == [expected] and w["lm_head_format"] == expected


def test_read_bandwidth_probe_states_its_buffer() -> None:
    probe = read_bandwidth(8 * 2**20, repeats=3)
    assert probe["buffer_bytes"] == 8 * 2**20 and probe["repeats"] == len(probe["samples_gb_per_s"]) == 3
    assert probe["gb_per_s"] > 0 and probe["threads"] == torch.get_num_threads()
    cache = last_level_cache_bytes()
    assert cache is None or cache > 0
    assert probe["last_level_cache_bytes"] == cache


def test_streaming_report_arithmetic_and_text() -> None:
    weights = {"layers_bytes": 900_000_000, "lm_head_bytes": 100_000_000, "total_bytes": 1_000_000_000,
               "layer_formats": ["Q4_1"], "lm_head_format": "Q4_1"}
    bandwidth = {"buffer_bytes": 2**30, "last_level_cache_bytes": 2**31, "threads": 2, "repeats": 5, "gb_per_s": 20.0}
    s = streaming_report(weights, 0.1, bandwidth)
    assert s["gb_per_s"] == pytest.approx(10.0) and s["fraction_of_bandwidth"] == pytest.approx(0.5)
    assert s["weights_fit_in_cache"]
    text = "\n".join(format_streaming(s, 0.6))
    assert "-> 10.0 GB/s" in text and "20.0 GB/s (torch.sum over a 1024 MiB fp32 buffer, 2 threads" in text
    assert "50%; target >= 60%: NOT met" in text and "the weights fit in the last-level cache" in text
    assert "the probe buffer fits in the last-level cache" in text


def test_quantized_one_row_step_reports_streaming(tiny_models) -> None:
    llm = LLM(tiny_models["llama_tied"].path, dtype="auto", quantization="int8", config=step_config(1, 10, 7))
    report = run_step(llm, batch=1, context=10, steps=2, warmup_steps=1, repeats=2, warmup=1,
                      bandwidth_buffer_bytes=8 * 2**20)
    assert report["model"]["quantization"] == "int8" and report["model"]["dtype"] == str(llm.dtype)[6:]
    s, step = report["streaming"], report["step"]
    assert s["weights"] == weight_bytes(llm.engine.model) and s["bandwidth"]["buffer_bytes"] == 8 * 2**20
    assert s["forward_lm_head_s"] == step["forward_lm_head_s"] > 0
    assert s["gb_per_s"] == pytest.approx(s["weights"]["total_bytes"] / s["forward_lm_head_s"] / 1e9)
    assert s["fraction_of_bandwidth"] == pytest.approx(s["gb_per_s"] / s["bandwidth"]["gb_per_s"])
    assert report["targets"]["streaming_met"] == (s["fraction_of_bandwidth"] >= 0.6)
    assert sum(x["weight_bytes"] * x["count"] for x in report["matmul"]["shapes"]) == s["weights"]["total_bytes"]
    json.dumps(report)
    text = format_report(report)
    assert "weights int8" in text and "the same quantized weights" in text and "Weight streaming" in text
    # per-channel int8 weights on the kernel: an 8-bit integer path (VNNI where the build has it)
    isa = cpu_matmul_ops().isa()
    assert {x["peak_kind"] for x in report["matmul"]["shapes"]} == {"int8-vnni" if "vnni" in isa else "int8-i32"}
    assert all(f"int8 kernel ({isa})" in x["path"] for x in report["matmul"]["shapes"])
    assert "measured peaks on" in text


def test_step_and_roofline_cli_take_dtype_and_quantization(tiny: TinyModel, tmp_path, capsys) -> None:
    out = tmp_path / "step.json"
    assert main(["step", "--model", str(tiny.path), "--batch", "1", "--context", "5", "--steps", "2",
                 "--warmup-steps", "1", "--repeats", "2", "--warmup", "1", "--dtype", "bfloat16",
                 "--quantization", "int4", "--bandwidth-buffer-mib", "8", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "(bfloat16, weights int4; CPU flags" in printed and "over a 8 MiB fp32 buffer" in printed
    report = json.loads(out.read_text())
    assert report["environment"]["cpu_flags"] == vector_flags() and report["streaming"]["gb_per_s"] > 0
    assert main(["ceiling", "--model", str(tiny.path), "--batch", "2", "--context", "4", "--repeats", "2",
                 "--warmup", "1", "--quantization", "int8"]) == 0
    assert "weights int8" in capsys.readouterr().out


@pytest.mark.slow
def test_builtin_one_row_step_streams_the_files_own_weights(tmp_path) -> None:
    """Default mode on the built-in Q4_1 file: a step reads the file's quantized tensors as they are
    (about 92 MiB: Q4_1 layers, the tied Q8_0 head), not widened copies."""
    from conveyor.models.loader import default_model_path

    out = tmp_path / "step.json"
    assert main(["step", "--batch", "1", "--context", "16", "--steps", "2", "--warmup-steps", "1", "--repeats", "2",
                 "--warmup", "1", "--bandwidth-buffer-mib", "64", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    w = report["streaming"]["weights"]
    assert report["model"]["quantization"] == "gguf" and w["layer_formats"] == ["Q4_1"]
    assert 80 * 2**20 < w["total_bytes"] < default_model_path().stat().st_size
    assert report["streaming"]["gb_per_s"] > 0 and report["streaming"]["bandwidth"]["gb_per_s"] > 0


# -- mixture-of-experts models -----------------------------------------------------------------------
def test_step_bench_reports_the_expert_load(moe_models: dict[str, TinyModel]) -> None:
    """`step` on an MoE model: the experts' shapes at their share of the rows, the active parameters,
    the rows per expert, the sparse blocks' share of the step."""
    llm = LLM(moe_models["qwen2_moe"].path, dtype="float32", config=step_config(8, 10, 2 + 1 + 4))
    report = run_step(llm, batch=8, context=10, steps=2, warmup_steps=1, repeats=2, warmup=1)
    mm, step = report["matmul"], report["step"]
    shapes = {s["name"]: s for s in mm["shapes"]}
    # layer 0 sparse (8 experts, top-3: 3 rows each at 8 rows, all busy), layer 1 dense
    assert (shapes["experts.gate_up_proj (3 rows)"]["count"], shapes["experts.gate_up_proj (3 rows)"]["rows"]) == (8, 3)
    assert shapes["gate_up_proj"]["count"] == 1 and shapes["shared_expert.down_proj"]["rows"] == 8
    assert mm["flops_per_token"] == 2 * (2 * (128 * 64 + 64 * 64) + (256 * 64 + 64 * 128) + 3 * (64 * 64 + 64 * 32)
                                         + (128 * 64 + 64 * 64) + 300 * 64)
    load = step["expert_load"]
    assert (load["layer_calls"], load["experts"], load["top_k"], load["routed_rows_per_call"]) == (2, 8, 3, 24)
    assert load["rows_per_expert"]["min"] <= load["rows_per_expert"]["median"] <= load["rows_per_expert"]["max"] <= 8
    assert 0 < step["moe_s"] < step["forward_s"] and 0 < step["moe_fraction"] < 1
    text = format_report(report)
    assert "of which mixture-of-experts blocks" in text and "24 routed rows per sparse layer (top-3 of 8" in text
    assert all(block.observer is None for block in sparse_blocks(llm.engine.model))


def test_step_pair_interleaves_two_models(moe_models: dict[str, TinyModel], tiny_llama: TinyModel, tmp_path: Path,
                                          capsys) -> None:
    """`pair`: both models' decode steps alternate; each one's median and the per-pair ratio."""
    out = tmp_path / "pair.json"
    assert main(["pair", str(tiny_llama.path), str(moe_models["mixtral"].path), "--batch", "4", "--context", "8",
                 "--steps", "3", "--dtype", "float32", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    a, b = report["models"]
    assert (a["path"], b["path"]) == (str(tiny_llama.path), str(moe_models["mixtral"].path))
    assert len(a["step_samples_s"]) == len(b["step_samples_s"]) == 3 and a["step_s"] > 0 and b["step_s"] > 0
    ratios = sorted(y / x for x, y in zip(a["step_samples_s"], b["step_samples_s"]))
    assert report["b_over_a"] == pytest.approx(ratios[1])
    assert "B / A:" in capsys.readouterr().out
