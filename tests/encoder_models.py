"""Tiny random encoder checkpoints (BERT, XLM-RoBERTa, DistilBERT, ModernBERT, MPNet, NomicBERT, GTE) with a
WordPiece tokenizer, for the encoder tests."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import safetensors.torch
import torch
import transformers

from conveyor import LLM
from tests.gguf_writer import gguf_header
from tests.utils import all_free

WORDS = [f"w{i}" for i in range(200)]
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def bert_tokenizer(path: Path) -> transformers.PreTrainedTokenizerBase:
    """A WordPiece tokenizer whose words are "w0" ... "w199" (ids 5...): [CLS] text [SEP], pairs with types."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = transformers.BertTokenizerFast(vocab={t: i for i, t in enumerate(SPECIAL + WORDS)})
    assert tokenizer("w0 w199")["input_ids"] == [2, 5, 204, 3]
    tokenizer.save_pretrained(path)
    return tokenizer


def encoder_config(kind: str, **overrides: object) -> transformers.PretrainedConfig:
    common = dict(vocab_size=len(SPECIAL) + len(WORDS), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=128, max_position_embeddings=128, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0)
    if kind == "bert":
        config = transformers.BertConfig(**(common | overrides))
    elif kind == "distilbert":
        config = transformers.DistilBertConfig(**(dict(vocab_size=common["vocab_size"], dim=64, n_layers=2, n_heads=4,
                                                       hidden_dim=128, max_position_embeddings=128, dropout=0.0,
                                                       attention_dropout=0.0) | overrides))
    elif kind == "modernbert":  # four layers, the first and the last global; a window of 8 tokens either way
        config = transformers.ModernBertConfig(**(common | dict(num_hidden_layers=4, local_attention=16, pad_token_id=0,
                                                                cls_token_id=2, sep_token_id=3, bos_token_id=2,
                                                                eos_token_id=3) | overrides))
    elif kind == "mpnet":  # RoBERTa's positions (pad 1), relative position buckets of up to 128 tokens
        config = transformers.MPNetConfig(**(common | dict(pad_token_id=1, max_position_embeddings=130) | overrides))
    elif kind == "nomic_bert":  # no biases, SwiGLU, two token types
        config = transformers.NomicBertConfig(**(common | dict(pad_token_id=0) | overrides))
    elif kind == "gte":  # biases but the MLP's input projections, GeGLU, one token type
        config = transformers.GteConfig(**(common | dict(pad_token_id=0, type_vocab_size=1) | overrides))
    else:  # XLM-RoBERTa's shape: pad 1, positions from 2, one token type
        config = transformers.XLMRobertaConfig(**(common | dict(pad_token_id=1, type_vocab_size=1,
                                                                max_position_embeddings=130) | overrides))
    config._attn_implementation = "eager"
    return config


def save_encoder(path: Path, config: transformers.PretrainedConfig, head: str = "Model"
                 ) -> transformers.PreTrainedModel:
    """A random encoder (`head`: "Model", or "ForSequenceClassification") saved with its tokenizer; its norms'
    weights drawn away from one and its token types and head larger than the init's, so that one read wrongly
    shows."""
    torch.manual_seed(0)
    family = {"bert": "Bert", "modernbert": "ModernBert", "distilbert": "DistilBert", "nomic_bert": "NomicBert",
              "gte": "Gte", "mpnet": "MPNet"}.get(config.model_type, "XLMRoberta")
    model = getattr(transformers, f"{family}{head}")(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name or "norm" in name:
                p.uniform_(0.5, 1.5) if name.endswith("weight") else p.uniform_(-0.2, 0.2)
            elif "token_type_embeddings" in name or "classifier" in name or "relative_attention_bias" in name:
                # (their effect well above rounding)
                p.normal_(0.0, 0.5)
            elif config.model_type in ("nomic_bert", "gte") and "self_attn" in name and name.endswith("weight"):
                p.normal_(0.0, 0.15)  # (scores far from uniform and an attention output the size of its input)
            elif name.endswith("bias") and config.model_type in ("nomic_bert", "gte"):  # (zero at init)
                p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    bert_tokenizer(path)
    return model


def write_mean_normalized(path: Path) -> None:
    """sentence-transformers' files for mean pooling, then Normalize (all-MiniLM's and EmbeddingGemma's pipeline
    without its Dense layers)."""
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))


def encoded(tokenizer: transformers.PreTrainedTokenizerBase, config: transformers.PretrainedConfig, text: str,
            pair: str | None = None) -> dict[str, torch.Tensor]:
    """The tokenizer's inputs for the model: token types only for BERT and NomicBERT (the others take none)."""
    inputs = dict(tokenizer(text, text_pair=pair, return_tensors="pt"))
    if config.model_type in ("bert", "nomic_bert"):
        return inputs
    return {k: v for k, v in inputs.items() if k != "token_type_ids"}


def assert_scores_as_transformers(llm: LLM, reference: transformers.PreTrainedModel,
                                  tokenizer: transformers.PreTrainedTokenizerBase, seed: int) -> None:
    """A one-label cross-encoder: each (query, document) pair's score is the sigmoid of transformers' logit for
    the tokenizer's pair encoding; every block is back in the pool afterwards."""
    query, documents = texts(1, seed=seed)[0], texts(5, seed=seed + 1)
    scores = [s.outputs.score for s in llm.score(query, documents, use_tqdm=False)]
    with torch.inference_mode():
        logits = [reference(**encoded(tokenizer, reference.config, query, d)).logits[0, 0] for d in documents]
    torch.testing.assert_close(torch.tensor(scores), torch.stack(logits).sigmoid(), atol=2e-6, rtol=1e-5)
    assert all_free(llm)


