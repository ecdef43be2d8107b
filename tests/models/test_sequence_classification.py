"""Classifiers and rerankers as pooling models, against transformers (fp32): `*ForSequenceClassification`
checkpoints of the Llama family (the score head over the last token; a sigmoid for one label, a softmax
for several) through `LLM.score` and `LLM.classify`, and a decoder reranker that scores with two tokens'
logits (Qwen3-Reranker's way, set up with vLLM's `hf_overrides`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from conveyor import LLM, ContinuousBatchingConfig, PoolingParams
from conveyor.config import ConfigError

from tests.utils import TINY_CONFIGS, TinyModel, all_free, tiny_tokenizer

CONFIG = ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=32)
QUERY = "w5 w6 w7 "
DOCS = ["w8 w9", "w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20 w21 w22 w23 w24 w25 w26 w27 w28 w29 w30 w31 w32 w33 "
        "w34 w35 w36 w37 w38 w39 w40", "w41"]


def save_classifier(path: Path, kind: str, num_labels: int) -> transformers.PreTrainedModel:
    """A tiny random `*ForSequenceClassification` of TINY_CONFIGS[kind] (eager, fp32), saved with the tokenizer."""
    torch.manual_seed(1)
    config = TINY_CONFIGS[kind]()
    config.num_labels = num_labels
    config._attn_implementation = "eager"
    model = transformers.AutoModelForSequenceClassification.from_config(config).eval()
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return model


@torch.inference_mode()
def last_logits(model: transformers.PreTrainedModel, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()  # (the head's row of the last token)


def pair_ids(a: str, b: str) -> list[int]:
    return tiny_tokenizer()(a, text_pair=b)["input_ids"]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_sequence_classifiers_match_transformers(tmp_path: Path, kind: str, one_thread: None) -> None:
    """One label: the sigmoid of the head over the last token (prompts in chunks of 32 tokens); raw with
    use_activation=False. (Token ids: transformers gives the Qwen families' directories Qwen's own tokenizer
    class, which cannot read the test vocabulary's words.)"""
    reference = save_classifier(tmp_path, kind, num_labels=1)
    llm = LLM(tmp_path, dtype="float32", config=CONFIG)
    assert llm.pooling_task == "classify"
    prompts = [tiny_tokenizer().encode(QUERY + doc) for doc in DOCS]
    outs = llm.classify(prompts, use_tqdm=False)
    raw = llm.classify(prompts, PoolingParams(use_activation=False), use_tqdm=False)
    for ids, out, logit in zip(prompts, outs, raw):
        expected = last_logits(reference, ids)
        torch.testing.assert_close(torch.tensor(out.outputs.probs), expected.sigmoid(), atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(logit.outputs.probs), expected, atol=1e-4, rtol=1e-5)
    assert all_free(llm)


def test_score_takes_text_pairs(tmp_path: Path, one_thread: None) -> None:
    """`score`: the pair as one prompt through the tokenizer's pair template; one text against each of a
    list, or two lists pairwise."""
    reference = save_classifier(tmp_path, "llama", num_labels=1)
    llm = LLM(tmp_path, dtype="float32", config=CONFIG)
    for doc, out in zip(DOCS, llm.score(QUERY, DOCS, use_tqdm=False)):
        assert out.prompt_token_ids == pair_ids(QUERY, doc)
        assert out.outputs.score == pytest.approx(float(last_logits(reference, pair_ids(QUERY, doc)).sigmoid()),
                                                  abs=1e-5)
    pairwise = llm.score([QUERY, DOCS[0]], [DOCS[1], DOCS[2]], use_tqdm=False)
    assert [o.prompt_token_ids for o in pairwise] == [pair_ids(QUERY, DOCS[1]), pair_ids(DOCS[0], DOCS[2])]
    with pytest.raises(ValueError, match="text_1 must have 1 text or as many as text_2: got 2 and 3"):
        llm.score([QUERY, QUERY], DOCS, use_tqdm=False)
    assert all_free(llm)


def test_a_classifier_with_several_labels(tmp_path: Path, one_thread: None) -> None:
    """`classify`: the softmax over the labels; `score` needs one label and says so; `convert="embed"` embeds
    with the classifier's decoder."""
    reference = save_classifier(tmp_path, "qwen3", num_labels=3)
    llm = LLM(tmp_path, dtype="float32", config=CONFIG)
    prompts = [tiny_tokenizer().encode(t) for t in DOCS]
    for ids, out in zip(prompts, llm.classify(prompts, use_tqdm=False)):
        torch.testing.assert_close(torch.tensor(out.outputs.probs), last_logits(reference, ids).softmax(-1),
                                   atol=1e-5, rtol=0)
        assert out.outputs.num_classes == 3
    [encoded] = llm.encode(prompts[:1], use_tqdm=False)  # vLLM's generic call: the model's own task
    torch.testing.assert_close(encoded.outputs.data, last_logits(reference, prompts[0]).softmax(-1), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="scoring needs a classifier with one label .* this one has 3"):
        llm.score(QUERY, DOCS, use_tqdm=False)
    assert all_free(llm)
    embedder = LLM(tmp_path, dtype="float32", config=CONFIG, convert="embed")  # the decoder without its head
    with torch.inference_mode():
        hidden = reference.model(torch.tensor([prompts[1]])).last_hidden_state[0, -1]
    torch.testing.assert_close(torch.tensor(embedder.embed(prompts[1], use_tqdm=False)[0].outputs.embedding),
                               torch.nn.functional.normalize(hidden, dim=0), atol=1e-5, rtol=0)
    assert all_free(embedder)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_token_classifiers_match_transformers(tmp_path: Path, kind: str, one_thread: None) -> None:
    """A `*ForTokenClassification` checkpoint runs vLLM's token_classify: every token's class probabilities (the
    softmax of transformers' per-token logits), over chunks of 32 tokens, raw with use_activation=False; a
    sequence classifier's head runs per token with `pooler_config={"task": "token_classify"}`."""
    torch.manual_seed(2)
    config = TINY_CONFIGS[kind]()
    config.num_labels, config._attn_implementation = 3, "eager"
    reference = transformers.AutoModelForTokenClassification.from_config(config).eval()
    reference.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    llm = LLM(tmp_path, dtype="float32", config=CONFIG)
    assert llm.pooling_task == "token_classify" and len(llm.class_labels) == 3
    prompts = [tiny_tokenizer().encode(QUERY + doc) for doc in DOCS]
    raw = llm.encode(prompts, PoolingParams(use_activation=False), use_tqdm=False)
    for ids, out, logits in zip(prompts, llm.encode(prompts, use_tqdm=False), raw):
        with torch.inference_mode():
            expected = reference(torch.tensor([ids])).logits[0].float()
        assert out.outputs.data.shape == (len(ids), 3)
        torch.testing.assert_close(out.outputs.data, expected.softmax(-1), atol=1e-5, rtol=0)
        torch.testing.assert_close(logits.outputs.data, expected, atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="LLM.classify needs a classify model; this pooling model's task is "
                                         "'token_classify'"):
        llm.classify(prompts, use_tqdm=False)
    assert all_free(llm)
    sequence = save_classifier(tmp_path / "seq", kind, num_labels=1)
    per_token = LLM(tmp_path / "seq", dtype="float32", config=CONFIG, pooler_config={"task": "token_classify"})
    [out] = per_token.encode(prompts[1], use_tqdm=False)
    with torch.inference_mode():
        expected = sequence.score(sequence.model(torch.tensor([prompts[1]])).last_hidden_state[0]).float().sigmoid()
    torch.testing.assert_close(out.outputs.data, expected, atol=1e-5, rtol=0)
    assert all_free(per_token)


RERANKER = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["w20", "w21"]}


