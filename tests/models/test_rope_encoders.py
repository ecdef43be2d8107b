"""NomicBERT and GTE (`models.rope_bert`) beyond what the shared encoder tests check: the original configs these
checkpoints are published with (NomicBERT's GPT-2 style fields, GTE's `new` config that transformers reads only
through remote code), their RoPE scalings, GTE's reranker form, nomic-embed-text-v2-moe's experts, and llama.cpp's
nomic-bert and nomic-bert-moe GGUF files."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
import transformers

from conveyor import LLM
from conveyor.errors import InvalidRequestError

from tests.encoder_models import (assert_scores_as_transformers, bert_tokenizer, encoded, encoder_config,
                                  save_encoder, texts, write_bert_gguf, write_encoder_gguf)
from tests.utils import all_free


def nomic_original_config(config: transformers.PretrainedConfig, **extra: object) -> dict:
    """`config` written as nomic-embed-text-v1.5's config.json is: GPT-2's field names, which transformers'
    NomicBertConfig does not read (it would take its 768-wide defaults)."""
    return {"model_type": "nomic_bert", "architectures": ["NomicBertModel"], "vocab_size": config.vocab_size,
            "n_embd": config.hidden_size, "n_layer": config.num_hidden_layers, "n_head": config.num_attention_heads,
            "n_inner": config.intermediate_size, "activation_function": "swiglu", "layer_norm_epsilon":
            config.layer_norm_eps, "rotary_emb_base": config.rope_parameters["rope_theta"], "rotary_emb_fraction": 1.0,
            "rotary_emb_interleaved": False, "rotary_emb_scale_base": None, "qkv_proj_bias": False,
            "mlp_fc1_bias": False, "mlp_fc2_bias": False, "prenorm": False, "causal": False, "type_vocab_size": 2,
            "max_trained_positions": config.max_position_embeddings, "n_positions": 8192, "pad_token_id": 0, **extra}


def mean_embeddings(llm: LLM, batch: list[str]) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in llm.embed(batch, use_tqdm=False)])


@torch.inference_mode()
def reference_means(model: transformers.PreTrainedModel, tokenizer: transformers.PreTrainedTokenizerBase,
                    batch: list[str]) -> torch.Tensor:
    return torch.stack([F.normalize(model(**encoded(tokenizer, model.config, t)).last_hidden_state[0].mean(0), dim=0)
                        for t in batch])


def assert_embeds_as(path: Path, reference: transformers.PreTrainedModel,
                     tokenizer: transformers.PreTrainedTokenizerBase, seed: int) -> None:
    """The checkpoint's fp32 mean-pooled embeddings of six texts = the reference's; every block returned."""
    llm = LLM(path, dtype="float32", pooler_config={"pooling_type": "MEAN"})
    batch = texts(6, seed=seed)
    torch.testing.assert_close(mean_embeddings(llm, batch), reference_means(reference, tokenizer, batch),
                               atol=2e-5, rtol=1e-4)
    assert all_free(llm)


def test_nomic_original_config_is_read(tmp_path: Path, one_thread: None) -> None:
    """The config as nomic publishes it gives transformers' embeddings of the same weights, and its context is the
    trained length (`max_trained_positions`, not `n_positions`): a longer prompt is an error naming it."""
    config = encoder_config("nomic_bert", max_position_embeddings=64)
    reference = save_encoder(tmp_path, config)
    tokenizer = bert_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(nomic_original_config(config)))
    assert transformers.AutoConfig.from_pretrained(tmp_path).hidden_size == 768  # (what transformers would build)
    llm = LLM(tmp_path, dtype="float32", pooler_config={"pooling_type": "MEAN"})
    assert llm.max_model_len == 64
    batch = texts(6, seed=11)
    torch.testing.assert_close(mean_embeddings(llm, batch), reference_means(reference, tokenizer, batch),
                               atol=2e-5, rtol=1e-4)
    with pytest.raises(InvalidRequestError, match="64"):
        llm.embed(" ".join(["w1"] * 70), use_tqdm=False)
    assert all_free(llm)


def test_nomic_rotary_scaling_factor_extends_the_context(tmp_path: Path, one_thread: None) -> None:
    """`rotary_scaling_factor`: dynamic NTK past the trained length, each prompt rotated with its own length (as
    transformers' dynamic RoPE rotates one text alone), up to `n_positions`; prompts past the trained 16 tokens."""
    config = encoder_config("nomic_bert", max_position_embeddings=16,
                            rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1000.0})
    save_encoder(tmp_path, config)
    tokenizer = bert_tokenizer(tmp_path)
    batch = texts(6, seed=12)
    assert max(len(tokenizer(t)["input_ids"]) for t in batch) > 32
    expected = []
    for text in batch:  # (a fresh model each: transformers keeps the frequencies of the longest text it saw)
        reference = transformers.NomicBertModel.from_pretrained(tmp_path).eval()
        expected.append(reference_means(reference, tokenizer, [text])[0])
    original = nomic_original_config(config, rotary_scaling_factor=2.0, max_trained_positions=16, n_positions=128)
    (tmp_path / "config.json").write_text(json.dumps(original))
    llm = LLM(tmp_path, dtype="float32", pooler_config={"pooling_type": "MEAN"})
    assert llm.max_model_len == 128
    torch.testing.assert_close(mean_embeddings(llm, batch), torch.stack(expected), atol=2e-5, rtol=1e-4)
    assert all_free(llm)


