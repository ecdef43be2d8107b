"""dtype and quantization: what each choice resolves to, the errors for bad ones, and each mode's
measured closeness to the fp32 exact path on tiny models (log-probabilities and greedy agreement)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conveyor import LLM
from conveyor.layers.precision import resolve_precision
from conveyor.layers.quantization import linear as quant_linear
from conveyor.layers.quantization.linear import QuantEmbedding, QuantLinear
from conveyor.layers.quantization.tensors import QuantizedTensor
from conveyor.models import build_model, gguf_file
from conveyor.models.base import no_init_weights
from conveyor.models.loader import _undo_llama_rope_permute, load_checkpoint

from tests.gguf_writer import GGUF_TYPES, write_quantized_gguf
from tests.utils import (BF16_AGREEMENT, BF16_TOLERANCE, QUANT_MODES, TinyModel, agreement, greedy_ids,
                         next_token_logprobs, random_prompts, smaps_fields)

CPU = torch.device("cpu")


def test_auto_dtype_follows_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("conveyor.layers.precision.cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    p = resolve_precision("auto", None, CPU, "model.gguf")
    assert p.dtype == torch.bfloat16 and p.quantization is None and not p.exact and "avx512_bf16" in p.reason
    monkeypatch.setattr("conveyor.layers.precision.cpu_flags", lambda: frozenset({"avx2", "fma"}))
    p = resolve_precision("auto", None, CPU, "model.gguf")
    assert p.dtype == torch.float32 and p.quantization is None and not p.exact  # still takes the quantized kernels
    assert resolve_precision("auto", None, torch.device("cuda"), None).dtype == torch.bfloat16
    exact = resolve_precision("float32", None, CPU, None)
    assert exact.exact and exact.quantization == "none"
    assert resolve_precision("auto", None, CPU, "/some/hf-dir").quantization == "none"
    assert resolve_precision("bf16", "int4", CPU, "/some/hf-dir").quantization == "int4"


@pytest.mark.parametrize(("dtype", "quantization", "device", "path", "message"), [
    ("float64", None, "cpu", None, "dtype must be one of"),
    ("auto", "q4", "cpu", None, "quantization must be one of"),
    ("float32", "int8", "cpu", None, "exact path"),
    (torch.float32, "gguf", "cpu", None, "exact path"),
    ("auto", "gguf", "cpu", "/some/hf-dir", "needs a GGUF file"),
    ("bfloat16", "int4", "cuda", None, "CPU only"),
])
def test_bad_choices_name_what_would_work(dtype, quantization, device, path, message) -> None:
    with pytest.raises(ValueError, match=message) as info:
        resolve_precision(dtype, quantization, torch.device(device), path)
    assert "'none'" in str(info.value) or "one of" in str(info.value) or "'int8'" in str(info.value)


@pytest.fixture(scope="module")
def smooth(tiny_models: dict[str, TinyModel]) -> TinyModel:
    return tiny_models["llama_smooth"]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts([5, 9, 14, 20, 3, 30, 11, 7, 25, 16, 8, 12], seed=41)


def test_bf16_is_close_to_fp32(smooth: TinyModel, prompts: list[list[int]]) -> None:
    fp32, bf16 = smooth.llm(dtype="float32"), smooth.llm(dtype="bfloat16")
    assert bf16.dtype == torch.bfloat16 and bf16.quantization == "none"
    assert bf16.engine.pool.kv[0].dtype == torch.bfloat16
    err = (next_token_logprobs(bf16, prompts) - next_token_logprobs(fp32, prompts)).abs().max().item()
    assert err < BF16_TOLERANCE, f"bf16: log-prob error {err:.3f}"
    rate = agreement(greedy_ids(bf16, prompts), greedy_ids(fp32, prompts))
    assert rate >= BF16_AGREEMENT, f"bf16: greedy agreement {rate:.2f}"


def with_weights_of(exact: LLM, quantized: LLM) -> LLM:
    """`exact` (fp32, dense) with every linear and embedding weight replaced by the quantized model's
    weight, dequantized: the reference for what the quantized kernels compute."""
    dense, quant = exact.engine.model, quantized.engine.model
    with torch.no_grad():
        for name, module in quant.named_modules():
            if isinstance(module, QuantLinear):
                weight = torch.cat([s.dequantize() for s in module.kernel.segments])
            elif isinstance(module, QuantEmbedding):
                weight = module.weight.dequantize()
            else:
                continue
            dense.get_submodule(name).weight.copy_(weight)
    return exact


@pytest.mark.parametrize("quantization", list(QUANT_MODES))
@pytest.mark.parametrize("dtype", ["auto-fp32", "bfloat16"])
def test_quantized_mode_quality(smooth: TinyModel, prompts: list[list[int]], dtype: str, quantization: str,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    if dtype == "auto-fp32":  # a CPU without native bf16: fp32 compute, quantized weights all the same
        monkeypatch.setattr("conveyor.layers.precision.cpu_flags", lambda: frozenset({"avx2"}))
    llm = smooth.llm(dtype=dtype.removesuffix("-fp32"), quantization=quantization)
    assert llm.dtype == (torch.float32 if dtype == "auto-fp32" else getattr(torch, dtype))
    assert llm.quantization == quantization
    quantized = [m for m in llm.engine.model.modules() if isinstance(m, (QuantLinear, QuantEmbedding))]
    assert len(quantized) == 2 * 4 + 1  # qkv, o, gate_up, down per layer; the embedding (the head is tied to it)
    monkeypatch.undo()
    ours_lp, ours_ids = next_token_logprobs(llm, prompts), greedy_ids(llm, prompts)
    fp32 = smooth.llm(dtype="float32")
    fp32_lp, fp32_ids = next_token_logprobs(fp32, prompts), greedy_ids(fp32, prompts)
    same_weights = with_weights_of(fp32, llm)
    limits = zip(QUANT_MODES[quantization], ("its own weights", "fp32"))
    refs = [(next_token_logprobs(same_weights, prompts), greedy_ids(same_weights, prompts)), (fp32_lp, fp32_ids)]
    for ((tolerance, least), against), (ref_lp, ref_ids) in zip(limits, refs):
        err = (ours_lp - ref_lp).abs().max().item()
        assert err < tolerance, f"{dtype}/{quantization} vs {against}: log-prob error {err:.3f}"
        rate = agreement(ours_ids, ref_ids)
        assert rate >= least, f"{dtype}/{quantization} vs {against}: greedy agreement {rate:.2f}"
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_total_blocks


@pytest.fixture(scope="module")
def quantized_gguf(tiny_llama: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-q.gguf"
    write_quantized_gguf(path, tiny_llama, GGUF_TYPES)
    return path


def test_gguf_tensors_kept_as_they_are(quantized_gguf: Path, gguf_tokenizer: None) -> None:
    """Quantized tensors stay quantized (the file's bytes, Q/K rows permuted back as whole blocks)
    and dequantize to exactly what the float load gives."""
    kept = load_checkpoint(quantized_gguf, keep_quantized=True)
    dense = load_checkpoint(quantized_gguf)
    assert kept.quantized and not dense.quantized
    q = kept.state_dict["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, QuantizedTensor) and q.type_name == "Q4_1"
    assert isinstance(kept.state_dict["model.layers.1.self_attn.v_proj.weight"], QuantizedTensor)
    assert not isinstance(kept.state_dict["model.norm.weight"], QuantizedTensor)
    for name, tensor in kept.state_dict.items():
        value = tensor.dequantize() if isinstance(tensor, QuantizedTensor) else tensor
        assert torch.equal(value, dense.state_dict[name]), name
    assert _undo_llama_rope_permute(np.arange(8), 2).tolist() != list(range(8))  # the permutation is not trivial


def test_gguf_tensors_kept_quantized_are_views_of_the_file(quantized_gguf: Path, gguf_tokenizer: None,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A load copies none of the tensors it keeps quantized (except Q/K, whose rows are permuted): they are
    the file's pages, so loading holds a model once in memory, not twice (the repacked tiles are the copy)."""
    maps: list[np.memmap] = []
    memmap = np.memmap

    def recording(*args, **kwargs):
        maps.append(memmap(*args, **kwargs))
        return maps[-1]

    monkeypatch.setattr(gguf_file.np, "memmap", recording)
    kept = load_checkpoint(quantized_gguf, keep_quantized=True)

    def mapped(t: torch.Tensor) -> bool:
        return any(m.ctypes.data <= t.data_ptr() < m.ctypes.data + m.size for m in maps)

    v = kept.state_dict["model.layers.1.self_attn.v_proj.weight"]
    q = kept.state_dict["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(v, QuantizedTensor) and mapped(v.data) and v.source is not None
    assert isinstance(q, QuantizedTensor) and not mapped(q.data) and q.source is None
    # a mapping of its own (freed with the tensor, not kept by the one tensor a model keeps as rows)
    assert [m.size for m in maps if m.ctypes.data == v.data.data_ptr()] == [v.data.numel()]
    before = int(v.data[0, 0])
    v.data[0, 0] ^= 0xFF  # copy-on-write: a write changes this copy's page, never the file
    again = load_checkpoint(quantized_gguf, keep_quantized=True).state_dict["model.layers.1.self_attn.v_proj.weight"]
    assert int(again.data[0, 0]) == before != int(v.data[0, 0])


def test_an_untied_embedding_is_read_from_the_file(quantized_gguf: Path, gguf_tokenizer: None) -> None:
    """An untied GGUF table is looked up by reading its rows from the file: it takes no memory in the
    process (its mapping stays unfaulted through a generation) and gives the same tokens as the tiled
    table in memory. A tied table is the LM head's tiles, shared."""
    ours = LLM(quantized_gguf)
    table = ours.engine.model.embed_tokens
    assert isinstance(table, QuantEmbedding)
    if quant_linear.matmul_ops() is None:
        pytest.skip("without the native kernels the table is GGUF rows in memory")
    assert table.file is not None and table.weight.source is not None and table.weight.layout == "rows"
    prompts = random_prompts([6, 13, 21], seed=44)
    ids = greedy_ids(ours, prompts)
    assert int(smaps_fields(table.weight.data.data_ptr())["Rss"][0]) == 0  # resident KiB
    tiled = QuantEmbedding(table.weight, table.dtype)  # the same table in the process' memory, tiled
    assert tiled.weight.layout == "tiles"
    ours.engine.model.embed_tokens = tiled
    assert greedy_ids(ours, prompts) == ids


def test_building_a_model_imports_no_compiler(tiny_llama: TinyModel) -> None:
    """Loading and running a model imports neither torch._dynamo nor triton on CPU (transformers'
    `no_init_weights` imported them with `PreTrainedModel`: load time and resident memory in every
    process), and the model is built without random initialization (its weights are the checkpoint's)."""
    code = (f"import sys; from conveyor import LLM, SamplingParams; llm = LLM({str(tiny_llama.path)!r}); "
            "llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False); "
            "print([m for m in ('torch._dynamo', 'triton', 'transformers.modeling_utils') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
    with no_init_weights():
        linear = torch.nn.Linear(4, 4)
        assert torch.nn.init.ones_(linear.weight) is None  # a no-op while building
    assert torch.nn.init.ones_(linear.weight).eq(1).all()  # restored after


def test_a_checkpoints_tensors_become_the_parameters(tiny_llama: TinyModel) -> None:
    """A load in the checkpoint's dtype copies no tensor into parameters: the loaded (or fused) tensors
    are the parameters (a 1B bf16 checkpoint was copied into fp32 parameters first: 11 GiB at the peak)."""
    checkpoint = load_checkpoint(tiny_llama.path, dtype=torch.bfloat16)
    norm = checkpoint.state_dict["model.norm.weight"]
    model = build_model(checkpoint.config, checkpoint.state_dict, torch.bfloat16, torch.device("cpu"), "none")
    assert model.norm.weight.dtype == torch.bfloat16 and model.norm.weight.data_ptr() == norm.data_ptr()
    assert torch.equal(model.layers[0].input_layernorm.weight,
                       checkpoint.state_dict["model.layers.0.input_layernorm.weight"])


def test_gguf_mode_runs_the_files_weights(tiny_llama: TinyModel, quantized_gguf: Path, gguf_tokenizer: None) -> None:
    """Default on a quantized GGUF: its own tensors through the kernels (mixed-type qkv included),
    close to the exact path on the same file (which dequantizes them)."""
    prompts = random_prompts([6, 13, 21, 9, 17, 4, 28, 10], seed=43)
    exact = LLM(quantized_gguf, dtype="float32")
    assert exact.quantization == "none"
    ours = LLM(quantized_gguf)
    assert ours.quantization == "gguf"
    qkv = ours.engine.model.layers[0].qkv_proj
    assert [s.type_name for s in qkv.kernel.segments] == ["Q4_1", "Q8_0"]
    assert isinstance(ours.engine.model.embed_tokens, QuantEmbedding)
    err = (next_token_logprobs(ours, prompts) - next_token_logprobs(exact, prompts)).abs().max().item()
    # int8 activations, bf16 (0.12); the max over the vocabulary is 0.27-0.31 (the mean 0.04) by how the
    # rounding falls (fp32 RoPE frequencies moved it from 0.27 to 0.31, the mean unchanged)
    assert err < 0.35, f"gguf mode vs the file's dequantized weights: {err:.3f}"
    assert agreement(greedy_ids(ours, prompts), greedy_ids(exact, prompts)) >= 0.5
    bf32 = LLM(quantized_gguf, dtype="bfloat16", quantization="none")  # dense: bf16 tiles, nothing quantized
    linears = [m for m in bf32.engine.model.modules() if isinstance(m, QuantLinear)]
    assert linears and {s.type_name for m in linears for s in m.kernel.segments} == {"BF16"}


def test_gguf_without_quantized_tensors(tmp_path: Path, tiny_llama: TinyModel, gguf_tokenizer: None) -> None:
    path = tmp_path / "f32.gguf"
    write_quantized_gguf(path, tiny_llama, {})
    assert LLM(path).quantization == "none"
    with pytest.raises(ValueError, match="needs quantized tensors"):
        LLM(path, quantization="gguf")


def test_without_native_kernels_the_quantized_path_still_works(tiny_llama: TinyModel,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """No native build (no compiler): quantized layers dequantize and run PyTorch's matmul instead."""
    prompts = random_prompts([7, 15], seed=44)
    native = greedy_ids(tiny_llama.llm(dtype="bfloat16", quantization="int8"), prompts)
    monkeypatch.setattr(quant_linear, "matmul_ops", lambda: None)
    plain = tiny_llama.llm(dtype="bfloat16", quantization="int8")
    assert plain.engine.model.layers[0].qkv_proj.kernel.segments[0].layout == "rows"
    assert agreement(greedy_ids(plain, prompts), native) >= 0.5  # no activation quantization on this path
