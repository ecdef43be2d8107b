"""compressed-tensors checkpoints, written by the compressed-tensors library itself from a tiny Llama (the scales
chosen here, as llm-compressor's observers would), against transformers loading the same directory (which
decompresses it with that library): the exact path's weights and greedy ids equal; the kept kernel types hold
the same weights and run within int8's tolerance; what is not supported is named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)

from conveyor import LLM, ContinuousBatchingConfig  # noqa: E402
from conveyor.layers.quantization.tensors import QuantizedTensor  # noqa: E402
from conveyor.models.compressed_tensors import decompress, unpack  # noqa: E402
from conveyor.models.loader import load_checkpoint  # noqa: E402
from tests.utils import (QUANT_MODES, TinyModel, all_free, compare_greedy, next_token_logprobs,  # noqa: E402
                         random_prompts, tiny_tokenizer)

pytestmark = pytest.mark.usefixtures("one_thread")

INT4 = dict(num_bits=4, type="int", strategy="group", group_size=32)
# name -> (weight args, input activation args, format, the kernel type a kept weight takes)
SCHEMES = {
    "w4a16": (INT4 | {"symmetric": True}, None, "pack-quantized", "Q4_0"),
    "w4a16_asym": (INT4 | {"symmetric": False}, None, "pack-quantized", "Q4_1"),
    "w4a16_channel": (dict(num_bits=4, type="int", strategy="channel", symmetric=True), None, "pack-quantized",
                      "Q4_0"),
    "w8a16": (dict(num_bits=8, type="int", strategy="group", group_size=32, symmetric=True), None,
              "pack-quantized", "Q8_0"),
    "w8a8": (dict(num_bits=8, type="int", strategy="channel", symmetric=True),
             dict(num_bits=8, type="int", strategy="token", symmetric=True, dynamic=True), "int-quantized", "I8"),
    "fp8_dynamic": (dict(num_bits=8, type="float", strategy="channel", symmetric=True),
                    dict(num_bits=8, type="float", strategy="token", symmetric=True, dynamic=True),
                    "float-quantized", None),
    "w3a16": (dict(num_bits=3, type="int", strategy="group", group_size=32, symmetric=True), None,
              "pack-quantized", None),
}
PROMPTS = random_prompts([3, 9, 17, 30], seed=31)


def observe(module: torch.nn.Module, args: QuantizationArgs) -> None:
    """Min-max scales (and zero points), rounded to fp16 so that the kept blocks hold them exactly."""
    w = module.weight.detach().float()
    groups = w.reshape(w.shape[0], -1, args.group_size) if args.strategy == "group" else w.reshape(w.shape[0], 1, -1)
    lo, hi = groups.amin(-1), groups.amax(-1)
    if args.type == "float":
        scale = groups.abs().amax(-1) / 448
    elif args.symmetric:
        scale = groups.abs().amax(-1) / (2 ** (args.num_bits - 1) - 1)
    else:
        scale = (hi - lo) / (2 ** args.num_bits - 1)
        zero = (torch.round(-lo / scale) - 2 ** (args.num_bits - 1)).clamp(-8, 7)
        module.weight_zero_point.data = zero.to(module.weight_zero_point.dtype)
    module.weight_scale.data = scale.half().float().to(module.weight_scale.dtype)


def write_checkpoint(model: TinyModel, kind: str, path: Path) -> transformers.PreTrainedModel:
    """The tiny model compressed as `kind` into `path`; the reference transformers loads from it."""
    weights, inputs, fmt, _ = SCHEMES[kind]
    reference = transformers.AutoModelForCausalLM.from_pretrained(model.path)
    args = QuantizationArgs(**weights)
    scheme = QuantizationScheme(targets=["Linear"], weights=args,
                                input_activations=None if inputs is None else QuantizationArgs(**inputs))
    apply_quantization_config(reference, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    for module in reference.modules():
        if hasattr(module, "weight_scale"):
            observe(module, args)
    compressor = ModelCompressor.from_pretrained_model(reference, fmt)
    compressor.compress_model(reference)
    reference.save_pretrained(path)
    compressor.update_config(str(path))
    tiny_tokenizer().save_pretrained(path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", quantization_config=transformers.CompressedTensorsConfig(dequantize=True))
    return loaded.eval()


@pytest.fixture(scope="module")
def checkpoints(tiny_models: dict[str, TinyModel], tmp_path_factory: pytest.TempPathFactory) -> dict:
    model = tiny_models["llama_smooth"]
    return {kind: (path := tmp_path_factory.mktemp(kind), write_checkpoint(model, kind, path))
            for kind in SCHEMES}


def llm(path: Path, dtype: str = "float32") -> LLM:
    return LLM(path, dtype=dtype, config=ContinuousBatchingConfig(num_blocks=128, max_batch_tokens=16))


@pytest.mark.parametrize("kind", list(SCHEMES))
def test_exact_path_equals_transformers(checkpoints: dict, kind: str) -> None:
    path, reference = checkpoints[kind]
    ours = load_checkpoint(path, tokenizer=False).state_dict
    theirs = reference.state_dict()
    assert set(ours) == {k for k in theirs if k != "lm_head.weight" or not reference.config.tie_word_embeddings}
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name].float()), name
    engine = llm(path)
    compare_greedy(reference, engine, PROMPTS, [8] * len(PROMPTS), kind)
    assert all_free(engine)


@pytest.mark.parametrize("kind", [k for k, scheme in SCHEMES.items() if scheme[3] is not None])
def test_kept_weights_run_as_stored(checkpoints: dict, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kept in a kernel type, each weight is the one transformers decompresses (its fp16 scales held exactly);
    on the kernels (fp32 around them) the log-probs are within int8's tolerance of the exact path's."""
    path, reference = checkpoints[kind]
    kept = load_checkpoint(path, tokenizer=False, keep_quantized=True).state_dict
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert isinstance(kept[q_proj], QuantizedTensor) and kept[q_proj].type_name == SCHEMES[kind][3]
    for name, tensor in kept.items():
        if isinstance(tensor, QuantizedTensor):
            torch.testing.assert_close(tensor.dequantize(torch.float32), reference.state_dict()[name].float(),
                                       rtol=0, atol=0 if kind != "w4a16_asym" else 1e-3, msg=name)
    monkeypatch.setattr("conveyor.layers.precision.cpu_flags", lambda: frozenset({"avx2"}))
    ours = llm(path, dtype="auto")
    monkeypatch.undo()
    assert ours.quantization == "compressed-tensors"
    tolerance, _ = QUANT_MODES["int8"][0]
    err = (next_token_logprobs(ours, PROMPTS) - next_token_logprobs(llm(path), PROMPTS)).abs().max().item()
    assert err < tolerance, f"{kind}: kept weights' log-prob error {err:.3f}"


