"""Tests for conveyor.models.loader.

GGUF parity is checked against transformers' own GGUF reader
(`modeling_gguf_pytorch_utils.load_gguf_checkpoint`, the function behind
`AutoModelForCausalLM.from_pretrained(..., gguf_file=...)`). It is called directly
because `from_pretrained` insists on `accelerate` for GGUF files, which is not installed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from conveyor import LLM, SamplingParams
from conveyor.layers.quantization.linear import QuantLinear
from conveyor.models.loader import Checkpoint, ModelLoadError, default_model_path, load_checkpoint

from tests.gguf_writer import tiny_head_dim, write_gguf, write_random_block_gguf, write_tiny_gguf
from tests.utils import TINY_CONFIGS, next_token_logprobs, random_prompts, tiny_tokenizer

CONFIG_FIELDS = [
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "rms_norm_eps",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "tie_word_embeddings",
]


def hf_gguf_reference(
    path: Path, model_config: transformers.PretrainedConfig
) -> tuple[transformers.PretrainedConfig, dict[str, torch.Tensor], set[str]]:
    """transformers' reading of a GGUF: config, tensors, and the parameter names its model expects.

    `model_config` only supplies module names for transformers' GGUF->HF name mapping (the GGUF
    is read once here, it is slow); the returned config and names come from transformers alone.
    """
    with torch.device("meta"):
        mapping_model = transformers.AutoModelForCausalLM.from_config(model_config)
    parsed = load_gguf_checkpoint(path, return_tensors=True, model_to_load=mapping_model)
    config = transformers.AutoConfig.for_model(**parsed["config"])
    with torch.device("meta"):
        expected = set(transformers.AutoModelForCausalLM.from_config(config).state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    return config, parsed["tensors"], expected


def assert_matches_reference(ckpt: Checkpoint, path: Path) -> None:
    ref_config, ref_tensors, expected_names = hf_gguf_reference(path, ckpt.config)
    for field in CONFIG_FIELDS:
        assert getattr(ckpt.config, field) == getattr(ref_config, field), field
    assert ckpt.config.rope_parameters["rope_theta"] == ref_config.rope_parameters["rope_theta"]
    assert set(ckpt.state_dict) == expected_names
    q_rows = ckpt.state_dict["model.layers.0.self_attn.q_proj.weight"].shape[0]
    assert q_rows == ckpt.config.num_attention_heads * ckpt.config.head_dim
    for name, tensor in ckpt.state_dict.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, ref_tensors[name]), name


@pytest.fixture(scope="module")
def builtin() -> Checkpoint:
    return load_checkpoint()


def test_default_model_path_is_gguf_file() -> None:
    path = default_model_path()
    assert path.is_file()
    assert path.suffix == ".gguf"


@pytest.mark.slow
def test_builtin_gguf_matches_transformers(builtin: Checkpoint) -> None:
    assert builtin.path == default_model_path()
    assert isinstance(builtin.config, transformers.LlamaConfig)
    assert builtin.config.tie_word_embeddings and "lm_head.weight" not in builtin.state_dict
    assert builtin.tokenizer.chat_template
    assert len(builtin.tokenizer) == builtin.config.vocab_size
    assert builtin.config.head_dim == 64
    assert_matches_reference(builtin, builtin.path)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_matches_transformers(arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / f"{arch}.gguf"
    write_tiny_gguf(path, arch)
    # The toy vocabulary is not a real tokenizer; tokenizer conversion is covered by the built-in model.
    monkeypatch.setattr("conveyor.models.loader._gguf_tokenizer", lambda path: "tokenizer")
    ckpt = load_checkpoint(path)
    assert ckpt.tokenizer == "tokenizer"
    assert not ckpt.config.tie_word_embeddings
    assert_matches_reference(ckpt, path)
    # transformers ignores qwen3.attention.key_length (its config falls back to head_dim=128),
    # so head_dim is checked against what was written rather than against transformers.
    assert ckpt.config.head_dim == tiny_head_dim(arch)
    if arch == "qwen2":
        assert ckpt.config.attention_bias


@pytest.mark.parametrize("stored", ["hf", "gguf"])
def test_quantized_linears_keep_the_checkpoints_biases(stored: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen2's q/k/v biases (random here: a random model's are zeros) through int8 weights, and through a
    GGUF file's Q8_0 ones: the loader assigns the checkpoint's tensors, and the kernels must add the loaded
    biases, not the zeros they were built with (dropped, they move the log-probabilities by nats; 8-bit
    weights of this random model, by tenths)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(TINY_CONFIGS["qwen2"]())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(std=1.0)
    if stored == "gguf":
        path = tmp_path / "qwen2.gguf"
        kinds = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
        write_gguf(path, model, "qwen2", dict.fromkeys(kinds, gguf.GGMLQuantizationType.Q8_0), head=True)
        monkeypatch.setattr("conveyor.models.loader._gguf_tokenizer", lambda path: tiny_tokenizer())
    else:
        path = tmp_path
        model.save_pretrained(path)
        tiny_tokenizer().save_pretrained(path)
    prompts = random_prompts([5, 12, 30], seed=3)
    dense = next_token_logprobs(LLM(path, dtype="float32"), prompts)
    llm = LLM(path, dtype="bfloat16", quantization="int8" if stored == "hf" else None)
    assert isinstance(llm.engine.model.layers[0].qkv_proj, QuantLinear)
    err = (next_token_logprobs(llm, prompts) - dense).abs().max().item()
    assert err < 0.5, err


@pytest.mark.parametrize(
    ("max_shard_size", "tied", "dtype"),
    [("50GB", False, torch.float32), ("40KB", True, torch.bfloat16)],
    ids=["single-file", "sharded-tied-bf16"],
)
def test_hf_directory(tmp_path: Path, max_shard_size: str, tied: bool, dtype: torch.dtype) -> None:
    tokenizer = tiny_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp_path, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").exists() == (max_shard_size == "40KB")

    ckpt = load_checkpoint(str(tmp_path), dtype=dtype)

    assert ckpt.path == tmp_path
    assert isinstance(ckpt.config, transformers.LlamaConfig)
    assert ckpt.config.hidden_size == 64 and ckpt.config.tie_word_embeddings == tied
    assert ckpt.tokenizer.encode("w5 w7", add_special_tokens=False) == [5, 7]
    expected = model.state_dict()
    if tied:
        expected.pop("lm_head.weight")
    assert set(ckpt.state_dict) == set(expected)
    for name, tensor in ckpt.state_dict.items():
        assert tensor.dtype == dtype, name
        assert torch.equal(tensor, expected[name].to(dtype)), name


def test_missing_path_raises_file_not_found(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_checkpoint(missing)


def _dir_without_config(root: Path) -> Path:
    (root / "model.safetensors").write_bytes(b"")
    return root


def _dir_with_bad_config(root: Path) -> Path:
    (root / "config.json").write_text("{not json")
    return root


def _dir_without_weights(root: Path) -> Path:
    transformers.LlamaConfig(hidden_size=64, num_attention_heads=4).save_pretrained(root)
    return root


def _dir_without_tokenizer(root: Path) -> Path:
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    transformers.LlamaForCausalLM(config).save_pretrained(root)
    return root


def _bitsandbytes_dir(root: Path) -> Path:
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2)
    config.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    config.save_pretrained(root)
    return root


def _random_bytes_gguf(root: Path) -> Path:
    (path := root / "x.gguf").write_bytes(os.urandom(4096))
    return path


def _text_gguf(root: Path) -> Path:
    (path := root / "x.gguf").write_text("this is not a model\n")
    return path


def _unsupported_arch_gguf(root: Path) -> Path:
    writer = gguf.GGUFWriter(path := root / "x.gguf", "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _unsupported_extension(root: Path) -> Path:
    (path := root / "model.bin").write_bytes(b"\0" * 16)
    return path


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (_dir_without_config, "config.json is missing"),
        (_dir_with_bad_config, "Invalid config.json"),
        (_dir_without_weights, "No *.safetensors"),
        (_dir_without_tokenizer, "Cannot load the tokenizer"),
        (_bitsandbytes_dir, "holds weights quantized with 'bitsandbytes' (its config's quantization_config), which "
                            "Conveyor does not read: serve the model's unquantized checkpoint"),
        (_random_bytes_gguf, "Not a valid GGUF file"),
        (_text_gguf, "Not a valid GGUF file"),
        (_unsupported_arch_gguf, "Unsupported GGUF architecture 'gpt2'"),
        (_unsupported_extension, "expected a Hugging Face model directory"),
    ],
)
def test_invalid_models_raise_model_load_error(tmp_path: Path, make, message: str) -> None:
    path = make(tmp_path)
    with pytest.raises(ModelLoadError) as info:
        load_checkpoint(path)
    assert message in str(info.value)
    assert str(path) in str(info.value)


def test_bad_safetensors_index_raises_model_load_error(tmp_path: Path) -> None:
    _dir_without_weights(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    with pytest.raises(ModelLoadError, match="gone.safetensors"):
        load_checkpoint(tmp_path)


def test_gguf_tokenizer_is_cached_and_identical(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from conveyor.models.loader import _gguf_tokenizer

    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path))
    path = default_model_path()
    converted = _gguf_tokenizer(path)
    saved = list(tmp_path.glob("tokenizers/*/tokenizer_config.json"))
    assert len(saved) == 1
    cached = _gguf_tokenizer(path)
    text = "Héllo wörld 🙂  spaces   and\ttabs\n\nnewlines <|im_start|>x"
    assert cached.encode(text) == converted.encode(text)
    messages = [{"role": "user", "content": text}]
    assert cached.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
        converted.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert (cached.eos_token_id, cached.bos_token_id, len(cached)) == (converted.eos_token_id, converted.bos_token_id,
                                                                       len(converted))


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q2_K, gguf.GGMLQuantizationType.Q3_K,
                                   gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K,
                                   gguf.GGMLQuantizationType.Q6_K, gguf.GGMLQuantizationType.IQ4_XS,
                                   gguf.GGMLQuantizationType.IQ4_NL], ids=lambda t: t.name)
def test_kquant_and_iq4_files_are_kept_as_stored(tmp_path: Path, qtype: gguf.GGMLQuantizationType) -> None:
    """A file whose matrices are a K-quant or an IQ4 type runs them through the kernels as stored: every
    linear layer holds that type, in at most 1.05x the file's bytes for those matrices (the tiles'
    unpacked scales), and it generates."""
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    file_bytes = write_random_block_gguf(path, qtype)
    llm = LLM(str(path))
    assert llm.quantization == "gguf"
    linears = [m for m in llm.engine.model.modules() if isinstance(m, QuantLinear)]
    segments = [s for m in linears for s in m.kernel.segments]
    assert linears and {s.type_name for s in segments} == {qtype.name}
    assert all(s.layout == "tiles" for s in segments)
    resident = sum(s.nbytes for s in segments)
    assert file_bytes <= resident <= 1.05 * file_bytes, (resident, file_bytes)
    out = llm.generate([[1, 5, 9, 12]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 4
    allocator = llm.engine.allocator
    assert allocator.num_free_blocks == allocator.num_total_blocks
