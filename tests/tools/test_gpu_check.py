"""The device check's bench module on CPU: arguments, table and JSON assembly, a tiny dry run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conveyor.bench.workloads import load_workload
from tools import gpu_check
from tools.gpu_check import (
    CHAT64,
    HF,
    Row,
    add_ratios,
    format_table,
    junit_summary,
    mode_config,
    parse_modes,
    parse_workloads,
)

from tests.utils import TinyModel

JUNIT = """<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="4" failures="1" errors="0" skipped="1">
<testcase classname="tests.test_cuda" name="test_a"/><testcase classname="tests.test_cuda" name="test_b">
<failure message="boom"/></testcase><testcase classname="tests.test_cuda" name="test_c"><skipped/></testcase>
<testcase classname="tests.test_cuda" name="test_d"/></testsuite></testsuites>"""


def test_arguments_name_the_allowed_values() -> None:
    assert parse_modes("eager, graphs+async") == ["eager", "graphs+async"]
    with pytest.raises(ValueError, match=r"subset of \['eager', 'graphs', 'graphs\+async'\]"):
        parse_modes("eager,turbo")
    assert parse_workloads("chat64") == ["chat64"]
    with pytest.raises(ValueError, match="one-stream"):
        parse_workloads("")
    config = mode_config({"max_batch_tokens": 64}, "graphs+async")
    assert (config.use_cuda_graph, config.use_async_batching, config.max_batch_tokens) == (True, True, 64)
    assert (mode_config({}, "eager").use_cuda_graph, mode_config({}, "graphs").use_async_batching) == (False, False)
    assert len(load_workload(CHAT64)) == 64  # the workload travels inside the package


def test_junit_summary(tmp_path: Path) -> None:
    (tmp_path / "j.xml").write_text(JUNIT)
    summary = junit_summary(tmp_path / "j.xml")
    assert {k: summary[k] for k in ("tests", "passed", "failures", "skipped")} == \
        {"tests": 4, "passed": 2, "failures": 1, "skipped": 1}
    assert summary["failed"] == ["tests.test_cuda::test_b"]
    assert "cannot read" in junit_summary(tmp_path / "missing.xml")["error"]
    assert junit_summary(None) is None


def test_ratios_and_table() -> None:
    rows = [Row("synthetic", "eager", wall_s=10, output_tokens=1000, output_tok_per_s=100.0, total_tok_per_s=300.0),
            Row("synthetic", "graphs", wall_s=2, output_tokens=1000, output_tok_per_s=500.0, total_tok_per_s=1500.0),
            Row("synthetic", HF, wall_s=5, output_tokens=1000, output_tok_per_s=200.0, total_tok_per_s=600.0),
            Row("chat64", "graphs", error="RuntimeError: capture failed")]
    add_ratios(rows)
    assert (rows[1].vs_eager, rows[1].vs_hf, rows[0].vs_eager, rows[0].vs_hf) == (5.0, 2.5, None, 0.5)
    report = {"environment": {"cuda_device": "NVIDIA H200", "torch": "2.11", "transformers": "5.24.0"},
              "model": {"name": "m.gguf", "weights": "built-in GGUF", "dtype": "bfloat16"},
              "tests": junit_summary(None), "rows": [vars(r) for r in rows], "skipped": ["chat64 / eager: past"]}
    table = format_table(report)
    assert "NVIDIA H200" in table and "skipped: chat64 / eager: past" in table
    graphs = next(line for line in table.splitlines() if line.startswith("synthetic") and " graphs " in line)
    assert "500.0" in graphs and "5.00x" in graphs and "2.50x" in graphs
    assert "capture failed" in table


def test_dry_run_on_cpu(tiny_llama: TinyModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                        capsys: pytest.CaptureFixture[str]) -> None:
    """eager and a mode that cannot start, the tiny model, small sizes, transformers alongside."""
    real = gpu_check.mode_config

    def config(base: dict, mode: str) -> object:
        if mode == "graphs":
            raise RuntimeError("no graphs here")
        return real(base, mode)

    monkeypatch.setattr(gpu_check, "mode_config", config)
    args = ["--model", str(tiny_llama.path), "--device", "cpu", "--dtype", "float32", "--modes", "eager,graphs",
            "--workloads", "one-stream,synthetic", "--num-prompts", "3", "--input-len", "6", "--output-len", "4",
            "--stream-input-len", "5", "--stream-output-len", "6", "--max-batch-tokens", "32",
            "--max-requests-per-batch", "4", "--budget-s", "3600", "--out", str(tmp_path)]
    assert gpu_check.main(args) == 1  # the graphs rows are errors
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = {(r["workload"], r["system"]): r for r in report["rows"]}
    assert rows[("synthetic", "eager")]["output_tokens"] == 12 and rows[("one-stream", "eager")]["output_tokens"] == 6
    assert rows[("synthetic", HF)]["output_tokens"] == 12 and rows[("synthetic", HF)]["greedy_match_eager"] == 1.0
    assert rows[("synthetic", HF)]["vs_eager"] > 0 and rows[("synthetic", "eager")]["vs_hf"] > 0
    assert rows[("synthetic", "graphs")]["error"] == "start: RuntimeError: no graphs here"
    assert report["model"]["dtype"] == "float32" and report["skipped"] == []
    assert (tmp_path / "gpu_check.txt").read_text().strip() in capsys.readouterr().out


def test_budget_skips_runs_but_ends_with_a_table(tiny_llama: TinyModel, tmp_path: Path) -> None:
    assert gpu_check.main(["--model", str(tiny_llama.path), "--device", "cpu", "--dtype", "float32",
                           "--workloads", "one-stream", "--budget-s", "0", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["rows"] == [] and len(report["skipped"]) == 4  # three modes, then transformers


def test_stand_in_model_when_the_builtin_one_is_absent(tiny_llama: TinyModel, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse
    import shutil

    from conveyor.models import loader

    config_dir = tmp_path / "config"
    config_dir.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama.path / name, config_dir / name)

    def absent() -> Path:
        raise FileNotFoundError("not installed")

    monkeypatch.setattr(loader, "default_model_path", absent)
    args = argparse.Namespace(model=None, fallback_config=str(config_dir), fallback_dir=str(tmp_path / "stand-in"))
    gpu_check.resolve_model(args)
    assert args.model == str(tmp_path / "stand-in") and "random weights" in args.weights_note
    assert {"model.safetensors", "tokenizer.json", "config.json"} <= {p.name for p in (tmp_path / "stand-in").iterdir()}
    with pytest.raises(SystemExit, match="--fallback-config"):
        gpu_check.resolve_model(argparse.Namespace(model=None, fallback_config=None))
