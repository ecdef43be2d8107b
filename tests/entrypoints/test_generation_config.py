"""The model's generation config as vLLM applies it (`auto`: the defaults of what a request leaves unset,
offline and on the server; `vllm`: ignored; a directory: that file), a chat template given as a file or
inline (`LLM(chat_template=)`, `llm.chat(chat_template=)`, the server) and its options offline (OpenAI's
content parts too), and
`--max-model-len` on the server: over it, a 400 naming it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from conveyor import LLM, ContinuousBatchingConfig, SamplingParams
from conveyor.chat_template import load_chat_template
from conveyor.generation_config import GenerationDefaults
from conveyor.server import BackgroundServer

from tests.utils import USER_CHAT_TEMPLATE, TinyModel

GENERATION = {"temperature": 0.0, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.1, "max_new_tokens": 5,
              "do_sample": True, "bos_token_id": 1}


@pytest.fixture(scope="module")
def model_dir(tiny_llama: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a generation_config.json that sets sampling defaults."""
    path = tmp_path_factory.mktemp("generation") / "model"
    shutil.copytree(tiny_llama.path, path)
    (path / "generation_config.json").write_text(json.dumps(GENERATION))
    return path


def llm(path: Path, **kwargs: object) -> LLM:
    return LLM(path, dtype="float32", config=ContinuousBatchingConfig(num_blocks=64), **kwargs)


def test_auto_vllm_a_directory_and_overrides(model_dir: Path, tmp_path: Path) -> None:
    auto = GenerationDefaults.load("auto", model_dir)
    assert auto.sampling_params() == SamplingParams(temperature=0.0, top_p=0.8, top_k=20, repetition_penalty=1.1,
                                                    max_new_tokens=5)
    assert GenerationDefaults.load("vllm", model_dir).sampling_params() == SamplingParams()
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "max_length": 100}))
    other = GenerationDefaults.load(str(tmp_path), model_dir)
    assert other.values == {"temperature": 0.6} and other.max_length == 100
    both = GenerationDefaults.load("auto", model_dir, {"temperature": 0.3, "min_p": 0.1})
    assert (both.values["temperature"], both.values["min_p"], both.values["top_k"]) == (0.3, 0.1, 20)
    assert GenerationDefaults.load("auto", None).values == {}  # the built-in model: a GGUF file has none
    with pytest.raises(ValueError, match="neither 'auto', 'vllm' nor a directory with a generation_config.json"):
        GenerationDefaults.load(str(tmp_path / "nowhere"), model_dir)
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 3}))
    with pytest.raises(ValueError, match=r"generation_config.json: top_p must be in \(0, 1\]"):
        GenerationDefaults.load(str(tmp_path), model_dir)
    with pytest.raises(ValueError, match="override_generation_config takes"):
        GenerationDefaults.load("vllm", None, {"beams": 2})


def test_max_tokens_of_a_request_without_a_limit() -> None:
    """The rest of the context; of max_length when shorter and the prompt fits; capped by max_new_tokens."""
    assert GenerationDefaults().max_tokens(10, 512) == 502
    assert GenerationDefaults({}, max_length=100).max_tokens(10, 512) == 90
    assert GenerationDefaults({}, max_length=100).max_tokens(150, 512) == 362  # past max_length: the context
    assert GenerationDefaults({"max_new_tokens": 5}, max_length=100).max_tokens(10, 512) == 5


def test_offline_defaults_come_from_the_generation_config(model_dir: Path) -> None:
    auto, vllm = llm(model_dir), llm(model_dir, generation_config="vllm")
    assert auto.get_default_sampling_params().max_new_tokens == 5
    assert vllm.get_default_sampling_params() == SamplingParams()
    [out] = auto.generate([[5, 6, 7]], use_tqdm=False)  # no sampling params: the model's defaults
    assert out.num_output_tokens <= 5
    greedy = SamplingParams(temperature=0, top_p=0.8, top_k=20, repetition_penalty=1.1, max_new_tokens=5)
    assert out.token_ids == auto.generate([[5, 6, 7]], greedy, use_tqdm=False)[0].token_ids


