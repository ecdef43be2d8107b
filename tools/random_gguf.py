"""`python -m tools.random_gguf --shape llama-3.2-1b --type q4_0 --out FILE`: a GGUF file of a real model's
shape with random weights, for speed measurements at the sizes people run (speed needs no trained
weights). Matrices in Q4_0, Q8_0 or F16 (gguf's own quantizer; K-quants come from llama.cpp's
`llama-quantize` over an F16 file), the token embedding in Q8_0 (F16 with --type f16), norms in F32;
a tokenizer of placeholder tokens of the model's vocabulary size. llama.cpp and Conveyor both load it.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

QType = gguf.GGMLQuantizationType
TYPES = {"q4_0": QType.Q4_0, "q8_0": QType.Q8_0, "f16": QType.F16}


@dataclass(frozen=True)
class Shape:
    arch: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    rope_theta: float
    context: int = 32768


SHAPES = {
    "llama-3.2-1b": Shape("llama", 2048, 16, 32, 8, 64, 8192, 128256, True, 500000.0),
    "llama-3.2-3b": Shape("llama", 3072, 28, 24, 8, 128, 8192, 128256, True, 500000.0),
    "qwen3-4b": Shape("qwen3", 2560, 36, 32, 8, 128, 9728, 151936, True, 1000000.0),
    "llama-3.1-8b": Shape("llama", 4096, 32, 32, 8, 128, 14336, 128256, False, 500000.0),
    "tiny": Shape("llama", 256, 2, 4, 2, 64, 512, 512, True, 10000.0, context=2048),  # for tests
}


def header(writer: gguf.GGUFWriter, shape: Shape) -> None:
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(shape.vocab)
    writer.add_tokenizer_model("gpt2")
    # Placeholder tokens, and one merge (llama.cpp loads no BPE vocabulary without merges; transformers takes
    # only merges of tokens in the vocabulary): "a" + "b" -> "ab".
    tokens = [f"t{i}" for i in range(shape.vocab)]
    tokens[3:6] = ["a", "b", "ab"]
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * shape.vocab)
    writer.add_token_types([gguf.TokenType.NORMAL] * shape.vocab)
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def tensors(shape: Shape) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, [rows, cols], is a matrix) of every tensor, in llama.cpp's names."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    out = [("token_embd.weight", (shape.vocab, h), True), ("output_norm.weight", (h,), False)]
    if not shape.tied:
        out.append(("output.weight", (shape.vocab, h), True))
    for i in range(shape.layers):
        out += [(f"blk.{i}.attn_norm.weight", (h,), False), (f"blk.{i}.attn_q.weight", (q, h), True),
                (f"blk.{i}.attn_k.weight", (kv, h), True), (f"blk.{i}.attn_v.weight", (kv, h), True),
                (f"blk.{i}.attn_output.weight", (h, q), True), (f"blk.{i}.ffn_norm.weight", (h,), False),
                (f"blk.{i}.ffn_gate.weight", (shape.ffn, h), True), (f"blk.{i}.ffn_up.weight", (shape.ffn, h), True),
                (f"blk.{i}.ffn_down.weight", (h, shape.ffn), True)]
        if shape.arch == "qwen3":
            out += [(f"blk.{i}.attn_q_norm.weight", (shape.head_dim,), False),
                    (f"blk.{i}.attn_k_norm.weight", (shape.head_dim,), False)]
    return out


def write(path: Path, shape: Shape, qtype: QType, seed: int = 0) -> int:
    """The file; returns its size in bytes. Weights ~ N(0, 0.02) (an embedding's 0.02 too), norms 1."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, shape.arch)
    header(writer, shape)
    for name, dims, matrix in tensors(shape):
        if not matrix:
            writer.add_tensor(name, np.ones(dims, dtype=np.float32))
            continue
        values = (rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float32)
        kind = QType.Q8_0 if name == "token_embd.weight" and qtype != QType.F16 else qtype
        data = gguf.quants.quantize(values, kind)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.stat().st_size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.random_gguf", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    parser.add_argument("--type", choices=sorted(TYPES), default="q4_0", help="the matrices' type")
    parser.add_argument("--out", required=True, help="the .gguf file to write")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    started = time.monotonic()
    size = write(Path(args.out), SHAPES[args.shape], TYPES[args.type], args.seed)
    print(f"wrote {args.out}: {args.shape} in {args.type}, {size / 2**30:.2f} GiB in {time.monotonic() - started:.0f} s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