@pytest.mark.parametrize("kind, overrides", [("qwen3", {"is_original_qwen3_reranker": True}),
                                             ("llama", {"is_original_qwen3_reranker": True}),
                                             ("llama_tied", {"method": "from_2_way_softmax"})])
def test_a_decoder_reranker_scores_with_two_tokens_logits(tiny_models: dict[str, TinyModel], kind: str,
                                                          overrides: dict, one_thread: None) -> None:
    """A causal LM whose relevance is P("yes") against "no" at the last position (here tokens w21 and w20):
    vLLM's conversion gives a one-label head (w21's row minus w20's, whose sigmoid is that softmax). Tied
    heads take the embedding's rows. `score` joins the two texts (no pair template), as vLLM does for it."""
    model = tiny_models[kind]
    llm = LLM(model.path, dtype="float32", config=CONFIG, hf_overrides=RERANKER | overrides)
    assert llm.pooling_task == "classify"
    prompts = [tiny_tokenizer().encode(QUERY + doc) for doc in DOCS]
    for ids, out in zip(prompts, llm.classify(prompts, use_tqdm=False)):
        with torch.inference_mode():
            logits = model.reference(torch.tensor([ids])).logits[0, -1].float()
        assert out.outputs.probs[0] == pytest.approx(float(logits[[20, 21]].softmax(-1)[1]), abs=1e-5)
    if kind == "llama":
        scores = llm.score(QUERY, DOCS, use_tqdm=False)
        assert [s.prompt_token_ids for s in scores] == prompts
    assert all_free(llm)


def test_a_classify_conversion_needs_a_head(tiny_models: dict[str, TinyModel]) -> None:
    path = tiny_models["llama"].path
    with pytest.raises(ConfigError, match="has no score.weight"):
        LLM(path, dtype="float32", config=CONFIG, convert="classify")
    with pytest.raises(ConfigError, match="not tokens of the model's vocabulary"):
        LLM(path, dtype="float32", config=CONFIG, hf_overrides={"architectures": ["LlamaForSequenceClassification"],
                                                                 "classifier_from_token": ["no", "yes"],
                                                                 "method": "from_2_way_softmax"})
