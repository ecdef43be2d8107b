"""Encoder-only checkpoints (BERT, RoBERTa, XLM-RoBERTa, DistilBERT, ModernBERT, MPNet, NomicBERT, GTE, bidirectional
Gemma 3) as pooling models: embeddings equal to transformers' encoder pooled as the checkpoint's
sentence-transformers files say, cross-encoders' scores equal to its `*ForSequenceClassification` (a pair's token
types included), prompts computed whole and alone (a prompt's embedding does not depend on its neighbours in the
pass), and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
import transformers

from conveyor import LLM, PoolingParams
from conveyor.config import ConfigError
from conveyor.errors import InvalidRequestError
from conveyor.models.encoder import bidirectional_attention

from tests.encoder_models import (SPECIAL, WORDS, assert_scores_as_transformers, bert_tokenizer, encoded,
                                  encoder_config, save_encoder, texts, write_bert_gguf, write_encoder_gguf,
                                  write_mean_normalized, xlm_roberta_tokenizer)
from tests.utils import all_free


@torch.inference_mode()
def reference_states(model: transformers.PreTrainedModel, tokenizer: transformers.PreTrainedTokenizerBase,
                     text: str) -> torch.Tensor:
    return model(**encoded(tokenizer, model.config, text)).last_hidden_state[0]


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta", "distilbert", "modernbert", "mpnet", "nomic_bert", "gte"])
def test_embeddings_equal_transformers_pooled(kind: str, tmp_path: Path, one_thread: None) -> None:
    """fp32: CLS (the encoders' default) and mean pooling, normalized, against transformers' encoder; each
    text's embedding the same alone as among seven others of other lengths (ModernBERT: texts longer than
    its sliding layers' window too)."""
    reference = save_encoder(tmp_path, encoder_config(kind))
    tokenizer = bert_tokenizer(tmp_path)
    batch = texts(8, seed=1)
    for pooling in ("CLS", "MEAN"):
        llm = LLM(tmp_path, dtype="float32", pooler_config={"pooling_type": pooling})
        assert llm.pooling_task == "embed" and llm.engine.pooler.pooling_type == pooling
        outs = llm.embed(batch, use_tqdm=False)
        for text, out in zip(batch, outs):
            states = reference_states(reference, tokenizer, text)
            ref = F.normalize(states[0] if pooling == "CLS" else states.mean(0), dim=0)
            torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, atol=2e-5, rtol=1e-4)
        alone = llm.embed(batch[3], use_tqdm=False)[0].outputs.embedding
        torch.testing.assert_close(torch.tensor(alone), torch.tensor(outs[3].outputs.embedding), atol=1e-6, rtol=0)
        assert all_free(llm)


def test_bf16_embeddings_are_close(tmp_path: Path, one_thread: None) -> None:
    """The default mode (bf16 where the CPU has it) against the fp32 reference: cosine >= 0.99."""
    reference = save_encoder(tmp_path, encoder_config("bert"))
    tokenizer = bert_tokenizer(tmp_path)
    llm = LLM(tmp_path, runner="pooling")
    for text, out in zip(texts(6, seed=2), llm.embed(texts(6, seed=2), use_tqdm=False)):
        ref = reference_states(reference, tokenizer, text)[0]
        assert float(F.cosine_similarity(torch.tensor(out.outputs.embedding), ref, dim=0)) >= 0.99


@pytest.mark.parametrize(("kind", "pooling"), [("bert", "CLS"), ("xlm-roberta", "CLS"), ("distilbert", "CLS"),
                                               ("modernbert", "CLS"), ("modernbert", "MEAN"), ("mpnet", "CLS"),
                                               ("nomic_bert", "CLS"), ("gte", "CLS")])
