"""`python -m tools.random_gguf --shape llama-3.2-1b --type q4_0 --out FILE`: a GGUF file of a real model's
shape with random weights, for speed measurements at the sizes people run (speed needs no trained
weights). Matrices in Q4_0, Q8_0 or F16 (gguf's own quantizer), the token embedding in Q8_0 (F16 with
--type f16), norms in F32; a tokenizer of placeholder tokens of the model's vocabulary size. gpt-oss-20b's
experts are random MXFP4 blocks, as the released file stores them (its other matrices in --type); LFM2's
conv layers (and LFM2-8B-A1B's experts, in --type) and Granite 4.0-H's Mamba-2 layers are named as llama.cpp's
converter names them. The
K-quant and IQ4 mixes people download (q4_k_m, q5_k_m, q6_k, iq4_xs, ...) come from llama.cpp's
`llama-quantize` (--llama-quantize PATH) over a Q8_0 file written first. Tensors are written one at a
time, so an 8B shape needs no more memory than its largest matrix. llama.cpp and Conveyor both load it.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

QType = gguf.GGMLQuantizationType
LFM2_KERNEL = 3  # LFM2's `conv_L_cache`
GRANITE_KERNEL = 4  # Granite 4.0-H's `mamba_d_conv`
TYPES = {"q4_0": QType.Q4_0, "q8_0": QType.Q8_0, "f16": QType.F16}
# llama-quantize's names of the mixes it makes (`llama-quantize --help`), by our lower-case name.
LLAMA_QUANTIZE_TYPES = {name.lower(): name for name in ("Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M",
                                                        "Q5_K_S", "Q5_K_M", "Q6_K", "IQ4_XS", "IQ4_NL")}


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
    experts: int = 0  # experts per layer (stacked; gpt-oss's in MXFP4), of which `experts_used` a token
    experts_used: int = 0
    attention_layers: tuple[int, ...] = ()  # LFM2: the layers with attention; the others are short convolutions
    expert_ffn: int = 0  # LFM2-MoE: each expert's width (`ffn` is the dense layers'), after `dense_layers` dense ones
    dense_layers: int = 0
    ssm_heads: int = 0  # Granite 4.0-H: the Mamba-2 layers' heads (of 64), in the layers without attention
    ssm_state: int = 128
    shared_ffn: int = 0  # Granite 4.0-H with experts: the shared MLP's width beside them


SHAPES = {
    "llama-3.2-1b": Shape("llama", 2048, 16, 32, 8, 64, 8192, 128256, True, 500000.0),
    "llama-3.2-3b": Shape("llama", 3072, 28, 24, 8, 128, 8192, 128256, True, 500000.0),
    "qwen3-4b": Shape("qwen3", 2560, 36, 32, 8, 128, 9728, 151936, True, 1000000.0),
    "llama-3.1-8b": Shape("llama", 4096, 32, 32, 8, 128, 14336, 128256, False, 500000.0),
    # Qwen3-30B-A3B: 48 layers of attention (4 KV heads of 128, q/k norms), 128 experts of 768 a layer, 8 a token
    "qwen3-30b-a3b": Shape("qwen3moe", 2048, 48, 32, 4, 128, 768, 151936, False, 1000000.0, 40960, 128, 8),
    "gpt-oss-20b": Shape("gpt-oss", 2880, 24, 64, 8, 64, 2880, 201088, False, 150000.0, 131072, 32, 4),
    # LFM2-1.2B and 350M (LFM2.5's too): MLP widths as the converter writes them (the configs' adjusted)
    "lfm2-1.2b": Shape("lfm2", 2048, 16, 32, 8, 64, 8192, 65536, True, 1000000.0,
                       attention_layers=(2, 5, 8, 10, 12, 14)),
    "lfm2-350m": Shape("lfm2", 1024, 16, 16, 8, 64, 4608, 65536, True, 1000000.0,
                       attention_layers=(2, 5, 8, 10, 12, 14)),
    # LFM2-8B-A1B: 24 layers (6 with attention), the first 2 dense, then 32 experts of 1,792 a layer, 4 a token
    "lfm2-8b-a1b": Shape("lfm2moe", 2048, 24, 32, 8, 64, 7168, 65536, True, 1000000.0, experts=32, experts_used=4,
                         attention_layers=(2, 6, 10, 14, 18, 21), expert_ffn=1792, dense_layers=2),
    # Granite 4.0-H micro (3B) and tiny (7B, 1B active): 40 layers, 4 with NoPE attention, 36 Mamba-2 layers of
    # 64 or 48 heads of 64 and a state of 128; tiny's 64 experts of 512 (6 a token) beside a shared MLP of 1,024
    "granite-4.0-h-micro": Shape("granitehybrid", 2048, 40, 32, 8, 64, 8192, 100352, True, 10000.0,
                                 attention_layers=(9, 19, 29, 39), ssm_heads=64),
    "granite-4.0-h-tiny": Shape("granitehybrid", 1536, 40, 12, 4, 128, 512, 100352, True, 10000.0, experts=64,
                                experts_used=6, attention_layers=(9, 19, 29, 39), ssm_heads=48, shared_ffn=1024),
    "tiny": Shape("llama", 256, 2, 4, 2, 64, 512, 512, True, 10000.0, context=2048),  # for tests
    "tiny-gpt-oss": Shape("gpt-oss", 256, 2, 4, 2, 64, 256, 512, False, 10000.0, 8192, 4, 2),  # for tests
    "tiny-qwen3moe": Shape("qwen3moe", 256, 2, 4, 2, 64, 128, 512, False, 10000.0, 2048, 8, 2),  # for tests
}


def header(writer: gguf.GGUFWriter, shape: Shape) -> None:
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    if shape.attention_layers:  # (LFM2, Granite 4.0-H: KV heads a layer, none in a conv or Mamba layer)
        writer.add_head_count_kv([shape.kv_heads * (i in shape.attention_layers) for i in range(shape.layers)])
        if shape.arch.startswith("lfm2"):
            writer.add_shortconv_l_cache(LFM2_KERNEL)
    else:
        writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
        writer.add_expert_feed_forward_length(shape.expert_ffn or shape.ffn)
    if shape.arch == "lfm2moe":  # (sigmoid scores, a choosing bias)
        writer.add_leading_dense_block_count(shape.dense_layers)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if shape.arch == "granitehybrid":  # (the released models' multipliers; NoPE; Mamba-2 kernels of 4)
        writer.add_attention_scale(1 / 128)
        writer.add_embedding_scale(12.0)
        writer.add_residual_scale(0.22)
        writer.add_logit_scale(8.0)
        writer.add_rope_scaling_finetuned(False)
        writer.add_ssm_conv_kernel(GRANITE_KERNEL)
        writer.add_ssm_state_size(shape.ssm_state)
        writer.add_ssm_group_count(1)
        writer.add_ssm_inner_size(2 * shape.hidden)
        writer.add_ssm_time_step_rank(shape.ssm_heads)
        writer.add_expert_shared_feed_forward_length(shape.shared_ffn or shape.ffn)
    if shape.arch == "gpt-oss":  # YaRN over 4,096 positions, 128-token windows on the even layers
        writer.add_sliding_window(128)
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(32.0)
        writer.add_rope_scaling_orig_ctx_len(4096)
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
    if shape.arch == "gpt-oss":
        return out + [t for i in range(shape.layers) for t in gpt_oss_layer(shape, i)]
    if shape.arch == "granitehybrid":
        return out + [t for i in range(shape.layers) for t in granite_hybrid_layer(shape, i)]
    if shape.attention_layers:
        out[1] = ("token_embd_norm.weight", (h,), False)  # (LFM2's final norm)
        return out + [t for i in range(shape.layers) for t in lfm2_layer(shape, i)]
    for i in range(shape.layers):
        out += [(f"blk.{i}.attn_norm.weight", (h,), False), (f"blk.{i}.attn_q.weight", (q, h), True),
                (f"blk.{i}.attn_k.weight", (kv, h), True), (f"blk.{i}.attn_v.weight", (kv, h), True),
                (f"blk.{i}.attn_output.weight", (h, q), True), (f"blk.{i}.ffn_norm.weight", (h,), False)]
        e, f = shape.experts, shape.ffn
        out += [(f"blk.{i}.ffn_gate_inp.weight", (e, h), False), (f"blk.{i}.ffn_gate_exps.weight", (e, f, h), True),
                (f"blk.{i}.ffn_up_exps.weight", (e, f, h), True), (f"blk.{i}.ffn_down_exps.weight", (e, h, f), True)
                ] if e else [(f"blk.{i}.ffn_gate.weight", (f, h), True), (f"blk.{i}.ffn_up.weight", (f, h), True),
                             (f"blk.{i}.ffn_down.weight", (h, f), True)]
        if shape.arch in ("qwen3", "qwen3moe"):
            out += [(f"blk.{i}.attn_q_norm.weight", (shape.head_dim,), False),
                    (f"blk.{i}.attn_k_norm.weight", (shape.head_dim,), False)]
    return out


def gpt_oss_layer(shape: Shape, i: int) -> list[tuple[str, tuple[int, ...], bool]]:
    """gpt-oss's layer `i` as llama.cpp's converter names it: attention with biases and sinks, the router with
    its bias, the stacked experts (3-D: MXFP4) with theirs."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    e, f, p = shape.experts, shape.ffn, f"blk.{i}."
    return [(p + "attn_norm.weight", (h,), False), (p + "post_attention_norm.weight", (h,), False),
            (p + "attn_q.weight", (q, h), True), (p + "attn_q.bias", (q,), False),
            (p + "attn_k.weight", (kv, h), True), (p + "attn_k.bias", (kv,), False),
            (p + "attn_v.weight", (kv, h), True), (p + "attn_v.bias", (kv,), False),
            (p + "attn_output.weight", (h, q), True), (p + "attn_output.bias", (h,), False),
            (p + "attn_sinks.weight", (shape.heads,), False),
            (p + "ffn_gate_inp.weight", (e, h), False), (p + "ffn_gate_inp.bias", (e,), False),
            (p + "ffn_gate_exps.weight", (e, f, h), True), (p + "ffn_gate_exps.bias", (e, f), False),
            (p + "ffn_up_exps.weight", (e, f, h), True), (p + "ffn_up_exps.bias", (e, f), False),
            (p + "ffn_down_exps.weight", (e, h, f), True), (p + "ffn_down_exps.bias", (e, h), False)]


