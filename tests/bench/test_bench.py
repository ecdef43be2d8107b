"""Tests for the benchmark suite (conveyor.bench): workload loading, output comparison, and one
end-to-end `throughput --compare hf` run on the built-in model with a tiny workload."""

from __future__ import annotations

import json

import pytest

from conveyor.bench import main
from conveyor.bench.throughput_report import compare_outputs, first_difference, format_report
from conveyor.bench.workloads import BenchRequest, WorkloadError, load_workload, render_prompts, synthetic_workload

CHAT_STYLE = {"name": "chat-tiny", "description": "prompts layout", "max_new_tokens": 8, "temperature": 0.0,
              "prompts": ["Write one sentence about the moon.", "Give three facts about python lists."]}
DOCS_STYLE = {"name": "docs-tiny", "description": "requests layout", "temperature": 0.0,
              "requests": [{"prompt": "A passage. Question?", "max_new_tokens": 32, "doc": 0},
                           {"prompt": "Another passage. Why?", "max_new_tokens": 64, "doc": 1}]}


def write(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_load_chat_style_workload(tmp_path):
    w = load_workload(write(tmp_path, "chat.json", CHAT_STYLE))
    assert w.name == "chat-tiny" and w.description == "prompts layout" and w.temperature == 0.0
    assert [r.prompt for r in w.requests] == CHAT_STYLE["prompts"]
    assert [r.max_new_tokens for r in w.requests] == [8, 8]
    assert not any(r.ignore_eos for r in w.requests) and w.source.endswith("chat.json")
    assert len(w.limit(1)) == 1 and len(w) == 2
    assert [r.max_new_tokens for r in w.with_max_new_tokens(3).requests] == [3, 3]
    assert w.with_max_new_tokens(None) is w


def test_load_docs_style_workload(tmp_path):
    w = load_workload(write(tmp_path, "docs.json", DOCS_STYLE))
    assert w.name == "docs-tiny"
    assert [r.prompt for r in w.requests] == ["A passage. Question?", "Another passage. Why?"]
    assert [r.max_new_tokens for r in w.requests] == [32, 64]
    assert w.total_max_new_tokens == 96
    assert w.requests[1].meta == {"doc": 1}


def test_workload_name_defaults_to_file_stem(tmp_path):
    data = {k: v for k, v in CHAT_STYLE.items() if k != "name"}
    assert load_workload(write(tmp_path, "mine.json", data)).name == "mine"


@pytest.mark.parametrize("data, message", [
    ({"prompts": ["hi"]}, "max_new_tokens"),
    ({"max_new_tokens": 4, "prompts": ["hi"], "requests": []}, "exactly one"),
    ({"max_new_tokens": 4}, "exactly one"),
    ({"max_new_tokens": 0, "prompts": ["hi"]}, "max_new_tokens"),
    ({"max_new_tokens": 4, "prompts": [""]}, "non-empty"),
    ({"max_new_tokens": 4, "prompts": []}, "no requests"),
    ({"requests": [{"prompt": "hi"}]}, "max_new_tokens"),
    ({"requests": [{"max_new_tokens": 4}]}, "prompt"),
    ({"requests": [{"prompt": "hi", "max_new_tokens": 4}], "temperature": -1}, "temperature"),
    ([1, 2], "JSON object"),
])
def test_bad_workloads_are_rejected(tmp_path, data, message):
    with pytest.raises(WorkloadError, match=message):
        load_workload(write(tmp_path, "bad.json", data))


def test_invalid_json_is_a_workload_error(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(WorkloadError):
        load_workload(path)


def test_synthetic_workload_is_seeded_and_ignores_eos():
    a = synthetic_workload(16, 5, 3, vocab_size=100, seed=7, exclude_token_ids=range(10))
    b = synthetic_workload(16, 5, 3, vocab_size=100, seed=7, exclude_token_ids=range(10))
    assert [r.prompt_token_ids for r in a.requests] == [r.prompt_token_ids for r in b.requests]
    assert all(len(r.prompt_token_ids) == 16 and r.max_new_tokens == 5 and r.ignore_eos for r in a.requests)
    assert all(10 <= t < 100 for r in a.requests for t in r.prompt_token_ids)
    with pytest.raises(WorkloadError):
        synthetic_workload(0, 5, 3, vocab_size=100)


def test_render_prompts_uses_one_user_turn():
    w = synthetic_workload(4, 2, 1, vocab_size=50)
    w.requests.append(BenchRequest(max_new_tokens=2, prompt="hello"))
    seen = []
    ids = render_prompts(w, lambda conv: seen.append(conv) or [1, 2, 3])
    assert ids[0] == w.requests[0].prompt_token_ids and ids[1] == [1, 2, 3]
    assert seen == [[{"role": "user", "content": "hello"}]]


def test_first_difference_and_compare_outputs():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert first_difference([], [4]) == 0
    result = compare_outputs([[1, 2], [3, 4], [5]], [[1, 2], [3, 9], [5]], [None, None, "boom"])
    assert result["exact_matches"] == 1 and result["num_requests"] == 3
    # agreement: 1 of 3 identical (an error counts as a mismatch); common prefixes 2, 1 and 1 token(s)
    assert result["identical_fraction"] == pytest.approx(1 / 3)
    assert result["mean_common_prefix"] == pytest.approx(4 / 3) and result["mean_conveyor_len"] == pytest.approx(5 / 3)
    assert result["mismatches"] == [
        {"index": 1, "first_diff": 1, "conveyor_len": 2, "baseline_len": 2},
        {"index": 2, "first_diff": None, "conveyor_len": 1, "baseline_len": 1, "error": "boom"}]


def test_cli_rejects_missing_or_conflicting_workloads(tmp_path):
    with pytest.raises(SystemExit, match="workload file"):
        main(["throughput"])
    with pytest.raises(SystemExit, match="not both"):
        main(["throughput", str(write(tmp_path, "w.json", CHAT_STYLE)), "--synthetic-input-len", "4",
              "--synthetic-output-len", "4", "--num-prompts", "2"])
    with pytest.raises(SystemExit, match="No such file"):
        main(["throughput", str(tmp_path / "missing.json")])


@pytest.mark.slow
def test_throughput_compare_hf_end_to_end(tmp_path, capsys):
    """The whole `throughput --compare hf` path on the built-in model: 3 chat prompts, 4 new tokens."""
    workload = write(tmp_path, "tiny.json", {
        "name": "tiny", "max_new_tokens": 16, "temperature": 0.0,
        "prompts": ["Write one sentence about the moon.", "What is 2+2?", "Name a color."]})
    out = tmp_path / "report.json"
    code = main(["throughput", str(workload), "--compare", "hf", "--max-new-tokens", "4", "--out", str(out),
                 "--no-progress", "--dtype", "float32"])  # the exact path: transformers' tokens exactly
    assert code == 0
    report = json.loads(out.read_text())

    assert report["benchmark"] == "throughput"
    assert report["workload"]["name"] == "tiny" and report["workload"]["num_requests"] == 3
    assert report["workload"]["max_new_tokens"] == [4]
    assert set(report["systems"]) == {"conveyor", "hf_generate_batch", "hf_generate"}
    for name, system in report["systems"].items():
        for key in ("wall_s", "requests_per_s", "output_tok_per_s", "total_tok_per_s", "output_tokens",
                    "prompt_tokens", "num_errors", "token_ids"):
            assert key in system, (name, key)
        assert system["num_requests"] == 3 and system["num_errors"] == 0
        assert system["wall_s"] > 0 and system["output_tok_per_s"] > 0
        assert system["total_tok_per_s"] > system["output_tok_per_s"]
        assert all(1 <= n <= 4 for n in system["output_lens"])
        assert system["output_tokens"] == sum(system["output_lens"])
    assert report["systems"]["hf_generate_batch"]["api"] == "generate_batch"
    assert set(report["ratios"]) == set(report["total_ratios"]) == {"hf_generate_batch", "hf_generate"}
    assert all(r > 0 for r in report["ratios"].values()) and all(r > 0 for r in report["total_ratios"].values())
    assert (report["model"]["dtype"], report["model"]["quantization"]) == ("float32", "none")
    assert isinstance(report["environment"]["cpu_flags"], list)

    # Same weights, same prompt ids, greedy: every baseline must reproduce Conveyor's tokens exactly.
    for name in ("hf_generate_batch", "hf_generate"):
        match = report["greedy_match"][name]
        assert (match["exact_matches"], match["identical_fraction"], match["mismatches"]) == (3, 1.0, []), name
        assert match["mean_common_prefix"] == match["mean_conveyor_len"], name
        assert report["systems"][name]["token_ids"] == report["systems"]["conveyor"]["token_ids"]

    # Engine counters of the timed run: every prompt token was either prefilled or found in the prefix cache.
    engine = report["systems"]["conveyor"]["engine"]
    assert engine["prefill_tokens"] + engine["prefix_cache_hit_tokens"] == report["workload"]["prompt_tokens"]
    assert engine["offloads"] == 0 and engine["total_blocks"] > 0 and engine["prefix_caching"] is True

    printed = capsys.readouterr().out
    assert "queried tokens hit (on)" in printed
    assert "hf generate_batch" in printed and "3/3 identical" in printed
    assert format_report(report) in printed


def test_throughput_engine_options_reach_the_config(tmp_path):
    workload = write(tmp_path, "tiny.json", {"name": "tiny", "max_new_tokens": 2, "temperature": 0.0,
                                             "prompts": ["Name a color.", "Name a fruit."]})
    out = tmp_path / "report.json"
    assert main(["throughput", str(workload), "--no-progress", "--out", str(out), "--page-size", "8",
                 "--num-blocks", "300", "--scheduler-type", "prefill_first", "--cpu-offload-space", "0.25",
                 "--no-block-sharing"]) == 0
    report = json.loads(out.read_text())
    config = report["conveyor_config"]
    assert (config["page_size"], config["num_blocks"], config["scheduler_type"], config["cpu_offload_space"],
            config["allow_block_sharing"]) == (8, 300, "prefill_first", 0.25, False)
    engine = report["systems"]["conveyor"]["engine"]
    assert engine["prefill_tokens"] == report["workload"]["prompt_tokens"] and engine["prefix_cache_hit_tokens"] == 0
    assert engine["total_blocks"] == 300 and engine["prefix_caching"] is False
    assert "queried tokens hit (off)" in format_report(report)


def test_format_report_says_when_the_model_turns_prefix_caching_off():
    """Asked for (the default) but off: a window shorter than a page, or sliding or state layers under tensor
    parallelism."""
    engine = {"total_blocks": 10, "prefill_tokens": 12, "prefix_cache_hit_tokens": 0, "prefix_cache_query_tokens": 0,
              "offloads": 0, "swap_outs": 0, "swap_ins": 0, "soft_resets": 0, "prefix_caching": False}
    system = {"wall_s": 2.0, "requests_per_s": 1.0, "output_tok_per_s": 4.0, "total_tok_per_s": 10.0,
              "output_tokens": 8, "num_errors": 0, "errors": [], "engine": engine}
    report = {"workload": {"name": "w", "num_requests": 2, "prompt_tokens": 12, "max_prompt_len": 6,
                           "max_new_tokens": [4], "ignore_eos": False},
              "model": {"path": "/m/model.gguf", "device": "cpu", "dtype": "float32", "quantization": "none"},
              "environment": {"torch": "x", "torch_threads": 1, "transformers": "y", "cpu_flags": ["avx2"]},
              "systems": {"conveyor": system}, "ratios": {}, "total_ratios": {}, "greedy_match": {},
              "conveyor_config": {"page_size": 16, "max_batch_tokens": 512, "scheduler_type": "fifo",
                                  "allow_block_sharing": True}}
    assert ("queried tokens hit (off: a window shorter than a page, or sliding or state layers under tensor "
            "parallelism)") in format_report(report)


def test_format_report_lists_every_mismatch_and_failure():
    system = {"wall_s": 2.0, "requests_per_s": 1.0, "output_tok_per_s": 4.0, "total_tok_per_s": 10.0,
              "output_tokens": 8, "num_errors": 0, "errors": []}
    report = {
        "workload": {"name": "w", "num_requests": 2, "prompt_tokens": 12, "max_prompt_len": 6,
                     "max_new_tokens": [4], "ignore_eos": False},
        "model": {"path": "/m/model.gguf", "device": "cpu", "dtype": "float32", "quantization": "none"},
        "environment": {"torch": "x", "torch_threads": 1, "transformers": "y", "cpu_flags": ["avx2", "fma"]},
        "systems": {"conveyor": system,
                    "hf_generate": {**system, "output_tok_per_s": 2.0, "num_errors": 1, "errors": ["boom"],
                                    "batch_size": 16, "attn_implementation": "sdpa"}},
        "ratios": {"hf_generate": 2.0}, "total_ratios": {"hf_generate": 1.25},
        "greedy_match": {"hf_generate": compare_outputs([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], []],
                                                        [None, "boom"])},
    }
    text = format_report(report)
    assert "2.00x" in text and "1.25x" in text
    assert "0/2 identical; mean common prefix 1.0 of 3.0 tokens; 2 MISMATCHED" in text
    assert "(float32, weights none; CPU flags avx2 fma)" in text
    assert "request 0: first difference at output token 2" in text
    assert "request 1: first difference at output token 0" in text and "error: boom" in text
    assert "1 requests FAILED" in text


def test_throughput_structured_runs_the_same_requests_constrained(tmp_path):
    workload = write(tmp_path, "tiny.json", {"name": "tiny", "max_new_tokens": 6, "temperature": 0.0,
                                             "prompts": ["Describe a film.", "Describe a book."]})
    out = tmp_path / "report.json"
    assert main(["throughput", str(workload), "--no-progress", "--out", str(out), "--structured", "json"]) == 0
    report = json.loads(out.read_text())
    plain, constrained = report["systems"]["conveyor"], report["systems"]["conveyor (structured)"]
    assert constrained["num_errors"] == 0 and constrained["output_tok_per_s"] > 0
    assert report["structured"]["output_tok_per_s_ratio"] == constrained["output_tok_per_s"] / plain["output_tok_per_s"]
    assert all(1 <= n <= 6 for n in constrained["output_lens"])
    assert constrained["token_ids"] != plain["token_ids"]  # the constraint steered them (JSON, not free text)
    assert report["structured"]["constraint"].startswith("json:")