def test_gte_original_config_and_its_ntk_scaling(tmp_path: Path, one_thread: None) -> None:
    """GTE's original `new` config (transformers reads it only through remote code) with `rope_scaling` of type
    "ntk": the original's frequencies, `1 / (base * f) ** (2i / d) / f ** (2 / d)` for every position, put into
    transformers' GteModel as the reference."""
    config = encoder_config("gte", rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    reference = save_encoder(tmp_path, config)
    tokenizer = bert_tokenizer(tmp_path)
    original = {"model_type": "new", "architectures": ["NewModel"], "vocab_size": config.vocab_size,
                "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
                "hidden_act": "gelu", "layer_norm_eps": config.layer_norm_eps, "max_position_embeddings": 128,
                "position_embedding_type": "rope", "rope_theta": 500.0, "rope_scaling": {"type": "ntk", "factor": 2.0},
                "type_vocab_size": 1, "layer_norm_type": "layer_norm", "logn_attention_scale": False,
                "pack_qkv": True, "pad_token_id": 0}
    (tmp_path / "config.json").write_text(json.dumps(original))
    with pytest.raises(ValueError):  # (what loading it without remote code gives in transformers)
        transformers.AutoConfig.from_pretrained(tmp_path)
    d, f = 16, 2.0
    inv_freq = 1.0 / (500.0 * f) ** (torch.arange(0, d, 2).float() / d) / f ** (2 / d)
    reference.rotary_emb.inv_freq.copy_(inv_freq)
    reference.rotary_emb.original_inv_freq.copy_(inv_freq)
    llm = LLM(tmp_path, dtype="float32", pooler_config={"pooling_type": "MEAN"})
    batch = texts(6, seed=13)
    torch.testing.assert_close(mean_embeddings(llm, batch), reference_means(reference, tokenizer, batch),
                               atol=2e-5, rtol=1e-4)
    assert all_free(llm)


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0])
def test_a_nomic_bert_gguf_file_embeds_as_its_directory(qtype: gguf.GGMLQuantizationType, tmp_path: Path,
                                                        one_thread: None) -> None:
    """llama.cpp's nomic-bert GGUF (fused QKV, `ffn_up` / `ffn_gate`, RoPE base, mean pooling in its metadata):
    F32 equal to the directory, Q8_0 blocks kept as stored within their rounding."""
    directory = tmp_path / "dir"
    config = encoder_config("nomic_bert")
    model = save_encoder(directory, config)
    tokenizer = bert_tokenizer(directory)
    file = tmp_path / "nomic.gguf"
    write_bert_gguf(file, model, tokenizer, qtype, directory=directory)
    batch = texts(6, seed=14)
    expected = LLM(directory, dtype="float32", pooler_config={"pooling_type": "MEAN"})
    llm = LLM(file, dtype="float32")
    assert llm.engine.pooler.pooling_type == "MEAN"
    got, want = mean_embeddings(llm, batch), mean_embeddings(expected, batch)
    if qtype == gguf.GGMLQuantizationType.F32:
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    else:
        assert float(F.cosine_similarity(got, want).min()) >= 0.999
    assert all_free(llm)


def test_gte_remote_code_config_under_model_type_gte(tmp_path: Path, one_thread: None) -> None:
    """Snowflake's arctic-embed-m-v2.0 form: the original GTE fields and `auto_map`, but `model_type` "gte" (which
    transformers reads natively): the same embeddings as transformers' GteModel."""
    config = encoder_config("gte")
    reference = save_encoder(tmp_path, config)
    tokenizer = bert_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gte", "architectures": ["GteModel"],
        "auto_map": {"AutoConfig": "Alibaba-NLP/new-impl--configuration.NewConfig"}, "vocab_size": config.vocab_size,
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
        "hidden_act": "gelu", "layer_norm_eps": config.layer_norm_eps, "layer_norm_type": "layer_norm",
        "logn_attention_scale": False, "max_position_embeddings": 128, "pack_qkv": True,
        "position_embedding_type": "rope", "rope_scaling": None, "rope_theta": config.rope_parameters["rope_theta"],
        "type_vocab_size": 1, "unpad_inputs": True, "use_memory_efficient_attention": True, "pad_token_id": 0}))
    assert_embeds_as(tmp_path, reference, tokenizer, seed=19)