def test_chat_template_from_a_file_inline_or_per_call(tiny_llama: TinyModel, tmp_path: Path) -> None:
    (tmp_path / "t.jinja").write_text(USER_CHAT_TEMPLATE)
    assert load_chat_template(tmp_path / "t.jinja") == USER_CHAT_TEMPLATE \
        == load_chat_template(str(tmp_path / "t.jinja"))
    assert load_chat_template("{{ messages[0]['content'] }}\\n") == "{{ messages[0]['content'] }}\n"  # vLLM's escapes
    with pytest.raises(ValueError, match="chat template file not found: nope.jinja"):
        load_chat_template("nope.jinja")
    hello = [{"role": "user", "content": "w5"}]
    model = llm(tiny_llama.path, chat_template=tmp_path / "t.jinja")
    assert model.render_chat(hello) == [7, 5, 8, 9]
    inline = USER_CHAT_TEMPLATE.replace("w7", "w10")
    [out] = model.chat(hello, SamplingParams(max_new_tokens=1), use_tqdm=False, chat_template=inline)
    assert out.prompt_token_ids == [10, 5, 8, 9]
    with pytest.raises(ValueError, match="cannot render a user message"):
        llm(tiny_llama.path, chat_template="{{ messages[0]['nope'] + 1 }}")



def test_chat_template_kwargs_and_a_continued_message_offline(tiny_llama: TinyModel) -> None:
    switch = ("{% for m in messages %}w7 {{ m['content'] }}{% endfor %}{% if add_generation_prompt %} w8{% endif %}"
              "{% if flag is defined and flag %} w9{% endif %}")
    model = llm(tiny_llama.path, chat_template=switch)
    hello = [{"role": "user", "content": "w5"}]
    one = SamplingParams(max_new_tokens=1)
    assert model.render_chat(hello) == [7, 5, 8]
    [out] = model.chat(hello, one, use_tqdm=False, chat_template_kwargs={"flag": True})
    assert out.prompt_token_ids == [7, 5, 8, 9]
    [out] = model.chat(hello, one, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    assert out.prompt_token_ids == [7, 5]
    with pytest.raises(ValueError, match="set add_generation_prompt to false"):
        model.chat(hello, one, continue_final_message=True)
    with pytest.raises(ValueError, match="chat_template_kwargs cannot set tokenize"):
        model.chat(hello, one, chat_template_kwargs={"tokenize": True})


def test_openai_content_parts_offline(tiny_llama: TinyModel) -> None:
    """vLLM's `llm.chat` takes OpenAI's content parts: text parts joined by newlines into the one string the
    template reads (the word-level tokenizer splits on the newline too); other parts are a ValueError, and so
    is the "openai" content format (templates here read strings)."""
    model = llm(tiny_llama.path, chat_template=USER_CHAT_TEMPLATE)
    parts = [{"role": "user", "content": [{"type": "text", "text": "w5"}, {"type": "text", "text": "w6"}]}]
    assert model.render_chat_text(parts) == "w7 w5\nw6 w8 w9"
    [out] = model.chat(parts, SamplingParams(max_new_tokens=1), use_tqdm=False, chat_template_content_format="string")
    assert out.prompt_token_ids == [7, 5, 6, 8, 9]
    with pytest.raises(ValueError, match="only text content parts are supported, got image_url"):
        model.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], use_tqdm=False)
    with pytest.raises(ValueError, match="'openai': message contents reach the template as one string"):
        model.chat(parts, use_tqdm=False, chat_template_content_format="openai")

def test_the_server_fills_unset_fields_and_caps_the_context(model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "t.jinja").write_text(USER_CHAT_TEMPLATE)
    model = llm(model_dir, max_model_len=64, chat_template=tmp_path / "t.jinja")
    with BackgroundServer(model) as url, httpx.Client(base_url=url, timeout=60) as http:
        models = http.get("/v1/models").json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [("model", 64)]

        def chat(**fields: object) -> dict:
            body = {"messages": [{"role": "user", "content": "w5 w6"}], "ignore_eos": True} | fields
            response = http.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()

        unset = chat()  # max_tokens, temperature, top_p, top_k, repetition_penalty: the generation config's
        assert unset["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}  # w7 w5 w6 w8 w9
        explicit = chat(max_tokens=5, temperature=0, top_p=0.8, top_k=20, repetition_penalty=1.1)
        assert unset["choices"][0]["message"] == explicit["choices"][0]["message"]
        assert chat(max_tokens=9)["usage"]["completion_tokens"] == 9  # a request's own limit wins
        over = http.post("/v1/completions", json={"prompt": [5] * 60, "max_tokens": 10})
        assert over.status_code == 400
        assert "exceeds the context length of 64 tokens (max_model_len)" in over.json()["error"]["message"]
