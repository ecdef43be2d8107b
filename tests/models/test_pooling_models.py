"""Checkpoints as pooling models: the task vLLM's runner, convert and task options resolve to; how a
checkpoint's files say to pool (sentence-transformers' modules.json and Pooling config, as Qwen3-Embedding
and gte-Qwen2 ship them; GGUF's pooling type); a checkpoint saved from the bare decoder (no `model.`
prefix, a `*Model` architecture)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch
import torch.nn.functional as F
import transformers

from conveyor import LLM, ContinuousBatchingConfig, PoolerConfig
from conveyor.config import ConfigError
from conveyor.models.pooling import pooling_task
from conveyor.models.sentence_transformers import read_pipeline
from conveyor.pooling_params import PoolingParamsError

from tests.gguf_writer import write_gguf
from tests.utils import TINY_CONFIGS, TinyModel, all_free, random_prompts, tiny_tokenizer

CONFIG = ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=32)


def arch(name: str) -> transformers.PretrainedConfig:
    return transformers.LlamaConfig(architectures=[name])


def test_the_task_follows_runner_convert_task_and_the_architecture() -> None:
    causal, classifier, bare = arch("LlamaForCausalLM"), arch("Qwen3ForSequenceClassification"), arch("Qwen3Model")
    assert pooling_task(causal) is None  # auto: a causal LM generates
    assert pooling_task(classifier) == "classify" and pooling_task(bare) == "embed"
    assert pooling_task(causal, runner="pooling") == "embed"
    assert pooling_task(causal, convert="embed") == "embed"  # a pooling conversion asks for the pooling runner
    assert pooling_task(causal, task="embed") == pooling_task(causal, task="embedding") == "embed"
    assert pooling_task(causal, task="score") == "classify" and pooling_task(classifier, task="generate") is None
    assert pooling_task(classifier, runner="pooling", convert="embed") == "embed"
    for kwargs, message in ((dict(runner="generate", convert="embed"), "needs runner 'pooling'"),
                            (dict(task="embed", runner="generate"), "disagrees with runner='generate'"),
                            (dict(task="reward"), "task 'reward' is not supported"),
                            (dict(runner="pooling", convert="none"), "no pooling model of its own"),
                            (dict(runner="draft"), "runner must be one of auto, generate, pooling")):
        with pytest.raises(ConfigError, match=message):
            pooling_task(causal, **kwargs)


def test_pooler_config_takes_vllms_forms() -> None:
    assert PoolerConfig.parse('{"pooling_type": "MEAN"}') == PoolerConfig("MEAN", None)
    assert PoolerConfig.parse({"seq_pooling_type": "CLS", "use_activation": False}) == PoolerConfig("CLS", False)
    assert PoolerConfig.parse(None) == PoolerConfig()
    assert PoolerConfig.parse({"task": "token_embed", "tok_pooling_type": "ALL"}) == PoolerConfig("ALL", None,
                                                                                                  "token_embed")
    for bad, message in (('{"pooling_type": "MAX"}', "must be one of LAST, MEAN, CLS, ALL"), ("[1]", "a JSON object"),
                         ('{"pool": 1}', r"fields \['pool'\] are not supported"), ("{", "not valid JSON"),
                         ('{"task": "plugin"}', "task must be one of embed, classify, token_embed, token_classify"),
                         ('{"task": "token_embed", "pooling_type": "LAST"}', "does not pool with 'LAST'"),
                         ('{"task": "embed", "pooling_type": "ALL"}', "the token tasks pool ALL")):
        with pytest.raises(PoolingParamsError, match=message):
            PoolerConfig.parse(bad)


def write_sentence_transformers(path: Path, mode: str, normalize: bool) -> None:
    """modules.json and the Pooling module's config.json, as sentence-transformers saves them."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    modes = {f"pooling_mode_{m}": m == mode for m in ("cls_token", "mean_tokens", "max_tokens", "lasttoken")}
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64} | modes))


@torch.inference_mode()
def hidden_states(model: transformers.PreTrainedModel, prompt: list[int]) -> torch.Tensor:
    return model(torch.tensor([prompt])).last_hidden_state[0]


def test_sentence_transformers_files_say_how_to_pool(tmp_path: Path, one_thread: None) -> None:
    """Qwen3-Embedding's files (last token, normalized) and a mean-pooling model's without Normalize; the
    user's pooler config goes over them."""
    model = TinyModel("qwen3", tmp_path / "m")
    write_sentence_transformers(model.path, "lasttoken", normalize=True)
    assert read_pipeline(model.path).pooler_config == PoolerConfig("LAST", True)
    write_sentence_transformers(model.path, "mean_tokens", normalize=False)
    assert read_pipeline(model.path).pooler_config == PoolerConfig("MEAN", False)
    prompts = random_prompts([6, 45], seed=9)
    llm = LLM(model.path, dtype="float32", runner="pooling", config=CONFIG)
    assert (llm.engine.pooler.pooling_type, llm.engine.pooler.normalize) == ("MEAN", False)
    for prompt, out in zip(prompts, llm.embed(prompts, use_tqdm=False)):
        ref = hidden_states(model.reference.model, prompt).mean(0)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, atol=2e-5, rtol=1e-4)
    assert all_free(llm)
    over = LLM(model.path, dtype="float32", runner="pooling", config=CONFIG, pooler_config={"pooling_type": "LAST"})
    assert (over.engine.pooler.pooling_type, over.engine.pooler.normalize) == ("LAST", False)


def test_a_bare_decoder_checkpoint_embeds(tmp_path: Path, one_thread: None) -> None:
    """Saved from `Qwen2Model` (tensors without the `model.` prefix, no LM head, architecture `Qwen2Model`): a
    pooling model without --runner."""
    torch.manual_seed(0)
    config = TINY_CONFIGS["qwen2"]()
    config._attn_implementation = "eager"
    bare = transformers.Qwen2Model(config).eval()
    bare.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    llm = LLM(tmp_path, dtype="float32", config=CONFIG)
    assert llm.pooling_task == "embed"
    prompts = random_prompts([3, 50], seed=10)
    for prompt, out in zip(prompts, llm.embed(prompts, use_tqdm=False)):
        ref = F.normalize(hidden_states(bare, prompt)[-1], dim=0)
        assert float(F.cosine_similarity(torch.tensor(out.outputs.embedding), ref, dim=0)) >= 0.9999
    assert all_free(llm)


def test_a_gguf_file_says_how_to_pool(tiny_models: dict[str, TinyModel], tmp_path: Path, gguf_tokenizer: None,
                                      one_thread: None) -> None:
    """llama.cpp's converter writes `qwen3.pooling_type` for embedding models: mean here."""
    model = tiny_models["qwen3"]
    path = tmp_path / "embed.gguf"
    write_gguf(path, model.reference, "qwen3", gguf.GGMLQuantizationType.F32,
               extra=lambda w: w.add_pooling_type(gguf.PoolingType.MEAN))
    llm = LLM(path, dtype="float32", runner="pooling", config=CONFIG)
    assert (llm.engine.pooler.pooling_type, llm.engine.pooler.normalize) == ("MEAN", True)
    prompt = random_prompts([20], seed=11)[0]
    ref = F.normalize(hidden_states(model.reference.model, prompt).mean(0), dim=0)
    out = llm.embed(prompt, use_tqdm=False)[0]
    assert float(F.cosine_similarity(torch.tensor(out.outputs.embedding), ref, dim=0)) >= 0.9999
    assert all_free(llm)
