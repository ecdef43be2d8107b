"""LoRA adapters served by name: `--lora-modules` listed in /v1/models with the base as parent, the request's
`model` picking the adapter (completions and chat equal to peft's greedy tokens), an unknown name a 404
naming it, adapters loaded and unloaded at run time (vLLM's endpoints and answers, only with
VLLM_ALLOW_RUNTIME_LORA_UPDATING), and an adapter unloaded while a request streams with it letting it finish."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from conveyor import LLM, ContinuousBatchingConfig, LoRARequest
from conveyor.server import BackgroundServer, ServerSettings
from conveyor.server.settings import lora_modules

from tests.serving_helpers import settles
from tests.utils import USER_CHAT_TEMPLATE, TinyModel, hf_greedy, idle, make_lora_adapter, random_prompts

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def adapters(tiny_llama: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, object]]:
    made = {}
    for name, seed in (("sql", 11), ("chat", 12)):
        path = tmp_path_factory.mktemp(f"lora_{name}")
        made[name] = (path, make_lora_adapter(tiny_llama.reference, path, seed=seed, rank=4))
    return made


@pytest.fixture(scope="module")
def llm(tiny_llama: TinyModel) -> LLM:
    return LLM(tiny_llama.path, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
               chat_template=USER_CHAT_TEMPLATE, config=ContinuousBatchingConfig(num_blocks=256))


@pytest.fixture(scope="module")
def settings(adapters: dict) -> ServerSettings:
    return ServerSettings(served_model_names=["base"], allow_runtime_lora_updating=True,
                          lora_modules=lora_modules([f"sql={adapters['sql'][0]}"], enabled=True))


@pytest.fixture(scope="module")
def url(llm: LLM, settings: ServerSettings):
    with BackgroundServer(llm, settings) as url:
        yield url


@pytest.fixture()
def http(url: str):
    with httpx.Client(base_url=url, timeout=60) as client:
        yield client


def reference_text(llm: LLM, model: object, prompt: list[int], n: int) -> str:
    """peft's (or transformers') greedy continuation as words (the server's text has a leading space)."""
    return llm.tokenizer.decode(hf_greedy(model, prompt, n)[0], skip_special_tokens=True)


def test_models_lists_adapters_with_the_base_as_parent(client: openai.OpenAI, adapters: dict) -> None:
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"base", "sql"}
    assert cards["sql"].parent == "base" and cards["sql"].root == str(adapters["sql"][0])


def test_the_model_field_picks_the_adapter(client: openai.OpenAI, llm: LLM, adapters: dict,
                                           tiny_llama: TinyModel) -> None:
    prompt = random_prompts([9], seed=21)[0]
    texts = {model: client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
             for model in ("sql", "base")}
    assert texts["sql"].model == "sql" and texts["base"].model == "base"
    assert texts["sql"].choices[0].text.strip() == reference_text(llm, adapters["sql"][1], prompt, 8)
    assert texts["base"].choices[0].text.strip() == reference_text(llm, tiny_llama.reference, prompt, 8)
    assert texts["sql"].choices[0].text != texts["base"].choices[0].text
    messages = [{"role": "user", "content": "w20 w21 w22"}]
    chat = client.chat.completions.create(model="sql", messages=messages, max_tokens=6, temperature=0)
    ids = llm.render_chat(messages)
    assert chat.model == "sql"
    assert chat.choices[0].message.content.strip() == reference_text(llm, adapters["sql"][1], ids, 6)
    settles(llm)
    assert idle(llm)


def test_an_unknown_model_is_a_404_naming_it(client: openai.OpenAI) -> None:
    for call in (lambda: client.completions.create(model="nope", prompt="w5", max_tokens=1),
                 lambda: client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "w5"}])):
        with pytest.raises(openai.NotFoundError, match="`nope` does not exist"):
            call()


def test_load_and_unload_at_run_time(http: httpx.Client, client: openai.OpenAI, llm: LLM, adapters: dict,
                                     settings: ServerSettings, tmp_path: Path, tiny_llama: TinyModel) -> None:
    path, reference = adapters["chat"]
    reply = http.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": str(path)})
    assert reply.status_code == 200 and reply.text == "Success: LoRA adapter 'chat' added successfully."
    again = http.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": str(path)})
    assert again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]
    assert "chat" in {m.id for m in client.models.list().data}
    prompt = random_prompts([12], seed=22)[0]
    out = client.completions.create(model="chat", prompt=prompt, max_tokens=6, temperature=0)
    assert out.choices[0].text.strip() == reference_text(llm, reference, prompt, 6)

    big = tmp_path / "big"
    make_lora_adapter(tiny_llama.reference, big, seed=13, rank=16)
    bad = http.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(big)})
    assert bad.status_code == 400 and "max_lora_rank=8" in bad.json()["error"]["message"]

    # Unloaded while a request streams with it: that request finishes; new ones cannot name it.
    stream = client.completions.create(model="chat", prompt=prompt, max_tokens=200, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    first = next(chunks)
    gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
    assert gone.status_code == 200 and gone.text == "Success: LoRA adapter 'chat' removed successfully."
    assert sum(llm.engine.lora.slot_users) == 1  # (still running: 200 tokens take far longer than the call)
    rest = list(chunks)
    assert [c.choices[0].finish_reason for c in rest if c.choices][-1] == "length"
    assert first.choices and rest[-1].usage.completion_tokens == 200
    with pytest.raises(openai.NotFoundError, match="`chat` does not exist"):
        client.completions.create(model="chat", prompt=prompt, max_tokens=1)
    missing = http.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
    assert missing.status_code == 404 and "cannot be found" in missing.json()["error"]["message"]

    settings.allow_runtime_lora_updating = False
    try:
        off = http.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": str(path)})
        assert off.status_code == 404 and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in off.json()["error"]["message"]
    finally:
        settings.allow_runtime_lora_updating = True
    settles(llm)
    assert idle(llm)


def test_lora_modules_forms() -> None:
    parsed = lora_modules(["a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}'], enabled=True)
    assert parsed == [LoRARequest("a", 1, "/x"), LoRARequest("b", 2, "/y", "m")]
    for bad, message in ((["a"], "name=path"), (['{"name": "b"}'], "JSON form"), (["a=/x", "a=/y"], "twice")):
        with pytest.raises(ValueError, match=message):
            lora_modules(bad, enabled=True)
    with pytest.raises(ValueError, match="--enable-lora"):
        lora_modules(["a=/x"], enabled=False)
