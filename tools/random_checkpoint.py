"""`python -m tools.random_checkpoint --shape llama-3.2-1b --format awq --out DIR`: a Hugging Face directory of a
real model's shape (`tools.random_gguf`'s shapes, Llama and Qwen3) with random 4-bit weights in a quantized
checkpoint format: `gptq` (AutoGPTQ's layout, symmetric, groups of 128), `awq` (AutoAWQ's gemm layout,
asymmetric) or `w4a16` (compressed-tensors' pack-quantized, symmetric, groups of 128), the embedding and norms in
bf16, and a tokenizer of placeholder words of the model's vocabulary size. For speed and memory measurements of
those formats at the sizes people run (`tools.peer_speed.decode_speed --model DIR`); the values are random.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import PreTrainedTokenizerFast

from tools.random_gguf import SHAPES, Shape

FORMATS = ("gptq", "awq", "w4a16")
GROUP = 128
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's: column 8c + AWQ_ORDER[i] in nibble i of word c


def pack_rows(values: np.ndarray) -> np.ndarray:
    """`[rows, cols]` 4-bit values as int32 words along each row, value j of a word at bits 4j."""
    rows, cols = values.shape
    words = values.reshape(rows, cols // 8, 8).astype(np.uint32) << (4 * np.arange(8, dtype=np.uint32))
    return np.bitwise_or.reduce(words, axis=-1).view(np.int32)


def linear(rng: np.random.Generator, fmt: str, rows: int, cols: int) -> dict[str, torch.Tensor]:
    """One linear's tensors (by suffix) in `fmt`, random values and scales near a trained model's."""
    values = rng.integers(0, 16, (rows, cols), dtype=np.uint8)
    scales = torch.from_numpy((rng.random((cols // GROUP, rows), dtype=np.float32) * 0.004 + 0.001))
    if fmt == "gptq":
        sevens = np.full((cols // GROUP, rows), 7, dtype=np.uint8)  # (zero 8, stored minus one)
        return {"qweight": torch.from_numpy(pack_rows(values).T.copy()),  # (packed along the input dimension)
                "qzeros": torch.from_numpy(pack_rows(sevens)), "scales": scales.half(),
                "g_idx": torch.arange(cols, dtype=torch.int32) // GROUP}
    if fmt == "awq":
        order = np.arange(rows).reshape(-1, 8)[:, list(AWQ_ORDER)].reshape(-1)
        zeros = rng.integers(6, 10, (cols // GROUP, rows), dtype=np.uint8)
        return {"qweight": torch.from_numpy(pack_rows(values.T[:, order].copy())),
                "qzeros": torch.from_numpy(pack_rows(zeros[:, order].copy())), "scales": scales.half()}
    return {"weight_packed": torch.from_numpy(pack_rows(values)), "weight_scale": scales.T.contiguous().bfloat16(),
            "weight_shape": torch.tensor([rows, cols])}


def config(shape: Shape, fmt: str) -> dict:
    quantization = {
        "gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True,
                 "checkpoint_format": "gptq"},
        "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"},
        "w4a16": {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
                  "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                      "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP}}}},
    }[fmt]
    model_type = "qwen3" if shape.arch == "qwen3" else "llama"
    return {"architectures": ["Qwen3ForCausalLM" if model_type == "qwen3" else "LlamaForCausalLM"],
            "model_type": model_type, "hidden_size": shape.hidden, "intermediate_size": shape.ffn,
            "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
            "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim, "vocab_size": shape.vocab,
            "max_position_embeddings": shape.context, "rms_norm_eps": 1e-5, "rope_theta": shape.rope_theta,
            "tie_word_embeddings": shape.tied, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
            "quantization_config": quantization}


def write(out: Path, shape: Shape, fmt: str, seed: int = 0) -> int:
    """The directory; returns its weights' bytes."""
    if shape.arch not in ("llama", "qwen3"):
        raise ValueError(f"--shape {shape.arch}: only the Llama and Qwen3 shapes are written")
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)
    bf16 = lambda *dims: torch.from_numpy(rng.standard_normal(dims, dtype=np.float32) * 0.02).bfloat16()  # noqa: E731
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": bf16(shape.vocab, shape.hidden),
                                        "model.norm.weight": torch.ones(shape.hidden, dtype=torch.bfloat16)}
    if not shape.tied:
        tensors["lm_head.weight"] = bf16(shape.vocab, shape.hidden)
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        for name, rows, cols in (("self_attn.q_proj", q, shape.hidden), ("self_attn.k_proj", kv, shape.hidden),
                                 ("self_attn.v_proj", kv, shape.hidden), ("self_attn.o_proj", shape.hidden, q),
                                 ("mlp.gate_proj", shape.ffn, shape.hidden), ("mlp.up_proj", shape.ffn, shape.hidden),
                                 ("mlp.down_proj", shape.hidden, shape.ffn)):
            tensors |= {f"{p}{name}.{suffix}": t for suffix, t in linear(rng, fmt, rows, cols).items()}
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"{p}{norm}.weight"] = torch.ones(shape.hidden, dtype=torch.bfloat16)
        if shape.arch == "qwen3":
            for norm in ("q_norm", "k_norm"):
                tensors[f"{p}self_attn.{norm}.weight"] = torch.ones(shape.head_dim, dtype=torch.bfloat16)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config(shape, fmt), indent=1))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, shape.vocab)}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(out)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.random_checkpoint", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--format", choices=FORMATS, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    size = write(args.out, SHAPES[args.shape], args.format, args.seed)
    print(f"{args.out}: {args.shape} in {args.format}, {size / 2**20:,.0f} MiB of weights, "
          f"{time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
