"""llama.cpp's BERT GGUF files (`general.architecture` "bert": bge, all-MiniLM, e5 and the other BERT embedding
models as llama.cpp's converter writes them, XLM-RoBERTa's too (bge-m3, multilingual-e5); "nomic-bert" and
"nomic-bert-moe": nomic-embed-text v1.5 and v2-moe, Ollama's among them; "jina-bert-v2": jina-embeddings-v2):
their config, their tensors by the names `models.bert` and `models.rope_bert` read, and their tokenizers, which
transformers' GGUF reader does not build as these models use them (BERT's WordPiece, XLM-RoBERTa's unigram with
its template).

The converter writes the vocabulary in "phantom space" form: a word-initial piece gains a leading "▁", a
continuation loses its "##", control tokens stay as they are (`[CLS]`, `[SEP]`, ...). Undone, that is BERT's
vocab.txt again; `tokenizer.ggml.normalizer.lowercase` says whether to lowercase (llama.cpp lowercases when
it is absent).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import transformers
from gguf import TokenType

GLOBAL_TENSORS = {"token_embd.weight": "embeddings.word_embeddings.weight",
                  "position_embd.weight": "embeddings.position_embeddings.weight",
                  "token_types.weight": "embeddings.token_type_embeddings.weight",
                  "token_embd_norm.weight": "embeddings.LayerNorm.weight",
                  "token_embd_norm.bias": "embeddings.LayerNorm.bias",
                  # a sequence classifier's head (BertForSequenceClassification's pooler is dropped by the converter)
                  "cls.weight": "classifier.dense.weight", "cls.bias": "classifier.dense.bias",
                  "cls.output.weight": "classifier.out_proj.weight", "cls.output.bias": "classifier.out_proj.bias"}
LAYER_MODULES = {"attn_q": "attention.self.query", "attn_k": "attention.self.key", "attn_v": "attention.self.value",
                 "attn_output": "attention.output.dense", "attn_output_norm": "attention.output.LayerNorm",
                 "ffn_up": "intermediate.dense", "ffn_down": "output.dense", "layer_output_norm": "output.LayerNorm"}
# NomicBERT's original names (`models.rope_bert`): a fused QKV, a gated MLP (`fc11` up, `fc12` gate), no positions
NOMIC_GLOBAL_TENSORS = {"token_embd.weight": "embeddings.word_embeddings.weight",
                        "token_types.weight": "embeddings.token_type_embeddings.weight",
                        "token_embd_norm.weight": "emb_ln.weight", "token_embd_norm.bias": "emb_ln.bias"}
NOMIC_LAYER_MODULES = {"attn_qkv": "attn.Wqkv", "attn_output": "attn.out_proj", "attn_output_norm": "norm1",
                       "ffn_up": "mlp.fc11", "ffn_gate": "mlp.fc12", "ffn_down": "mlp.fc2",
                       "layer_output_norm": "norm2"}
LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
ARCHITECTURES = ("bert", "jina-bert-v2", "nomic-bert", "nomic-bert-moe")
# Jina v2's gated MLP (`models.bert`): `ffn_up` holds both halves, the gated one first
JINA_LAYER_MODULES = LAYER_MODULES | {"ffn_up": "mlp.gated_layers", "ffn_down": "mlp.wo",
                                      "layer_output_norm": "mlp.layernorm"}


def hf_name(name: str, arch: str = "bert") -> str | None:
    """The Hugging Face name of a BERT (or NomicBERT) GGUF tensor (None: not one the encoder reads; a
    mixture's experts and router go by `gguf_experts`' names)."""
    nomic = arch.startswith("nomic-bert")
    globals_, modules = (NOMIC_GLOBAL_TENSORS, NOMIC_LAYER_MODULES) if nomic else (GLOBAL_TENSORS, LAYER_MODULES)
    if arch == "nomic-bert-moe":  # (its dense layers' MLP is GELU's plain one)
        modules = modules | {"ffn_up": "mlp.fc1"}
    elif arch == "jina-bert-v2":
        modules = JINA_LAYER_MODULES
    if name in globals_:
        return globals_[name]
    match = LAYER_TENSOR.fullmatch(name)
    if match is None or match[2] not in modules:
        return None
    return f"encoder.{'layers' if nomic else 'layer'}.{match[1]}.{modules[match[2]]}.{match[3]}"


def hf_config(field: Callable[..., Any], tensors: Sequence[Any], arch: str = "bert") -> transformers.PretrainedConfig:
    """The BertConfig (NomicBertConfig) of the file's metadata (`field(key[, default])` reads a key); the token
    types' count from their table, which the converter keeps whole whatever `token_type_count` says."""
    types = next((t for t in tensors if t.name == "token_types.weight"), None)
    labels = field(f"{arch}.classifier.output_labels", None)
    extra = {"id2label": dict(enumerate(labels))} if labels else {}
    common = dict(
        vocab_size=len(field("tokenizer.ggml.tokens")), hidden_size=field(f"{arch}.embedding_length"),
        num_hidden_layers=field(f"{arch}.block_count"), num_attention_heads=field(f"{arch}.attention.head_count"),
        intermediate_size=field(f"{arch}.feed_forward_length"), max_position_embeddings=field(f"{arch}.context_length"),
        layer_norm_eps=field(f"{arch}.attention.layer_norm_epsilon"),
        type_vocab_size=int(types.shape[1]) if types is not None else 1,
        pad_token_id=field("tokenizer.ggml.padding_token_id", 0), **extra)
    if arch == "nomic-bert":
        return transformers.NomicBertConfig(**common, hidden_act="silu", rope_parameters={
            "rope_type": "default", "rope_theta": float(field("nomic-bert.rope.freq_base", 1000.0))})
    if arch == "nomic-bert-moe":  # (nomic's own field names: GELU MLPs and experts with biases, `models.rope_bert`)
        names = {t.name for t in tensors}
        return transformers.NomicBertConfig(
            vocab_size=common["vocab_size"], pad_token_id=common["pad_token_id"], n_embd=common["hidden_size"],
            n_layer=common["num_hidden_layers"], n_head=common["num_attention_heads"],
            n_inner=common["intermediate_size"], activation_function="gelu",
            layer_norm_epsilon=common["layer_norm_eps"], rotary_emb_base=float(field(f"{arch}.rope.freq_base")),
            max_trained_positions=common["max_position_embeddings"], type_vocab_size=common["type_vocab_size"],
            qkv_proj_bias="blk.0.attn_qkv.bias" in names, mlp_fc1_bias="blk.0.ffn_up.bias" in names,
            mlp_fc2_bias="blk.0.ffn_down.bias" in names, moe_every_n_layers=field(f"{arch}.moe_every_n_layers"),
            num_experts=field(f"{arch}.expert_count"), moe_top_k=field(f"{arch}.expert_used_count"))
    if arch == "jina-bert-v2":  # (ALiBi, GeGLU: llama.cpp's reading of a file with both halves in `ffn_up`)
        return transformers.BertConfig(**common, hidden_act="gelu", position_embedding_type="alibi",
                                       feed_forward_type="geglu")
    return transformers.BertConfig(**common, hidden_act="gelu")


