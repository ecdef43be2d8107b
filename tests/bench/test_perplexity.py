"""`conveyor bench perplexity`: exp(mean NLL) over the text's windows, against transformers' own
logits on the same windows; window planning; bad arguments."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from conveyor.bench.commands import main
from conveyor.bench.perplexity import plan_windows

from tests.utils import TinyModel, random_prompts

TOKENS = random_prompts([70], seed=50)[0]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ppl") / "text.txt"
    path.write_text(" ".join(f"w{t}" for t in TOKENS) + "\n")  # the tiny tokenizer: one word, one token
    return path


@torch.inference_mode()
def reference_perplexity(model: TinyModel, ids: list[int], window: int, stride: int) -> tuple[float, int]:
    """transformers' guide to sliding-window perplexity, on its fp32 logits: each window scores the
    tokens after the previous window's end (a window's first token has no context)."""
    nll, count, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + window, len(ids))
        lp = torch.log_softmax(model.reference(torch.tensor([ids[begin:end]])).logits[0].double(), dim=-1)
        for i in range(max(prev_end, begin + 1), end):
            nll -= lp[i - begin - 1, ids[i]].item()
            count += 1
        prev_end = end
        if end == len(ids):
            break
    return math.exp(nll / count), count


@pytest.mark.parametrize(("window", "stride", "max_tokens"), [(16, 16, None), (16, 5, None), (24, 8, 50)])
def test_perplexity_matches_transformers(tiny_llama: TinyModel, text_file: Path, tmp_path: Path, window: int,
                                         stride: int, max_tokens: int | None,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ppl.json"
    argv = ["perplexity", str(text_file), "--model", str(tiny_llama.path), "--dtype", "float32", "--window", str(window), "--stride",
            str(stride), "--num-blocks", "128", "--max-batch-tokens", "20", "--out", str(out), "--no-progress"]
    assert main(argv + (["--max-tokens", str(max_tokens)] if max_tokens else [])) == 0
    report = json.loads(out.read_text())
    ids = TOKENS[:max_tokens]
    expected, count = reference_perplexity(tiny_llama, ids, window, stride)
    assert report["perplexity"] == pytest.approx(expected, rel=1e-4)
    assert report["scored_tokens"] == count and report["text_tokens"] == len(ids)
    assert report["model"]["dtype"] == "float32" and report["num_errors"] == 0 and report["scored_tok_per_s"] > 0
    assert f"Perplexity {report['perplexity']:.4f}" in capsys.readouterr().out


def test_plan_windows() -> None:
    assert plan_windows(10, 4, 4) == [(0, 4, 1), (4, 8, 5), (8, 10, 9)]
    assert plan_windows(10, 4, 2) == [(0, 4, 1), (2, 6, 4), (4, 8, 6), (6, 10, 8)]
    assert plan_windows(3, 8, 8) == [(0, 3, 1)]
    with pytest.raises(ValueError, match=r"stride in \[1, window\]"):
        plan_windows(10, 4, 5)
    with pytest.raises(ValueError, match="at least 2"):
        plan_windows(1, 4, 4)


def test_bad_arguments_exit_with_the_limit(tiny_llama: TinyModel, text_file: Path) -> None:
    base = ["perplexity", str(text_file), "--model", str(tiny_llama.path), "--num-blocks", "64", "--no-progress"]
    with pytest.raises(SystemExit, match="context length minus one"):
        main(base + ["--window", "512"])
    with pytest.raises(SystemExit, match=r"stride in \[1, window\]"):
        main(base + ["--window", "8", "--stride", "9"])
    with pytest.raises(SystemExit, match="cannot read"):
        main(["perplexity", str(text_file.with_name("missing.txt"))])