def test_cross_encoder_scores_equal_transformers(kind: str, pooling: str, tmp_path: Path, one_thread: None) -> None:
    """A `*ForSequenceClassification` cross-encoder (one label): each pair's score is the sigmoid of
    transformers' logit for the tokenizer's pair encoding (BERT: the second text's token type 1; ModernBERT:
    its head over the first token or, `classifier_pooling` "mean", the mean)."""
    extra = {"classifier_pooling": pooling.lower()} if kind == "modernbert" else {}
    config = encoder_config(kind, num_labels=1, **extra)
    reference = save_encoder(tmp_path, config, head="ForSequenceClassification")
    tokenizer = bert_tokenizer(tmp_path)
    llm = LLM(tmp_path, dtype="float32")
    assert llm.pooling_task == "classify" and llm.engine.pooler.pooling_type == pooling
    assert_scores_as_transformers(llm, reference, tokenizer, seed=3)


def test_a_bert_pair_reads_its_token_types(tmp_path: Path, one_thread: None) -> None:
    """The token-type embedding of the second text matters: a pair's score differs from the same tokens read
    as one segment (a model without the types would give the one-segment score)."""
    reference = save_encoder(tmp_path, encoder_config("bert", num_labels=1), head="ForSequenceClassification")
    tokenizer = bert_tokenizer(tmp_path)
    llm = LLM(tmp_path, dtype="float32")
    query, document = texts(2, seed=5)
    [score] = [s.outputs.score for s in llm.score(query, document, use_tqdm=False)]
    inputs = tokenizer(query, text_pair=document, return_tensors="pt")
    with torch.inference_mode():
        one_segment = reference(input_ids=inputs["input_ids"]).logits[0, 0].sigmoid()
        paired = reference(**inputs).logits[0, 0].sigmoid()
    assert abs(float(paired - one_segment)) > 5e-4  # (250 times the tolerance below)
    assert score == pytest.approx(float(paired), abs=2e-6)


def test_prompts_go_whole_into_passes_and_the_limits_are_named(tmp_path: Path, one_thread: None) -> None:
    """With passes of 64 tokens, prompts of up to 64 tokens are never chunked (their embeddings equal the
    reference); a longer one is refused naming the pass size, one over the context naming max_model_len;
    truncation keeps [CLS] ... [SEP]; the pool's blocks all return."""
    reference = save_encoder(tmp_path, encoder_config("bert"))
    tokenizer = bert_tokenizer(tmp_path)
    llm = LLM(tmp_path, dtype="float32", max_num_batched_tokens=64)
    assert not llm.engine.block_sharing  # (an encoder's blocks hold no K/V to share)
    batch = [t for t in texts(12, seed=6) if len(tokenizer(t)["input_ids"]) <= 64]
    assert len(batch) >= 6
    for text, out in zip(batch, llm.embed(batch, use_tqdm=False)):
        ref = F.normalize(reference_states(reference, tokenizer, text)[0], dim=0)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, atol=2e-5, rtol=1e-4)
    long_text = " ".join(WORDS[:70])
    with pytest.raises(InvalidRequestError, match="exceeds the 64 tokens an encoder model computes in one pass"):
        llm.embed(long_text, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="context length of 128 tokens"):
        llm.embed(list(range(5, 135)), use_tqdm=False)
    [cut] = llm.embed(long_text, PoolingParams(truncate_prompt_tokens=40), use_tqdm=False)
    ref = reference_states(reference, tokenizer, " ".join(WORDS[:38]))[0]  # [CLS] + 38 words + [SEP]
    torch.testing.assert_close(torch.tensor(cut.outputs.embedding), F.normalize(ref, dim=0), atol=2e-5, rtol=1e-4)
    assert all_free(llm)


def test_an_encoder_does_not_generate(tmp_path: Path, one_thread: None) -> None:
    save_encoder(tmp_path, encoder_config("bert"))
    with pytest.raises(ConfigError, match="encoder-only model: it embeds or classifies"):
        LLM(tmp_path, dtype="float32", runner="generate")
    with pytest.raises(ConfigError, match="without batch_invariant"):
        LLM(tmp_path, dtype="bfloat16", batch_invariant=True)
    llm = LLM(tmp_path, dtype="float32")
    with pytest.raises(InvalidRequestError, match="pooling model"):
        llm.generate("w1 w2", use_tqdm=False)
    assert len(llm.embed([[2, 9, 10, 3]], use_tqdm=False)[0].outputs.embedding) == 64  # token ids: [CLS] .. [SEP]