def lfm2_layer(shape: Shape, i: int) -> list[tuple[str, tuple[int, ...], bool]]:
    """LFM2's layer `i` as llama.cpp's converter names it: attention with per-head q/k norms, or the short
    convolution (its kernel F32, `[hidden, 3]`); the MLP."""
    h, q, kv, p = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, f"blk.{i}."
    if i in shape.attention_layers:
        block = [(p + "attn_q.weight", (q, h), True), (p + "attn_k.weight", (kv, h), True),
                 (p + "attn_v.weight", (kv, h), True), (p + "attn_output.weight", (h, q), True),
                 (p + "attn_q_norm.weight", (shape.head_dim,), False),
                 (p + "attn_k_norm.weight", (shape.head_dim,), False)]
    else:
        block = [(p + "shortconv.conv.weight", (h, LFM2_KERNEL), False),
                 (p + "shortconv.in_proj.weight", (3 * h, h), True), (p + "shortconv.out_proj.weight", (h, h), True)]
    if shape.experts and i >= shape.dense_layers:  # (LFM2-MoE: the router and its bias F32, the experts stacked)
        e, f = shape.experts, shape.expert_ffn
        mlp = [(p + "ffn_gate_inp.weight", (e, h), False), (p + "exp_probs_b.bias", (e,), False),
               (p + "ffn_gate_exps.weight", (e, f, h), True), (p + "ffn_up_exps.weight", (e, f, h), True),
               (p + "ffn_down_exps.weight", (e, h, f), True)]
    else:
        mlp = [(p + "ffn_gate.weight", (shape.ffn, h), True), (p + "ffn_up.weight", (shape.ffn, h), True),
               (p + "ffn_down.weight", (h, shape.ffn), True)]
    return [(p + "attn_norm.weight", (h,), False), *block, (p + "ffn_norm.weight", (h,), False), *mlp]