def test_gte_original_reranker_scores_as_transformers(tmp_path: Path, one_thread: None) -> None:
    """gte-multilingual-reranker-base's form: a `new` config, `NewForSequenceClassification`, the encoder's tensors
    under `new.` and BERT's pooler and classifier: each pair's score = the sigmoid of transformers' logit."""
    config = encoder_config("gte", num_labels=1)
    reference = save_encoder(tmp_path, config, head="ForSequenceClassification")
    tokenizer = bert_tokenizer(tmp_path)
    tensors = safetensors.torch.load_file(tmp_path / "model.safetensors")
    safetensors.torch.save_file({("new." + n.removeprefix("gte.")) if n.startswith("gte.") else n: t
                                 for n, t in tensors.items()}, tmp_path / "model.safetensors")
    original = {"model_type": "new", "architectures": ["NewForSequenceClassification"], "vocab_size": config.vocab_size,
                "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
                "hidden_act": "gelu", "layer_norm_eps": config.layer_norm_eps, "max_position_embeddings": 128,
                "position_embedding_type": "rope", "rope_theta": config.rope_parameters["rope_theta"],
                "type_vocab_size": 1, "pad_token_id": 0, "id2label": {"0": "LABEL_0"}}
    (tmp_path / "config.json").write_text(json.dumps(original))
    llm = LLM(tmp_path, dtype="float32")
    assert llm.pooling_task == "classify"
    assert_scores_as_transformers(llm, reference, tokenizer, seed=15)


class ReferenceMLP(torch.nn.Module):
    """nomic-embed-text-v2-moe's plain layers' MLP, `fc2(gelu(fc1(x)))` with biases."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(hidden, inner), torch.nn.Linear(inner, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class ReferenceExperts(torch.nn.Module):
    """Its experts' layer as nomic's code computes it: the router's fp32 softmax, the top k kept unrenormalized,
    each expert `gelu(x @ w1[e].T) @ w2[e]` over its tokens added in, then the bias."""

    def __init__(self, hidden: int, inner: int, experts: int, top_k: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        self.w1 = torch.nn.Parameter(torch.randn(experts * inner, hidden, generator=g) * 0.1)
        self.w2 = torch.nn.Parameter(torch.randn(experts * inner, hidden, generator=g) * 0.1)
        self.bias = torch.nn.Parameter(torch.randn(hidden, generator=g) * 0.1)
        self.experts, self.inner, self.top_k = experts, inner, top_k
        with torch.no_grad():
            self.router.weight.normal_(0.0, 0.5, generator=g)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        top, chosen = self.router(flat).softmax(-1, dtype=torch.float32).topk(self.top_k, dim=-1)
        out = torch.zeros_like(flat)
        for e in range(self.experts):
            slot, token = torch.where(F.one_hot(chosen, self.experts).permute(2, 1, 0)[e])
            w1 = self.w1.view(self.experts, self.inner, -1)[e]
            w2 = self.w2.view(self.experts, self.inner, -1)[e]
            out.index_add_(0, token, (F.gelu(flat[token] @ w1.t()) @ w2) * top[token, slot, None])
        return (out + self.bias).reshape(x.shape)


def save_nomic_moe(path: Path, expert_bias: bool = True) -> tuple[transformers.PreTrainedModel,
                                                                      transformers.PreTrainedTokenizerBase]:
    """nomic-embed-text-v2-moe's form (biases everywhere, plain GELU MLPs, every second layer four experts of which
    each token takes two) saved under nomic's names and config; its reference: transformers' GteModel (the same
    attention, embeddings and post-norm layers) with the MLPs replaced by nomic's (`ReferenceMLP`,
    `ReferenceExperts`). `expert_bias` False: the experts' shared bias zero, as llama.cpp runs them."""
    config = encoder_config("gte", num_hidden_layers=4)
    reference = save_encoder(path, config)
    tokenizer = bert_tokenizer(path)
    torch.manual_seed(3)
    for i, layer in enumerate(reference.layers):
        layer.mlp = ReferenceExperts(64, 128, 4, 2) if i % 2 == 1 else ReferenceMLP(64, 128)
        if i % 2 == 1 and not expert_bias:
            torch.nn.init.zeros_(layer.mlp.bias)
    embeddings = reference.embeddings
    tensors = {"embeddings.word_embeddings.weight": embeddings.word_embeddings.weight,
               "embeddings.token_type_embeddings.weight": embeddings.token_type_embeddings.weight,
               "emb_ln.weight": embeddings.LayerNorm.weight, "emb_ln.bias": embeddings.LayerNorm.bias}
    for i, layer in enumerate(reference.layers):
        src, attn = f"encoder.layers.{i}.", layer.self_attn
        for kind in ("weight", "bias"):
            tensors[f"{src}attn.Wqkv.{kind}"] = torch.cat([getattr(getattr(attn, f"{p}_proj"), kind) for p in "qkv"])
            tensors[f"{src}attn.out_proj.{kind}"] = getattr(attn.o_proj, kind)
            tensors[f"{src}norm1.{kind}"] = getattr(layer.post_attention_layernorm, kind)
            tensors[f"{src}norm2.{kind}"] = getattr(layer.post_mlp_layernorm, kind)
        tensors.update({f"{src}mlp.{name}": t for name, t in layer.mlp.state_dict().items()})
    renamed = {n.replace("mlp.router.weight", "mlp.router.layer.weight").replace("mlp.w1", "mlp.experts.mlp.w1")
               .replace("mlp.w2", "mlp.experts.mlp.w2").replace("mlp.bias", "mlp.experts.bias"): t.detach().contiguous()
               for n, t in tensors.items()}
    safetensors.torch.save_file(renamed, path / "model.safetensors")
    original = {"model_type": "nomic_bert", "architectures": ["NomicBertModel"], "vocab_size": config.vocab_size,
                "n_embd": 64, "n_layer": 4, "n_head": 4, "n_inner": 128, "activation_function": "gelu",
                "layer_norm_epsilon": config.layer_norm_eps, "rotary_emb_base": config.rope_parameters["rope_theta"],
                "rotary_emb_fraction": 1.0, "qkv_proj_bias": True, "mlp_fc1_bias": True, "mlp_fc2_bias": True,
                "type_vocab_size": 1, "max_trained_positions": 128, "n_positions": 128, "moe_every_n_layers": 2,
                "num_experts": 4, "moe_top_k": 2, "pad_token_id": 0}
    (path / "config.json").write_text(json.dumps(original))
    return reference, tokenizer