def test_sentence_transformers_files_set_pooling_and_context(tmp_path: Path, one_thread: None) -> None:
    """all-MiniLM's files: mean pooling, normalized (modules.json), a context of `max_seq_length` (vLLM's rule);
    a one-token prompt (a decode row in the pass) pools that token's state."""
    reference = save_encoder(tmp_path, encoder_config("bert"))
    tokenizer = bert_tokenizer(tmp_path)
    write_mean_normalized(tmp_path)
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 48}))
    llm = LLM(tmp_path, dtype="float32")
    assert (llm.engine.pooler.pooling_type, llm.engine.pooler.normalize, llm.max_model_len) == ("MEAN", True, 48)
    with pytest.raises(InvalidRequestError, match="context length of 48 tokens"):
        llm.embed(" ".join(WORDS[:50]), use_tqdm=False)
    batch = [[2], *(tokenizer(t)["input_ids"][:48] for t in texts(4, seed=7))]
    with torch.inference_mode():
        refs = [F.normalize(reference(torch.tensor([ids])).last_hidden_state[0].mean(0), dim=0) for ids in batch]
    for ref, out in zip(refs, llm.embed(batch, use_tqdm=False)):
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, atol=2e-5, rtol=1e-4)
    assert LLM(tmp_path, dtype="float32", max_model_len=100).max_model_len == 100  # the user's wins


def test_a_bert_gguf_file_embeds_as_its_directory(tmp_path: Path, one_thread: None) -> None:
    """llama.cpp's BERT GGUF form: its WordPiece tokenizer rebuilt from the phantom-space vocabulary (the same
    ids as the directory's), its pooling type, F32 tensors = the directory's embeddings (fp32), Q8_0 ones kept
    as stored in the default mode, close to them."""
    reference = save_encoder(tmp_path / "dir", encoder_config("bert"))
    tokenizer = bert_tokenizer(tmp_path / "dir")
    directory = LLM(tmp_path / "dir", dtype="float32", pooler_config={"pooling_type": "MEAN"})
    batch = texts(5, seed=21)
    expected = [o.outputs.embedding for o in directory.embed(batch, use_tqdm=False)]
    write_bert_gguf(tmp_path / "f32.gguf", reference, tokenizer, gguf.GGMLQuantizationType.F32)
    exact = LLM(tmp_path / "f32.gguf", dtype="float32")
    assert (exact.engine.pooler.pooling_type, exact.engine.pooler.normalize) == ("MEAN", True)
    assert [exact.tokenizer(t)["input_ids"] for t in batch] == [tokenizer(t)["input_ids"] for t in batch]
    for ours, ref in zip(exact.embed(batch, use_tqdm=False), expected):
        torch.testing.assert_close(torch.tensor(ours.outputs.embedding), torch.tensor(ref), atol=2e-5, rtol=1e-4)
    write_bert_gguf(tmp_path / "q8.gguf", reference, tokenizer, gguf.GGMLQuantizationType.Q8_0)
    kept = LLM(tmp_path / "q8.gguf")
    assert kept.quantization == "gguf"
    for ours, ref in zip(kept.embed(batch, use_tqdm=False), expected):
        assert float(F.cosine_similarity(torch.tensor(ours.outputs.embedding), torch.tensor(ref), dim=0)) >= 0.999
    assert all_free(kept)


