"""A pooling server (`--runner pooling`): /v1/embeddings through the official openai client (floats and
base64, every input form) equal to `LLM.embed`; usage; Matryoshka dimensions refused for a model not
trained for them; the context limit and truncation; /v1/score and /v1/rerank by cosine similarity;
/v1/models as the generating server's; generation routes refused, and a generating server refusing
/v1/embeddings."""

from __future__ import annotations

import base64
import math

import httpx
import numpy as np
import openai
import pytest

from conveyor import LLM, ContinuousBatchingConfig
from conveyor.server import BackgroundServer, ServerSettings

from tests.serving_helpers import random_words, settles
from tests.utils import TinyModel, idle


@pytest.fixture(scope="module")
def llm(tiny_models: dict[str, TinyModel]) -> LLM:
    return LLM(tiny_models["llama"].path, dtype="float32", runner="pooling", max_model_len=64,
               config=ContinuousBatchingConfig(num_blocks=128, max_batch_tokens=64))


@pytest.fixture(scope="module")
def url(llm: LLM):
    with BackgroundServer(llm, ServerSettings(served_model_names=["embedder"])) as url:
        yield url


@pytest.fixture()
def http(url: str):
    with httpx.Client(base_url=url, timeout=60) as client:
        yield client


def embedding(llm: LLM, prompt: str | list[int]) -> list[float]:
    return llm.embed(prompt, use_tqdm=False)[0].outputs.embedding


def test_the_openai_client_embeds_every_input_form(client: openai.OpenAI, llm: LLM) -> None:
    texts = [random_words(1, 5), random_words(2, 30)]
    ids = [[5, 6, 7], [8, 9, 10, 11]]
    expected = {t: embedding(llm, t) for t in texts} | {tuple(i): embedding(llm, i) for i in ids}
    for given, keys in ((texts[0], [texts[0]]), (texts, texts), (ids[0], [tuple(ids[0])]),
                        (ids, [tuple(i) for i in ids])):
        for fmt in ("float", openai.NOT_GIVEN):  # (the client asks for base64 when not given, and decodes it)
            reply = client.embeddings.create(model="embedder", input=given, encoding_format=fmt)
            assert [d.index for d in reply.data] == list(range(len(keys)))
            for data, key in zip(reply.data, keys):
                np.testing.assert_allclose(data.embedding, expected[key], atol=1e-6)
        assert reply.model == "embedder" and reply.object == "list"
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == 7
    raw = client.embeddings.create(model="embedder", input=texts[1], encoding_format="base64").data[0].embedding
    assert isinstance(raw, str)
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode(raw), dtype="<f4"),
                                  np.asarray(expected[texts[1]], dtype=np.float32))
    settles(llm)


def test_bad_input_is_a_400_naming_the_field(http: httpx.Client, llm: LLM) -> None:
    """dimensions for a model not trained for them (vLLM's message); a prompt over the context (64 tokens),
    or its tail with truncate_prompt_tokens; normalize off."""
    reply = http.post("/v1/embeddings", json={"input": "w5 w6", "dimensions": 16})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "dimensions"
    assert "does not support matryoshka representation" in reply.json()["error"]["message"]
    long = random_words(3, 70)
    over = http.post("/v1/embeddings", json={"input": long})
    assert over.status_code == 400 and over.json()["error"]["code"] == "context_length_exceeded"
    assert over.json()["error"]["param"] == "input" and "context length of 64 tokens" in over.text
    kept = http.post("/v1/embeddings", json={"input": long, "truncate_prompt_tokens": 20}).json()
    tail = llm.get_tokenizer().encode(long)[-20:]
    np.testing.assert_allclose(kept["data"][0]["embedding"], embedding(llm, tail), atol=1e-6)
    assert kept["usage"]["prompt_tokens"] == 20
    raw = http.post("/v1/embeddings", json={"input": "w5 w6", "normalize": False}).json()["data"][0]["embedding"]
    assert abs(math.hypot(*raw) - 1) > 1e-3  # not normalized
    assert http.post("/v1/embeddings", json={"input": []}).status_code == 400
    assert http.post("/v1/embeddings", json={"input": "w5", "model": "other"}).status_code == 404
    settles(llm)


