"""`conveyor bench embed`: Conveyor's pooling `embed` timed over many texts, and `--compare vllm` against a
stand-in vLLM interpreter (tests/bench/fake_vllm: transformers' last hidden state, normalized)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conveyor import LLM, ContinuousBatchingConfig
from conveyor.bench import main
from conveyor.bench.embed import random_texts, run_embed

from tests.bench.vllm_stand_in import interpreter
from tests.utils import TinyModel


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return TinyModel("llama", tmp_path_factory.mktemp("embed_llama"))


def test_runs_time_the_same_texts_and_return_their_embeddings(tiny: TinyModel) -> None:
    llm = LLM(tiny.path, dtype="float32", runner="pooling",
              config=ContinuousBatchingConfig(num_blocks=256, allow_block_sharing=False))
    texts = random_texts(5, 9, 256, seed=1)
    assert texts == random_texts(5, 9, 256, seed=1) and all(100 <= t < 256 for text in texts for t in text)
    report = run_embed(llm, texts, repeats=2)
    assert report["tokens"] == 45 and len(report["runs_tok_per_s"]) == 2 and report["tok_per_s"] > 0
    alone = [o.outputs.embedding for o in llm.embed([{"prompt_token_ids": t} for t in texts], use_tqdm=False)]
    assert report["embeddings"] == alone


def test_compare_vllm_end_to_end(tiny: TinyModel, tmp_path: Path, monkeypatch, capsys) -> None:
    log, out = tmp_path / "fake.json", tmp_path / "report.json"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    assert main(["embed", "--model", str(tiny.path), "--dtype", "float32", "--num-texts", "4", "--text-len", "11",
                 "--repeats", "1", "--compare", "vllm", "--vllm-python", interpreter(tmp_path),
                 "--out", str(out)]) == 0
    seen = json.loads(log.read_text())
    assert (seen["model"], seen["dtype"], seen["kwargs"]) == (
        str(tiny.path), "float32", {"runner": "pooling", "enable_prefix_caching": False})
    assert seen["calls"] == [[11] * 4, [11] * 4]  # an untimed pass over every text, then the timed one
    report = json.loads(out.read_text())
    assert "embeddings" not in report["conveyor"] and "embeddings" not in report["vllm"]
    assert report["conveyor"]["tokens"] == report["vllm"]["tokens"] == 44
    # fp32 Conveyor against transformers' fp32 hidden states: the same embeddings.
    assert report["cosine"]["min"] >= 0.9999
    printed = capsys.readouterr().out
    assert "conveyor is" in printed and "x vLLM (0.0+fake, float32)" in printed


def test_vllm_options_only_with_compare(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="only apply with --compare vllm"):
        main(["embed", "--vllm-python", "/nonexistent"])
    with pytest.raises(SystemExit, match="--num-texts must be >= 1"):
        main(["embed", "--num-texts", "0"])