def test_an_xlm_roberta_gguf_file_embeds_as_its_directory(tmp_path: Path, one_thread: None) -> None:
    """XLM-RoBERTa's GGUF form (bge-m3's, multilingual-e5's): a "bert" file with the sentencepiece vocabulary
    ("t5": pieces and scores) and the position table from `pad_token_id + 1` on; the unigram tokenizer rebuilt
    with XLM-RoBERTa's template (the directory's ids, pairs included), the embeddings the directory's."""
    reference = save_encoder(tmp_path / "dir", encoder_config("xlm-roberta", vocab_size=217))
    tokenizer = xlm_roberta_tokenizer(tmp_path / "dir")
    directory = LLM(tmp_path / "dir", dtype="float32", pooler_config={"pooling_type": "MEAN"})
    batch = texts(5, seed=22) + ["w3 w17w9 x"]  # (the last split into pieces, one unknown)
    write_bert_gguf(tmp_path / "f32.gguf", reference, tokenizer, gguf.GGMLQuantizationType.F32)
    llm = LLM(tmp_path / "f32.gguf", dtype="float32")
    assert [llm.tokenizer(t)["input_ids"] for t in batch] == [tokenizer(t)["input_ids"] for t in batch]
    assert llm.tokenizer(batch[0], batch[1])["input_ids"] == tokenizer(batch[0], batch[1])["input_ids"]
    assert llm.max_model_len == directory.max_model_len
    for ours, ref in zip(llm.embed(batch, use_tqdm=False), directory.embed(batch, use_tqdm=False)):
        torch.testing.assert_close(torch.tensor(ours.outputs.embedding), torch.tensor(ref.outputs.embedding),
                                   atol=2e-5, rtol=1e-4)
    assert all_free(llm)


def test_a_bert_cross_encoder_gguf_scores_as_llama_cpp(tmp_path: Path, one_thread: None) -> None:
    """llama.cpp's converter drops a BERT cross-encoder's pooler and keeps its classifier (`cls.output`): the score
    is the classifier over the first token's state alone, then its sigmoid."""
    reference = save_encoder(tmp_path, encoder_config("bert", num_labels=1), head="ForSequenceClassification")
    tokenizer = bert_tokenizer(tmp_path)
    write_bert_gguf(tmp_path / "rank.gguf", reference, tokenizer, gguf.GGMLQuantizationType.F32,
                    pooling=gguf.PoolingType.RANK)
    llm = LLM(tmp_path / "rank.gguf", dtype="float32", runner="pooling", convert="classify")
    query, document = texts(2, seed=22)
    [score] = [s.outputs.score for s in llm.score(query, document, use_tqdm=False)]
    with torch.inference_mode():
        state = reference.bert(**tokenizer(query, text_pair=document, return_tensors="pt")).last_hidden_state[0, 0]
        expected = reference.classifier(state).sigmoid()
    assert score == pytest.approx(float(expected), abs=2e-6)


def write_dense(path: Path, in_features: int, out_features: int, activation: str, seed: int) -> torch.nn.Linear:
    """A sentence-transformers Dense module's files (its config and `linear.*` tensors); the layer itself."""
    torch.manual_seed(seed)
    layer = torch.nn.Linear(in_features, out_features)
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"in_features": in_features, "out_features": out_features,
                                                  "bias": True, "activation_function": activation}))
    safetensors.torch.save_file({f"linear.{k}": v.contiguous() for k, v in layer.state_dict().items()},
                                path / "model.safetensors")
    return layer


def test_sentence_transformers_dense_modules_project_the_embedding(tmp_path: Path, one_thread: None) -> None:
    """A pipeline of CLS pooling, a Dense layer with tanh (LaBSE's), a second one without activation, Normalize:
    each embedding is the pooled state through the layers, then normalized, as sentence-transformers computes
    it; modules this engine does not run are errors naming them."""
    reference = save_encoder(tmp_path, encoder_config("bert"))
    tokenizer = bert_tokenizer(tmp_path)
    first = write_dense(tmp_path / "2_Dense", 64, 48, "torch.nn.modules.activation.Tanh", seed=1)
    second = write_dense(tmp_path / "3_Dense", 48, 32, "torch.nn.modules.linear.Identity", seed=2)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
               {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"},
               {"idx": 4, "name": "4", "path": "4_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    llm = LLM(tmp_path, dtype="float32")
    batch = texts(4, seed=23)
    for text, out in zip(batch, llm.embed(batch, use_tqdm=False)):
        with torch.inference_mode():
            ref = F.normalize(second(torch.tanh(first(reference_states(reference, tokenizer, text)[0]))), dim=0)
        assert len(out.outputs.embedding) == 32
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, atol=2e-5, rtol=1e-4)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ConfigError, match="pooling mode 'max_tokens' is not supported"):
        LLM(tmp_path, dtype="float32")
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    modules[2]["type"] = "sentence_transformers.models.LayerNorm"
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ConfigError, match="module 'sentence_transformers.models.LayerNorm' is not supported"):
        LLM(tmp_path, dtype="float32")