def test_unpack_reads_every_width() -> None:
    """Values packed densely from bit 0 (compressed-tensors' layout) read back at 2-8 bits, across words."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    for bits in range(2, 9):
        values = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (5, 96), dtype=torch.int8)
        assert torch.equal(unpack(pack_to_int32(values, bits), bits, 96), values.to(torch.int16)), bits


def test_activation_ordering_reads_each_columns_group() -> None:
    """Older GPTQ-style checkpoints name each column's group in `weight_g_idx` (compressed-tensors no longer
    writes them): column c is `q[:, c] * scale[:, g_idx[c]]`, dequantized since no kernel type holds it."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    q = torch.randint(-8, 8, (4, 64), dtype=torch.int8)
    scale = torch.rand(4, 2) + 0.5
    g_idx = torch.randperm(64) % 2
    config = {"format": "pack-quantized", "config_groups": {"g": {"targets": ["Linear"], "weights": INT4}}}
    state = {"m.weight_packed": pack_to_int32(q, 4), "m.weight_scale": scale, "m.weight_g_idx": g_idx.int(),
             "m.weight_shape": torch.tensor([4, 64])}
    out = decompress(state, config, torch.float32, keep=True)
    expected = torch.stack([q[:, c].float() * scale[:, g_idx[c]] for c in range(64)], dim=1)
    assert set(out) == {"m.weight"} and torch.equal(out["m.weight"], expected)


def test_unsupported_checkpoints_are_named(checkpoints: dict, tmp_path: Path) -> None:
    import json
    import shutil

    path, _ = checkpoints["w4a16"]
    for change, message in ((lambda q: q | {"format": "nvfp4-pack-quantized",
                                            "config_groups": {"g": q["config_groups"]["group_0"] | {"format": None}}},
                             "format 'nvfp4-pack-quantized' is not supported"),
                            (lambda q: q | {"sparsity_config": {"format": "sparse-24-bitmask"}},
                             "sparsity .* is not supported")):
        broken = tmp_path / message[:6]
        shutil.copytree(path, broken)
        config = json.loads((broken / "config.json").read_text())
        config["quantization_config"] = change(config["quantization_config"])
        (broken / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=message):
            llm(broken)
    with pytest.raises(ValueError, match="compressed-tensors checkpoint, which tensor parallelism does not split"):
        LLM(path, dtype="float32", tensor_parallel_size=2)
