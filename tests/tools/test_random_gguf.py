"""tools/random_gguf.py: real models' shapes, written as GGUF files that Conveyor loads and runs."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import pytest

from conveyor import LLM, SamplingParams
from tools import random_gguf


def test_shapes_have_their_models_parameter_counts() -> None:
    """Llama 3.2 1B: 1.24B parameters (tied head); Llama 3.1 8B: 8.03B; Qwen3 4B: 4.02B; gpt-oss-20b: 20.91B;
    Qwen3-30B-A3B: 30.53B."""
    for name, billions in (("llama-3.2-1b", 1.24), ("llama-3.1-8b", 8.03), ("qwen3-4b", 4.02), ("gpt-oss-20b", 20.91),
                           ("qwen3-30b-a3b", 30.53)):
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


def test_gpt_oss_experts_are_mxfp4_and_run_as_stored(tmp_path: Path) -> None:
    path = tmp_path / "tiny-gpt-oss.gguf"
    random_gguf.main(["--shape", "tiny-gpt-oss", "--type", "q8_0", "--out", str(path)])
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert types["blk.1.ffn_down_exps.weight"] == gguf.GGMLQuantizationType.MXFP4
    assert types["blk.1.attn_q.weight"] == gguf.GGMLQuantizationType.Q8_0
    llm = LLM(str(path), max_model_len=512)
    expert = llm.engine.model.layers[1].mlp.experts[3]
    assert [s.type_name for s in expert.down_proj.kernel.segments] == ["MXFP4"]
    out = llm.generate([[1, 5, 9, 12]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 4


def test_qwen3_moe_files_load_and_decode_through_the_stack(tmp_path: Path) -> None:
    """Qwen3-MoE's stacked experts, router and q/k norms as llama.cpp's converter names them: loaded, and decoded
    with the sparse blocks inside the native decode stack."""
    path = tmp_path / "tiny-qwen3moe.gguf"
    random_gguf.main(["--shape", "tiny-qwen3moe", "--type", "q4_0", "--out", str(path)])
    llm = LLM(str(path), max_model_len=512)
    model = llm.engine.model
    assert len(model.layers[1].mlp.experts) == 8 and model.layers[1].mlp.top_k == 2
    assert model.decode_stack is not None and len(model.decode_stack.moes) == 2
    out = llm.generate([[1, 5, 9, 12]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 4


def test_k_quant_mixes_need_llama_quantize(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        random_gguf.main(["--shape", "tiny", "--type", "q4_k_m", "--out", str(tmp_path / "x.gguf")])
    assert "--llama-quantize" in capsys.readouterr().err


def test_k_quant_mixes_are_made_from_a_q8_0_file(tmp_path: Path) -> None:
    """llama-quantize (here a stand-in that logs its arguments and copies its input) gets
    --allow-requantize, a Q8_0 file and llama.cpp's name of the mix."""
    log = tmp_path / "args"
    fake = tmp_path / "llama-quantize"
    fake.write_text(f'#!/bin/sh\necho "$@" > {log}\ncp "$2" "$3"\n')
    fake.chmod(0o755)
    out = tmp_path / "tiny-q5km.gguf"
    random_gguf.main(["--shape", "tiny", "--type", "q5_k_m", "--llama-quantize", str(fake), "--out", str(out)])
    args = log.read_text().split()
    assert args[0] == "--allow-requantize" and args[2] == str(out) and args[3] == "Q5_K_M"
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(out).tensors}
    assert types["blk.0.ffn_up.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert not Path(args[1]).exists()  # the temporary Q8_0 file is gone