def test_a_bidirectional_gemma_embeds_as_transformers(tmp_path: Path, one_thread: None) -> None:
    """EmbeddingGemma's form: a Gemma 3 with `use_bidirectional_attention` (grouped K/V heads, q/k norms, RoPE per
    layer type, sliding layers attending less than the halved window either way), saved from the bare model, mean
    pooled and normalized by its sentence-transformers files: = transformers' Gemma3TextModel (fp32), for prompts
    longer than the window; alone = among others; it does not generate."""
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=len(SPECIAL) + len(WORDS), hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=8, max_position_embeddings=256,
        query_pre_attn_scalar=24, use_bidirectional_attention=True, pad_token_id=0, bos_token_id=2, eos_token_id=3,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"])
    config._attn_implementation = "eager"
    reference = transformers.Gemma3TextModel(config).eval()
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)  # (Gemma's norms scale by 1 + weight)
    reference.save_pretrained(tmp_path)
    tokenizer = bert_tokenizer(tmp_path)
    write_mean_normalized(tmp_path)
    llm = LLM(tmp_path, dtype="float32")
    assert llm.pooling_task == "embed" and llm.engine.pooler.pooling_type == "MEAN"
    batch = texts(6, seed=31)
    outs = llm.embed(batch, use_tqdm=False)
    for text, out in zip(batch, outs):
        with torch.inference_mode():
            states = reference(**encoded(tokenizer, reference.config, text)).last_hidden_state[0]
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), F.normalize(states.mean(0), dim=0),
                                   atol=2e-5, rtol=1e-4)
    alone = llm.embed(batch[2], use_tqdm=False)[0].outputs.embedding
    torch.testing.assert_close(torch.tensor(alone), torch.tensor(outs[2].outputs.embedding), atol=1e-6, rtol=0)
    assert all_free(llm)
    with pytest.raises(ConfigError, match="bidirectional Gemma .* cannot generate"):
        LLM(tmp_path, dtype="float32", runner="generate")


@pytest.mark.parametrize(("heads", "kv_heads", "window", "with_bias"),
                         [(12, 12, None, False), (4, 2, 5, False), (4, 1, None, False), (4, 4, None, True),
                          (4, 4, 5, True)])