def test_nomic_moe_embeds_as_its_reference(tmp_path: Path, one_thread: None) -> None:
    """nomic-embed-text-v2-moe (`save_nomic_moe`): its embeddings = the reference's."""
    reference, tokenizer = save_nomic_moe(tmp_path)
    assert_embeds_as(tmp_path, reference, tokenizer, seed=17)


def test_a_nomic_moe_gguf_file_embeds_as_llama_cpp_runs_it(tmp_path: Path, one_thread: None) -> None:
    """llama.cpp's nomic-bert-moe GGUF (the experts stacked, W2 transposed, their shared bias dropped by the
    converter): the embeddings of the reference with that bias zero, F32 tensors."""
    reference, tokenizer = save_nomic_moe(tmp_path / "dir", expert_bias=False)
    tensors = safetensors.torch.load_file(tmp_path / "dir" / "model.safetensors")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.NOMIC_BERT_MOE, 4)
    stacked = {}  # (the experts as the converter stacks them: W1 `[experts, intermediate, hidden]`, W2 transposed)
    for name, t in tensors.items():
        if name.endswith(("mlp.w1", "mlp.w2")):
            t = t.view(4, 128, 64)
            t, name = (t.transpose(1, 2) if name.endswith("w2") else t), name + ".weight"
        if not name.endswith("experts.bias"):
            stacked[names.get_name(name, try_suffixes=(".weight", ".bias"))] = t
    write_encoder_gguf(tmp_path / "moe.gguf", "nomic-bert-moe",
                       {"block_count": 4, "context_length": 128, "embedding_length": 64, "feed_forward_length": 128,
                        "head_count": 4, "layer_norm_eps": 1e-12,
                        "rope_freq_base": reference.config.rope_parameters["rope_theta"], "token_type_count": 1,
                        "moe_every_n_layers": 2, "expert_count": 4, "expert_used_count": 2}, tokenizer, stacked)
    llm = LLM(tmp_path / "moe.gguf", dtype="float32")
    assert llm.engine.pooler.pooling_type == "MEAN"
    batch = texts(6, seed=18)
    torch.testing.assert_close(mean_embeddings(llm, batch), reference_means(reference, tokenizer, batch),
                               atol=2e-5, rtol=1e-4)
    assert all_free(llm)