def texts(n: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    return [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (int(length),), generator=g))
            for length in torch.randint(3, 60, (n,), generator=g)]


def write_bert_gguf(path: Path, model: transformers.PreTrainedModel, tokenizer: transformers.PreTrainedTokenizerBase,
                    qtype: gguf.GGMLQuantizationType, pooling: gguf.PoolingType = gguf.PoolingType.MEAN,
                    directory: Path | None = None) -> None:
    """A BERT encoder as llama.cpp's converter writes it: `bert.*` keys, the vocabulary in phantom-space form
    (a word-initial piece with a leading "▁", a continuation without its "##", control tokens as they are),
    gguf's tensor names for BERT (the pooler dropped; a classifier's `classifier` renamed `classifier.out_proj`),
    matrices in `qtype`, the rest F32. A NomicBERT (`nomic-bert.*`, its RoPE base) from the original names of its
    saved `directory`."""
    config = model.config
    arch = "nomic-bert" if config.model_type == "nomic_bert" else "bert"
    offset = config.pad_token_id + 1 if config.model_type == "xlm-roberta" else 0  # (the rows before it never used)
    w = gguf_header(path, arch, config)
    if offset:
        w.add_context_length(config.max_position_embeddings - offset)
    if arch == "nomic-bert":
        w.add_rope_freq_base(config.rope_parameters["rope_theta"])
    w.add_layer_norm_eps(config.layer_norm_eps)
    w.add_causal_attention(False)
    w.add_pooling_type(pooling)
    w.add_token_type_count(config.type_vocab_size)
    if offset:
        write_unigram_vocab(w, tokenizer)
    else:
        write_wordpiece_vocab(w, tokenizer)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.NOMIC_BERT if arch == "nomic-bert" else gguf.MODEL_ARCH.BERT,
                                     config.num_hidden_layers)
    tensors = safetensors.torch.load_file(directory / "model.safetensors") if directory else model.state_dict()
    for name, tensor in tensors.items():
        name = name.removeprefix("bert.")
        if name.startswith("pooler.") or name.endswith("position_ids"):
            continue
        name = name.replace("classifier.", "classifier.out_proj.") if name.startswith("classifier.") else name
        data = tensor.detach().float().numpy()
        if name == "embeddings.position_embeddings.weight":
            data = data[offset:]
        out = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if data.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32 and not name.startswith("embeddings.token_type"):
            w.add_tensor(out, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(out, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_encoder_gguf(path: Path, arch: str, keys: dict[str, object], tokenizer: transformers.PreTrainedTokenizerBase,
                       tensors: dict[str, torch.Tensor]) -> None:
    """An encoder GGUF as llama.cpp's converter writes one: `arch`'s metadata `keys` (by the writer's `add_*`
    names), mean pooling, the WordPiece vocabulary, `tensors` by their GGUF names, F32."""
    w = gguf.GGUFWriter(path, arch)
    for key, value in keys.items():
        getattr(w, f"add_{key}")(value)
    w.add_causal_attention(False)
    w.add_pooling_type(gguf.PoolingType.MEAN)
    write_wordpiece_vocab(w, tokenizer)
    for name, tensor in tensors.items():
        w.add_tensor(name, tensor.contiguous().float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_wordpiece_vocab(w: gguf.GGUFWriter, tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    special = set(tokenizer.all_special_tokens)
    w.add_tokenizer_model("bert")
    w.add_token_list([t if t in special else t[2:] if t.startswith("##") else "\u2581" + t for t, _ in vocab])
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t, _ in vocab])
    for key, token in (("unk", "[UNK]"), ("sep", "[SEP]"), ("pad", "[PAD]"), ("bos", "[CLS]"), ("eos", "[SEP]"),
                       ("mask", "[MASK]")):  # (the converter's [CLS] is its BOS)
        getattr(w, f"add_{key}_token_id")(tokenizer.convert_tokens_to_ids(token))


def write_unigram_vocab(w: gguf.GGUFWriter, tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    """XLM-RoBERTa's sentencepiece vocabulary as the converter writes it: "t5", the pieces and their scores."""
    pieces = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["vocab"]
    special = set(tokenizer.all_special_tokens)
    w.add_tokenizer_model("t5")
    w.add_token_list([p for p, _ in pieces])
    w.add_token_scores([float(score) for _, score in pieces])
    w.add_token_types([gguf.TokenType.UNKNOWN if p == "<unk>" else gguf.TokenType.CONTROL if p in special
                       else gguf.TokenType.NORMAL for p, _ in pieces])
    w.add_add_space_prefix(True)
    for key, token in (("unk", "<unk>"), ("sep", "</s>"), ("pad", "<pad>"), ("bos", "<s>"), ("eos", "</s>"),
                       ("mask", "<mask>")):
        getattr(w, f"add_{key}_token_id")(tokenizer.convert_tokens_to_ids(token))


def xlm_roberta_tokenizer(path: Path) -> transformers.PreTrainedTokenizerBase:
    """An XLM-RoBERTa unigram tokenizer over the same words ("▁w0" ... "▁w199" at ids 4..., `<mask>` last, a few
    pieces to split unknown words into), saved to `path`."""
    path.mkdir(parents=True, exist_ok=True)
    pieces = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [(f"\u2581{word}", -5.0 - i / 100) for i, word in enumerate(WORDS)]
    pieces += [(c, -12.0) for c in "\u2581w0123456789"] + [("<mask>", 0.0)]
    tokenizer = transformers.XLMRobertaTokenizer(vocab=pieces)
    assert tokenizer("w0 w199")["input_ids"] == [0, 4, 203, 2]
    tokenizer.save_pretrained(path)
    return tokenizer