def test_short_prompts_attend_in_one_padded_call_as_alone(heads: int, kv_heads: int, window: int | None,
                                                          with_bias: bool) -> None:
    """Prompts of 1-90 tokens: the padded call for the short ones (grouped K/V heads, a window, a score bias by
    position as MPNet's) = each prompt in a call of its own, as the long ones go; and the longest prompt alone =
    the softmax written out."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 91, (20,), generator=g).tolist()
    q, k, v = (torch.randn(sum(lengths), h, 32, generator=g) for h in (heads, kv_heads, kv_heads))
    bias = torch.randn(heads, 100, 100, generator=g) if with_bias else None
    alone = bidirectional_attention(q, k, v, lengths, window, 0.2, batched_up_to=0, bias=bias)
    for limit in (64, 1000):
        torch.testing.assert_close(bidirectional_attention(q, k, v, lengths, window, 0.2, batched_up_to=limit,
                                                           bias=bias), alone, atol=2e-6, rtol=1e-5)
    n, start = max(lengths), sum(lengths[:lengths.index(max(lengths))])
    part = [t[start:start + n].transpose(0, 1).repeat_interleave(heads // t.shape[1], 0) for t in (q, k, v)]
    scores = part[0] @ part[1].transpose(1, 2) * 0.2 + (bias[:, :n, :n] if with_bias else 0)
    if window is not None:
        index = torch.arange(n)
        scores = scores.masked_fill((index[:, None] - index[None, :]).abs() > window, float("-inf"))
    expected = (scores.softmax(-1) @ part[2]).transpose(0, 1).reshape(n, -1)
    torch.testing.assert_close(alone[start:start + n], expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", ["bert", "distilbert", "xlm-roberta", "modernbert", "mpnet", "gte"])
def test_token_classifiers_tag_as_transformers(kind: str, tmp_path: Path, one_thread: None) -> None:
    """A `*ForTokenClassification` encoder (an NER tagger) runs token_classify: every token's class probabilities =
    the softmax of transformers' per-token logits (its classifier alone; ModernBERT's head first)."""
    config = encoder_config(kind, num_labels=5)
    reference = save_encoder(tmp_path, config, head="ForTokenClassification")
    tokenizer = bert_tokenizer(tmp_path)
    llm = LLM(tmp_path, dtype="float32")
    assert llm.pooling_task == "token_classify" and llm.engine.pooler.pooling_type == "ALL"
    batch = texts(4, seed=41)
    for text, out in zip(batch, llm.encode(batch, use_tqdm=False)):
        with torch.inference_mode():
            expected = reference(**encoded(tokenizer, config, text)).logits[0].softmax(-1)
        assert out.outputs.data.shape == expected.shape
        torch.testing.assert_close(out.outputs.data, expected, atol=1e-5, rtol=0)
    assert all_free(llm)


def jina_reference(w: dict[str, torch.Tensor], ids: list[int], heads: int, slopes: list[float]) -> torch.Tensor:
    """Jina's BERT (jina-embeddings-v2) written out in fp64 for one text: BERT's embeddings without positions,
    each layer's scores biased by -slope * distance a head, a GeGLU MLP (gate: the first half), post-norm."""
    w = {n: t.double() for n, t in w.items()}

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], w[f"{name}.weight"], w[f"{name}.bias"], eps=1e-12)

    def linear(x: torch.Tensor, name: str) -> torch.Tensor:
        return x @ w[f"{name}.weight"].T + (w[f"{name}.bias"] if f"{name}.bias" in w else 0)

    x = norm(w["bert.embeddings.word_embeddings.weight"][ids] + w["bert.embeddings.token_type_embeddings.weight"][0],
             "bert.embeddings.LayerNorm")
    n, d = len(ids), x.shape[1] // heads
    distance = (torch.arange(n)[None, :] - torch.arange(n)[:, None]).abs().double()
    for i in range(2):
        p = f"bert.encoder.layer.{i}."
        q, k, v = (linear(x, f"{p}attention.self.{m}").view(n, heads, d).transpose(0, 1)
                   for m in ("query", "key", "value"))
        scores = q @ k.transpose(1, 2) / d ** 0.5 - torch.tensor(slopes).double()[:, None, None] * distance
        context = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, -1)
        x = norm(x + linear(context, f"{p}attention.output.dense"), f"{p}attention.output.LayerNorm")
        gated, plain = linear(x, f"{p}mlp.gated_layers").chunk(2, dim=-1)
        x = norm(x + linear(F.gelu(gated) * plain, f"{p}mlp.wo"), f"{p}mlp.layernorm")
    return x