def tokenizer(metadata: Mapping[str, Any]) -> transformers.PreTrainedTokenizerBase:
    """The file's tokenizer: BERT's WordPiece from its phantom-space vocabulary (the module docstring), or
    XLM-RoBERTa's sentencepiece unigram (`tokenizer.ggml.model` "t5": bge-m3, multilingual-e5,
    nomic-embed-text-v2-moe)."""
    if metadata.get("tokenizer.ggml.model") == "t5":
        return xlm_roberta_tokenizer(metadata)
    tokens, types = metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.token_type"]
    vocab = [t if kind != TokenType.NORMAL else t[1:] if t.startswith("\u2581") else f"##{t}"
             for t, kind in zip(tokens, types)]

    def token(key: str, default: str) -> str:
        index = metadata.get(f"tokenizer.ggml.{key}_token_id")
        return vocab[index] if index is not None else default

    return transformers.BertTokenizerFast(
        vocab={t: i for i, t in enumerate(vocab)},
        do_lower_case=bool(metadata.get("tokenizer.ggml.normalizer.lowercase", True)),
        unk_token=token("unknown", "[UNK]"), sep_token=token("seperator", "[SEP]"), pad_token=token("padding", "[PAD]"),
        cls_token=token("cls", token("bos", "[CLS]")), mask_token=token("mask", "[MASK]"))


def xlm_roberta_tokenizer(metadata: Mapping[str, Any]) -> transformers.PreTrainedTokenizerBase:
    """XLM-RoBERTa's tokenizer from the file's pieces and scores in the original ids (`<s>` 0, `<pad>` 1, `</s>` 2,
    `<unk>` 3, as llama.cpp's converter writes them), its normalization table where the file has one, and its
    `<s> A </s>` (`<s> A </s></s> B </s>`) template."""
    tokens = metadata["tokenizer.ggml.tokens"]
    if tokens[:4] != ["<s>", "<pad>", "</s>", "<unk>"]:
        raise ValueError(f"a sentencepiece vocabulary starting {tokens[:4]} is not XLM-RoBERTa's "
                         "(<s> <pad> </s> <unk>)")
    charsmap = metadata.get("tokenizer.ggml.precompiled_charsmap")
    mask = metadata.get("tokenizer.ggml.mask_token_id")
    return transformers.XLMRobertaTokenizer(
        vocab=list(zip(tokens, map(float, metadata["tokenizer.ggml.scores"]))),
        add_prefix_space=bool(metadata.get("tokenizer.ggml.add_space_prefix", True)),
        _spm_precompiled_charsmap=bytes(charsmap) if charsmap else None,
        mask_token=tokens[mask] if mask is not None else "<mask>")
