"""tools/random_checkpoint.py: real models' shapes as GPTQ, AWQ and compressed-tensors directories, which the
loader reads as the formats they claim (their 4-bit weights kept in kernel types) and which run."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor import LLM, ContinuousBatchingConfig, SamplingParams
from conveyor.layers.quantization.tensors import QuantizedTensor
from conveyor.models.loader import load_checkpoint
from tools import random_checkpoint
from tools.random_gguf import SHAPES

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(("fmt", "method", "kept"), [("gptq", "gptq", "Q4_0"), ("awq", "awq", "Q4_1"),
                                                     ("w4a16", "compressed-tensors", "Q4_0")])
def test_written_checkpoints_load_as_their_format(fmt: str, method: str, kept: str, tmp_path: Path) -> None:
    random_checkpoint.write(tmp_path, SHAPES["tiny"], fmt)
    checkpoint = load_checkpoint(tmp_path, keep_quantized=True, tokenizer=False)
    weights = [t for t in checkpoint.state_dict.values() if isinstance(t, QuantizedTensor)]
    assert len(weights) == 7 * SHAPES["tiny"].layers and {w.type_name for w in weights} == {kept}
    dense = load_checkpoint(tmp_path, tokenizer=False).state_dict["model.layers.1.mlp.down_proj.weight"]
    assert dense.std().item() == pytest.approx(0.025, rel=0.5)  # (random 4-bit values at the scales written)
    llm = LLM(tmp_path, dtype="auto", config=ContinuousBatchingConfig(num_blocks=64))
    assert llm.quantization == method
    out = llm.generate([[1, 5, 9]], SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 4
    llm.shutdown()