def granite_hybrid_layer(shape: Shape, i: int) -> list[tuple[str, tuple[int, ...], bool]]:
    """Granite 4.0-H's layer `i` as llama.cpp's converter names it: attention, or the Mamba-2 mixer (its
    convolution, A, D and dt's bias F32); the shared MLP (`ffn_*`), or the experts with it beside (`*_shexp`)."""
    h, q, kv, p = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, f"blk.{i}."
    if i in shape.attention_layers:
        block = [(p + "attn_q.weight", (q, h), True), (p + "attn_k.weight", (kv, h), True),
                 (p + "attn_v.weight", (kv, h), True), (p + "attn_output.weight", (h, q), True)]
    else:
        heads, inner = shape.ssm_heads, 2 * h
        conv = inner + 2 * shape.ssm_state
        block = [(p + "ssm_in.weight", (inner + conv + heads, h), True),
                 (p + "ssm_conv1d.weight", (conv, GRANITE_KERNEL), False),
                 (p + "ssm_conv1d.bias", (conv,), False), (p + "ssm_dt.bias", (heads,), False),
                 (p + "ssm_a", (heads, 1), False), (p + "ssm_d", (heads, 1), False),
                 (p + "ssm_norm.weight", (1, inner), False), (p + "ssm_out.weight", (h, inner), True)]
    if shape.experts:
        e, f, s = shape.experts, shape.ffn, shape.shared_ffn
        mlp = [(p + "ffn_gate_inp.weight", (e, h), False), (p + "ffn_gate_exps.weight", (e, f, h), True),
               (p + "ffn_up_exps.weight", (e, f, h), True), (p + "ffn_down_exps.weight", (e, h, f), True),
               (p + "ffn_gate_shexp.weight", (s, h), True), (p + "ffn_up_shexp.weight", (s, h), True),
               (p + "ffn_down_shexp.weight", (h, s), True)]
    else:
        mlp = [(p + "ffn_gate.weight", (shape.ffn, h), True), (p + "ffn_up.weight", (shape.ffn, h), True),
               (p + "ffn_down.weight", (h, shape.ffn), True)]
    return [(p + "attn_norm.weight", (h,), False), *block, (p + "ffn_norm.weight", (h,), False), *mlp]


