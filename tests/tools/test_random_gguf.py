"""tools/random_gguf.py: real models' shapes, written as GGUF files that Conveyor loads and runs."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import pytest

from conveyor import LLM, SamplingParams
from tools import random_gguf


def test_shapes_have_their_models_parameter_counts() -> None:
    """Llama 3.2 1B: 1.24B parameters (tied head); Llama 3.1 8B: 8.03B; Qwen3 4B: 4.02B."""
    for name, billions in (("llama-3.2-1b", 1.24), ("llama-3.1-8b", 8.03), ("qwen3-4b", 4.02)):
        count = sum(math.prod(dims) for _, dims, _ in random_gguf.tensors(random_gguf.SHAPES[name]))
        assert count / 1e9 == pytest.approx(billions, abs=0.01), name


@pytest.mark.parametrize("kind", ["q4_0", "q8_0", "f16"])
def test_the_file_loads_and_runs(tmp_path: Path, kind: str) -> None:
    path = tmp_path / f"tiny-{kind}.gguf"
    random_gguf.main(["--shape", "tiny", "--type", kind, "--out", str(path)])
    reader = gguf.GGUFReader(path)
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.ffn_down.weight"] == random_gguf.TYPES[kind]
    assert types["token_embd.weight"] == (gguf.GGMLQuantizationType.F16 if kind == "f16" else
                                          gguf.GGMLQuantizationType.Q8_0)
    llm = LLM(str(path))
    assert llm.vocab_size == random_gguf.SHAPES["tiny"].vocab
    out = llm.generate([[1, 5, 9, 12]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 4
