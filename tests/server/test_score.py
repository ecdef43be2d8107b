"""A classifier's server (a `*ForSequenceClassification` checkpoint, runner auto): /v1/score and /score in every
input form vLLM takes, /v1/rerank, /rerank and /v2/rerank (Jina's and Cohere's shape) equal to `LLM.score`;
use_activation off gives the raw logits; /v1/embeddings refused with the flag that serves it."""

from __future__ import annotations


import httpx
import numpy as np
import pytest
import torch
import transformers

from conveyor import LLM, ContinuousBatchingConfig, PoolingParams
from conveyor.server import BackgroundServer

from tests.serving_helpers import random_words, settles
from tests.utils import TINY_CONFIGS, tiny_tokenizer


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = tmp_path_factory.mktemp("classifier")
    torch.manual_seed(2)
    config = TINY_CONFIGS["llama"]()
    config.num_labels = 1
    transformers.LlamaForSequenceClassification(config).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return LLM(path, dtype="float32", config=ContinuousBatchingConfig(num_blocks=128))


@pytest.fixture(scope="module")
def http(llm: LLM):
    with BackgroundServer(llm) as url, httpx.Client(base_url=url, timeout=60) as client:
        yield client


def expected(llm: LLM, first: str | list[str], second: list[str], activation: bool = True) -> list[float]:
    params = PoolingParams(use_activation=activation)
    return [o.outputs.score for o in llm.score(first, second, pooling_params=params, use_tqdm=False)]


def test_score_in_every_input_form(http: httpx.Client, llm: LLM) -> None:
    query, docs = random_words(1, 4) + " ", [random_words(2, 6), random_words(3, 12), random_words(4, 2)]
    scores = expected(llm, query, docs)
    assert all(0 < s < 1 for s in scores)  # sigmoid
    for path, names in (("/v1/score", ("text_1", "text_2")), ("/score", ("queries", "documents")),
                        ("/v1/score", ("queries", "items")), ("/v1/score", ("data_1", "data_2"))):
        reply = http.post(path, json={names[0]: query, names[1]: docs}).json()
        assert [d["object"] for d in reply["data"]] == ["score"] * 3 and reply["id"].startswith("score-")
        np.testing.assert_allclose([d["score"] for d in reply["data"]], scores, atol=1e-6)
        assert reply["usage"]["prompt_tokens"] == sum(4 + len(d.split()) for d in docs)
    raw = http.post("/v1/score", json={"text_1": [query, docs[0]], "text_2": docs[:2], "use_activation": False}).json()
    np.testing.assert_allclose([d["score"] for d in raw["data"]], expected(llm, [query, docs[0]], docs[:2], False),
                               atol=1e-5)
    clash = http.post("/v1/score", json={"text_1": query, "text_2": docs, "softmax": True, "activation": False})
    assert clash.status_code == 400 and "one switch" in clash.text
    settles(llm)


def test_rerank_orders_documents_as_vllm(http: httpx.Client, llm: LLM) -> None:
    query, docs = random_words(5, 3) + " ", [random_words(6 + i, 3 + i) for i in range(5)]
    scores = expected(llm, query, docs)
    order = sorted(range(5), key=lambda i: -scores[i])
    for path, top_n in (("/v1/rerank", 0), ("/rerank", 3), ("/v2/rerank", 1)):
        reply = http.post(path, json={"query": query, "documents": docs, "top_n": top_n}).json()
        kept = order[:top_n] if top_n else order
        assert [r["index"] for r in reply["results"]] == kept
        assert [r["document"] for r in reply["results"]] == [{"text": docs[i]} for i in kept]
        np.testing.assert_allclose([r["relevance_score"] for r in reply["results"]], [scores[i] for i in kept],
                                   atol=1e-6)
        assert set(reply["usage"]) == {"prompt_tokens", "total_tokens"} and reply["id"].startswith("rerank-")
    assert http.post("/v1/rerank", json={"query": query, "documents": []}).status_code == 400
    settles(llm)


def test_embeddings_need_an_embedding_model(http: httpx.Client, llm: LLM) -> None:
    reply = http.post("/v1/embeddings", json={"input": "w5"})
    assert reply.status_code == 400 and "--convert embed" in reply.json()["error"]["message"]
    assert http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "w5"}]}).status_code == 404
    settles(llm)
