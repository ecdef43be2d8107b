"""vLLM's /classify and /pooling on a three-label classifier (a `*ForSequenceClassification` checkpoint):
labels from its config's id2label, probabilities equal to `LLM.classify`, raw scores equal to transformers'
logits (fp32) with use_activation off, base64 pooled vectors."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch
import transformers

from conveyor import LLM, ContinuousBatchingConfig
from conveyor.server import BackgroundServer

from tests.serving_helpers import settles
from tests.utils import TINY_CONFIGS, tiny_tokenizer

LABELS = {0: "negative", 1: "neutral", 2: "positive"}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[LLM, transformers.PreTrainedModel]:
    path = tmp_path_factory.mktemp("classifier3")
    torch.manual_seed(3)
    config = TINY_CONFIGS["llama"]()
    config.num_labels, config.id2label, config.label2id = 3, LABELS, {v: k for k, v in LABELS.items()}
    reference = transformers.LlamaForSequenceClassification(config).eval()
    reference.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return LLM(path, dtype="float32", config=ContinuousBatchingConfig(num_blocks=128)), reference


@pytest.fixture(scope="module")
def http(model: tuple[LLM, transformers.PreTrainedModel]):
    with BackgroundServer(model[0]) as url, httpx.Client(base_url=url, timeout=60) as client:
        yield client


def test_classify_gives_each_input_its_label_and_probabilities(http: httpx.Client, model) -> None:
    llm, reference = model
    texts = ["w5 w6 w7", "w9 w8", "w11 w12 w13 w14"]
    assert llm.class_labels == ["negative", "neutral", "positive"]
    offline = [o.outputs.probs for o in llm.classify(texts, use_tqdm=False)]
    reply = http.post("/classify", json={"input": texts})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "list" and body["id"].startswith("classify-") and body["usage"]["prompt_tokens"] > 0
    for i, (item, probs) in enumerate(zip(body["data"], offline)):
        assert item["index"] == i and item["num_classes"] == 3 and sum(item["probs"]) == pytest.approx(1.0)
        assert item["probs"] == pytest.approx(probs, abs=1e-6)
        assert item["label"] == LABELS[int(np.argmax(probs))]
    one = http.post("/classify", json={"input": [5, 6, 7]}).json()["data"]  # token ids too
    assert one[0]["probs"] == pytest.approx(offline[0], abs=1e-6)

    with torch.inference_mode():
        logits = reference(torch.tensor([llm.tokenizer.encode(texts[0])])).logits[0].tolist()
    raw = http.post("/pooling", json={"input": texts[0], "use_activation": False}).json()["data"][0]
    assert raw["object"] == "pooling" and raw["data"] == pytest.approx(logits, abs=1e-4)
    packed = http.post("/pooling", json={"input": texts[0], "encoding_format": "base64"}).json()["data"][0]["data"]
    assert np.frombuffer(base64.b64decode(packed), dtype="<f4").tolist() == pytest.approx(offline[0], abs=1e-6)
    refused = http.post("/v1/embeddings", json={"input": "w5"})
    assert refused.status_code == 400 and "/classify" in refused.json()["error"]["message"]
    settles(llm)
    with pytest.raises(ValueError, match="class_labels needs a classify model"):
        LLM(dtype="float32", runner="pooling").class_labels
