"""Encoder models served: a BERT embedding model's /v1/embeddings through the openai client equal to transformers'
CLS states (normalized), a prompt over the context a 400 naming it; a BERT cross-encoder's /v1/rerank ordered
by transformers' scores of the tokenizer's pairs."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F

from conveyor import LLM
from conveyor.server import BackgroundServer

from tests.encoder_models import WORDS, bert_tokenizer, encoder_config, save_encoder, texts


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory) -> tuple[LLM, torch.nn.Module, Path]:
    path = tmp_path_factory.mktemp("bert")
    reference = save_encoder(path, encoder_config("bert"))
    return LLM(path, dtype="float32"), reference, path


@pytest.fixture(scope="module")
def url(embedder: tuple[LLM, torch.nn.Module, Path]):
    with BackgroundServer(embedder[0]) as url:
        yield url


def test_the_openai_client_embeds_with_an_encoder(client: openai.OpenAI, url: str, embedder) -> None:
    llm, reference, path = embedder
    tokenizer = bert_tokenizer(path)
    batch = texts(5, seed=11)
    reply = client.embeddings.create(model=llm.model_name, input=batch)
    with torch.inference_mode():
        refs = [F.normalize(reference(**tokenizer(t, return_tensors="pt")).last_hidden_state[0, 0], dim=0)
                for t in batch]
    for data, ref in zip(reply.data, refs):
        np.testing.assert_allclose(data.embedding, ref.numpy(), atol=2e-5, rtol=1e-4)
    assert reply.usage.prompt_tokens == sum(len(tokenizer(t)["input_ids"]) for t in batch)
    too_long = httpx.post(f"{url}/v1/embeddings", json={"input": " ".join(WORDS[:130])}, timeout=60)
    assert too_long.status_code == 400 and "context length of 128 tokens" in too_long.text


def test_a_cross_encoder_reranks_as_transformers_scores(tmp_path: Path) -> None:
    reference = save_encoder(tmp_path, encoder_config("bert", num_labels=1), head="ForSequenceClassification")
    tokenizer = bert_tokenizer(tmp_path)
    query, documents = texts(1, seed=12)[0], texts(6, seed=13)
    with torch.inference_mode():
        scores = [float(reference(**tokenizer(query, text_pair=d, return_tensors="pt")).logits[0, 0].sigmoid())
                  for d in documents]
    with BackgroundServer(LLM(tmp_path, dtype="float32")) as url:
        reply = httpx.post(f"{url}/v1/rerank", json={"query": query, "documents": documents}, timeout=60)
    assert reply.status_code == 200, reply.text
    results = reply.json()["results"]
    assert [r["index"] for r in results] == sorted(range(6), key=lambda i: -scores[i])
    for r in results:
        assert r["relevance_score"] == pytest.approx(scores[r["index"]], abs=2e-6)