def test_score_and_rerank_by_cosine_similarity(http: httpx.Client, llm: LLM) -> None:
    query, docs = random_words(4, 6), [random_words(5, 9), random_words(4, 6), random_words(6, 3)]
    vectors = [np.asarray(embedding(llm, t)) for t in [query, *docs]]
    expected = [float(vectors[0] @ v / np.linalg.norm(vectors[0]) / np.linalg.norm(v)) for v in vectors[1:]]
    scored = http.post("/v1/score", json={"text_1": query, "text_2": docs}).json()
    assert [d["index"] for d in scored["data"]] == [0, 1, 2] and scored["object"] == "list"
    np.testing.assert_allclose([d["score"] for d in scored["data"]], expected, atol=1e-5)
    assert abs(expected[1] - 1) < 1e-6  # the query itself
    pairwise = http.post("/score", json={"queries": [query, docs[0]], "documents": docs[:2]}).json()
    assert len(pairwise["data"]) == 2
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        reranked = http.post(path, json={"query": query, "documents": docs, "top_n": 2}).json()
        order = sorted(range(3), key=lambda i: -expected[i])[:2]
        assert [r["index"] for r in reranked["results"]] == order
        assert [r["document"]["text"] for r in reranked["results"]] == [docs[i] for i in order]
        np.testing.assert_allclose([r["relevance_score"] for r in reranked["results"]],
                                   [expected[i] for i in order], atol=1e-5)
        assert reranked["usage"]["total_tokens"] > 0 and reranked["model"] == "embedder"
    bad = http.post("/v1/score", json={"text_1": [query, query], "text_2": docs})
    assert bad.status_code == 400 and "text_1 must hold 1 text or as many as text_2" in bad.text
    assert http.post("/v1/score", json={"text_1": query}).status_code == 400
    settles(llm)


def test_models_and_the_generation_routes(http: httpx.Client, llm: LLM) -> None:
    models = http.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["embedder"] and models[0]["max_model_len"] == 64
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        reply = http.post(path, json={"prompt": "w5", "messages": [{"role": "user", "content": "w5"}]})
        assert reply.status_code == 404, path
        assert "runs a pooling model (--runner pooling)" in reply.json()["error"]["message"]
    assert http.post("/v1/messages", json={}).json()["type"] == "error"  # Anthropic's shape on its route
    assert idle(llm)


def test_a_generating_server_refuses_embeddings(tiny_models: dict[str, TinyModel]) -> None:
    generating = tiny_models["llama"].llm()
    with BackgroundServer(generating) as url:
        reply = httpx.post(f"{url}/v1/embeddings", json={"input": "w5"}, timeout=60)
        assert reply.status_code == 404
        assert "start it with --runner pooling" in reply.json()["error"]["message"]
        assert httpx.post(f"{url}/v1/rerank", json={"query": "w5", "documents": ["w6"]}, timeout=60).status_code == 404
    assert idle(generating)


def test_a_token_embed_server_answers_pooling_per_token(tiny_models: dict[str, TinyModel]) -> None:
    """`--pooler-config '{"task": "token_embed"}'`: /pooling gives each input's rows, one a token, as
    `LLM.encode` does (floats, or base64 of the rows one after the other); a task other than the server's is a
    400 naming it, and /v1/embeddings says what the model does."""
    token_llm = LLM(tiny_models["llama"].path, dtype="float32", runner="pooling", max_model_len=64,
                    pooler_config={"task": "token_embed"},
                    config=ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=16))
    ids = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27]]
    expected = [o.outputs.data.numpy() for o in token_llm.encode(ids, use_tqdm=False)]
    with BackgroundServer(token_llm) as url, httpx.Client(base_url=url, timeout=60) as http:
        reply = http.post("/pooling", json={"input": ids, "task": "token_embed"}).json()
        assert [d["index"] for d in reply["data"]] == [0, 1] and reply["usage"]["prompt_tokens"] == 23
        for data, rows in zip(reply["data"], expected):
            np.testing.assert_allclose(np.asarray(data["data"]), rows, atol=1e-6)
        packed = http.post("/pooling", json={"input": ids[1], "encoding_format": "base64"}).json()["data"][0]["data"]
        np.testing.assert_array_equal(np.frombuffer(base64.b64decode(packed), dtype="<f4").reshape(20, 64),
                                      expected[1].astype(np.float32))
        wrong = http.post("/pooling", json={"input": ids[0], "task": "embed"})
        assert wrong.status_code == 400 and "this server's model runs 'token_embed'" in wrong.json()["error"]["message"]
        refused = http.post("/v1/embeddings", json={"input": ids[0]})
        assert refused.status_code == 400 and "embeds each token" in refused.json()["error"]["message"]
    assert idle(token_llm)