def test_jina_v2_embeds_as_written_out(tmp_path: Path, one_thread: None) -> None:
    """jina-embeddings-v2's form (`bert` with ALiBi and a GeGLU MLP, its MaskedLM checkpoint's `bert.` names): fp32
    mean-pooled embeddings = the fp64 model written out in the test, for four heads (ALiBi's slopes 2^-2 ... 2^-8);
    the slopes for a head count off the powers of two as ALiBi's authors extend them; llama.cpp's GGUF of it
    embeds the same."""
    from conveyor.models.bert import BertModel, alibi_slopes
    assert BertModel.default_pooling(transformers.BertConfig(emb_pooler="mean")) == "MEAN"  # (without its ST files)
    assert alibi_slopes(4) == [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8]
    assert alibi_slopes(6) == [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3]
    g = torch.Generator().manual_seed(5)
    hidden, inner, vocab = 64, 96, len(SPECIAL) + len(WORDS)
    weights = {"bert.embeddings.word_embeddings.weight": torch.randn(vocab, hidden, generator=g),
               "bert.embeddings.token_type_embeddings.weight": torch.randn(2, hidden, generator=g) * 0.5}
    shapes = {"attention.self.query": (hidden, hidden, 0.15), "attention.self.key": (hidden, hidden, 0.15),
              "attention.self.value": (hidden, hidden, 0.15), "attention.output.dense": (hidden, hidden, 0.15),
              "mlp.gated_layers": (2 * inner, hidden, 0.1), "mlp.wo": (hidden, inner, 0.1)}
    norms = ["bert.embeddings.LayerNorm"]
    for i in range(2):
        p = f"bert.encoder.layer.{i}."
        for name, (rows, cols, std) in shapes.items():
            weights[f"{p}{name}.weight"] = torch.randn(rows, cols, generator=g) * std
            if name != "mlp.gated_layers":
                weights[f"{p}{name}.bias"] = torch.randn(rows, generator=g) * 0.1
        norms += [f"{p}attention.output.LayerNorm", f"{p}mlp.layernorm"]
    for name in norms:
        weights[f"{name}.weight"] = torch.rand(hidden, generator=g) + 0.5
        weights[f"{name}.bias"] = torch.randn(hidden, generator=g) * 0.1
    safetensors.torch.save_file(weights, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "bert", "architectures": ["JinaBertForMaskedLM"], "position_embedding_type": "alibi",
        "feed_forward_type": "geglu", "hidden_act": "gelu", "hidden_size": hidden, "intermediate_size": inner,
        "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": vocab, "type_vocab_size": 2,
        "max_position_embeddings": 8192, "layer_norm_eps": 1e-12, "pad_token_id": 0}))
    tokenizer = bert_tokenizer(tmp_path)
    write_mean_normalized(tmp_path)
    llm = LLM(tmp_path, dtype="float32")
    assert llm.pooling_task == "embed" and llm.max_model_len == 8192
    batch = texts(6, seed=23)
    for text, out in zip(batch, llm.embed(batch, use_tqdm=False)):
        states = jina_reference(weights, tokenizer(text)["input_ids"], 4, [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8])
        torch.testing.assert_close(torch.tensor(out.outputs.embedding).double(), F.normalize(states.mean(0), dim=0),
                                   atol=2e-5, rtol=1e-4)
    assert all_free(llm)
    # llama.cpp's jina-bert-v2 GGUF of it (both halves of the gated MLP in `ffn_up`, no position table): the same
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.JINA_BERT_V2, 2)
    write_encoder_gguf(tmp_path / "jina.gguf", "jina-bert-v2",
                       {"block_count": 2, "context_length": 8192, "embedding_length": hidden,
                        "feed_forward_length": inner, "head_count": 4, "layer_norm_eps": 1e-12, "token_type_count": 2},
                       tokenizer,
                       {names.get_name(n.removeprefix("bert."), try_suffixes=(".weight", ".bias")): t
                        for n, t in weights.items()})
    file = LLM(tmp_path / "jina.gguf", dtype="float32")
    assert file.engine.pooler.pooling_type == "MEAN"
    torch.testing.assert_close(torch.tensor([o.outputs.embedding for o in file.embed(batch, use_tqdm=False)]),
                               torch.tensor([o.outputs.embedding for o in llm.embed(batch, use_tqdm=False)]),
                               atol=2e-6, rtol=1e-5)