def random_mxfp4(rng: np.random.Generator, dims: tuple[int, ...]) -> np.ndarray:
    """Random MXFP4 blocks of `dims` (the last one in weights): random nibbles, exponents giving weights up to
    ~0.05."""
    raw = rng.integers(0, 256, size=(*dims[:-1], dims[-1] // 32, 17), dtype=np.uint8)
    raw[..., 0] = rng.integers(119, 122, size=raw.shape[:-1], dtype=np.uint8)
    return raw.reshape(*dims[:-1], -1)


def write(path: Path, shape: Shape, qtype: QType, seed: int = 0) -> int:
    """The file; returns its size in bytes. Weights ~ N(0, 0.02) (an embedding's 0.02 too), norms 1.
    Streamed: the tensor infos first, then each tensor made, written and dropped in turn."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, shape.arch)
    header(writer, shape)
    plan = [(name, dims, QType.F32 if not matrix else QType.MXFP4 if len(dims) == 3 and shape.arch == "gpt-oss" else
             QType.Q8_0 if name == "token_embd.weight" and qtype != QType.F16 else qtype)
            for name, dims, matrix in tensors(shape)]
    for name, dims, kind in plan:
        block, size = gguf.GGML_QUANT_SIZES[kind]  # elements and bytes of a block
        raw = (*dims[:-1], dims[-1] // block * size)  # the data's shape in bytes
        writer.add_tensor_info(name, raw, np.dtype(np.uint8), int(np.prod(raw)), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, dims, kind in plan:
        if kind == QType.MXFP4:
            writer.write_tensor_data(random_mxfp4(rng, dims))
            continue
        if kind == QType.F32:  # norms and D 1; A -1 to -16 (transformers' initial); biases, sinks and routers small
            values = np.ones(dims, dtype=np.float32) if name.endswith(("norm.weight", "ssm_d")) else (
                -np.linspace(1, 16, dims[0], dtype=np.float32)[:, None] if name.endswith("ssm_a") else
                rng.standard_normal(dims, dtype=np.float32) * 0.02)
            writer.write_tensor_data(values.astype(np.float32))
            continue
        values = (rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float32)
        writer.write_tensor_data(gguf.quants.quantize(values, kind))
    writer.close()
    return path.stat().st_size


def quantize_with_llama(path: Path, shape: Shape, mix: str, llama_quantize: str, seed: int = 0) -> int:
    """A Q8_0 file (a temporary one beside `path`) re-quantized by llama.cpp's llama-quantize to `mix`."""
    with tempfile.NamedTemporaryFile(suffix=".gguf", dir=path.parent) as tmp:
        write(Path(tmp.name), shape, QType.Q8_0, seed)
        done = subprocess.run([llama_quantize, "--allow-requantize", tmp.name, str(path),
                               LLAMA_QUANTIZE_TYPES[mix]], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: {llama_quantize} failed ({done.returncode}): {done.stderr[-2000:]}")
    return path.stat().st_size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.random_gguf", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    parser.add_argument("--type", choices=sorted(TYPES) + sorted(LLAMA_QUANTIZE_TYPES), default="q4_0",
                        help="the matrices' type (K-quant and IQ4 mixes need --llama-quantize)")
    parser.add_argument("--llama-quantize", metavar="PATH",
                        help="llama.cpp's llama-quantize binary, for the K-quant and IQ4 mixes")
    parser.add_argument("--out", required=True, help="the .gguf file to write")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    started = time.monotonic()
    if args.type in LLAMA_QUANTIZE_TYPES:
        if not args.llama_quantize:
            parser.error(f"--type {args.type} is made by llama.cpp's llama-quantize: pass --llama-quantize PATH")
        size = quantize_with_llama(Path(args.out), SHAPES[args.shape], args.type, args.llama_quantize, args.seed)
    else:
        size = write(Path(args.out), SHAPES[args.shape], TYPES[args.type], args.seed)
    took = time.monotonic() - started
    print(f"wrote {args.out}: {args.shape} in {args.type}, {size / 2**30:.2f} GiB in {took:.0f} s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
