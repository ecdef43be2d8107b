"""`conveyor bench decode`: the bytes a step reads (weights + every stream's KV, int8 rows with their scales),
tok/s per repeat for each KV dtype, every block back, and bad arguments."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from conveyor.bench.bandwidth import weight_bytes
from conveyor.bench.commands import main
from conveyor.bench.decode import format_report, kv_bytes_per_token, run_decode

from tests.utils import TinyModel


def test_reports_each_kv_dtype_and_its_step_bytes(tiny_llama: TinyModel) -> None:
    report = run_decode(str(tiny_llama.path), ["auto", "int8"], context=40, streams=2, tokens=6, repeats=2,
                        dtype="float32")
    config = tiny_llama.llm().engine.model.config
    layers, heads, dim = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
    auto, int8 = report["systems"]["auto"], report["systems"]["int8"]
    # K and V, every layer: fp32 elements, or a byte each and an fp32 scale per row
    assert auto["kv_bytes_per_token"] == 2 * layers * heads * dim * 4
    assert int8["kv_bytes_per_token"] == 2 * layers * heads * (dim + 4)
    weights = weight_bytes(tiny_llama.llm().engine.model)["total_bytes"]
    for entry in (auto, int8):
        assert len(entry["tok_per_s"]) == 2 and all(rate > 0 for rate in entry["tok_per_s"])
        assert entry["step_bytes"] == weights + 2 * (40 + 6 / 2) * entry["kv_bytes_per_token"]
        assert entry["gb_per_s"] == pytest.approx(entry["step_bytes"] * entry["median_tok_per_s"] / 2 / 1e9)
        assert len(entry["bandwidth_gb_per_s"]) == 2 and entry["blocks_back"]
        shares = [entry["step_bytes"] * rate / 2 / 1e9 / bw
                  for rate, bw in zip(entry["tok_per_s"], entry["bandwidth_gb_per_s"])]
        assert entry["fraction_of_bandwidth"] == pytest.approx(statistics.median(shares))
    lines = format_report(report).splitlines()
    assert lines[3].startswith("auto") and lines[4].startswith("int8") and lines[3].endswith("1.00x")


def test_kv_bytes_follow_the_pool(tiny_llama: TinyModel) -> None:
    llm = tiny_llama.llm(kv_cache_dtype="int8")
    assert kv_bytes_per_token(llm) * llm.engine.pool.kv[0].shape[1] == llm.engine.pool.nbytes


def test_command_line(tiny_llama: TinyModel, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "decode.json"
    assert main(["decode", "--model", str(tiny_llama.path), "--kv-cache-dtype", "int8", "--context", "24",
                 "--tokens", "4", "--repeats", "1", "--dtype", "float32", "--out", str(out)]) == 0
    assert list(json.loads(out.read_text())["systems"]) == ["int8"]
    assert "Decode at depth" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--tokens must be >= 2"):
        main(["decode", "--tokens", "1"])
    with pytest.raises(SystemExit, match="one stream"):
        main(["decode", "--model", str(tiny_llama.path), "--streams", "2", "--llama-bench", "llama-bench"])


def test_a_window_where_every_stream_decodes(tiny_llama: TinyModel) -> None:
    """Streams whose prompts prefill in turns: with too few tokens one ends before the last starts."""
    with pytest.raises(RuntimeError, match="no window where every stream decodes"):
        run_decode(str(tiny_llama.path), ["auto"], context=300, streams=4, tokens=2, repeats=1, dtype="float32")
