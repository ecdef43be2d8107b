"""vLLM's command line: the model as the first argument or `--model`, vLLM's flag names mapped onto ours,
a vLLM flag we do not take refused with what to use instead, `conveyor serve --help` in groups.
(`conveyor serve MODEL` as a subprocess: tests/server/test_server.py's `cli_server`.)"""

from __future__ import annotations

import argparse
import asyncio
import json

import httpx
import pytest

from conveyor import LLM, ContinuousBatchingConfig
from conveyor.cli import main
from conveyor.cli_args import (SERVE_MAX_BATCH_TOKENS, add_engine_args, config_from_args, llm_kwargs_from_args,
                               model_from_args)
from conveyor.errors import ConfigError
from conveyor.scaleout.launch import forwarded_options
from conveyor.server import BackgroundServer, ServerSettings
from conveyor.structured.config import StructuredOutputsConfig
from conveyor.vllm_flags import ALREADY_SO, UNSUPPORTED, check_vllm_flags, expand_config_file

from tests.serving_helpers import serve_parser
from tests.utils import USER_CHAT_TEMPLATE, TinyModel, random_prompts


def test_serve_takes_the_model_first_or_as_model(capsys: pytest.CaptureFixture[str]) -> None:
    parser = serve_parser()
    for argv in (["org/m"], ["--model", "org/m"], ["org/m", "--model", "org/m"], ["--port", "1", "org/m"]):
        assert model_from_args(parser.parse_args(argv)) == "org/m", argv
    assert model_from_args(parser.parse_args([])) is None  # the built-in model
    short = parser.parse_args(["org/m", "-tp", "2", "-dp", "3", "-q", "int8"])  # vLLM's short forms
    assert (short.tensor_parallel_size, short.data_parallel_size, short.quantization) == (2, 3, "int8")
    assert main(["serve", "a/b", "--model", "c/d"]) == 2
    assert "the model is given twice, as 'a/b' and as --model 'c/d': give one" in capsys.readouterr().err


def test_generate_takes_the_model_first(tiny_llama: TinyModel, capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--raw", "--max-new-tokens", "3", "--ignore-eos", "--dtype", "float32", "--num-blocks", "64"]
    assert main(["generate", str(tiny_llama.path), "w5 w6 w7", "w8", *common]) == 0
    first = capsys.readouterr().out
    assert "### w5 w6 w7\n" in first and "### w8\n" in first and "[3 tokens, finish_reason=length]" in first
    assert main(["generate", "--model", str(tiny_llama.path), "w5 w6 w7", "w8", *common]) == 0
    assert capsys.readouterr().out == first  # greedy: the same text either way
    vllm_named = [a if a != "--max-new-tokens" else "--max-tokens" for a in common]  # vLLM's name
    assert main(["generate", str(tiny_llama.path), "w5 w6 w7", "w8", *vllm_named]) == 0
    assert capsys.readouterr().out == first
    assert main(["generate", str(tiny_llama.path), "w5", "--max-model-len", "100000", *common]) == 2
    assert "max_model_len=100000 is larger than the model's context length of 512" in capsys.readouterr().err


def test_generate_takes_a_chat_template(tiny_llama: TinyModel, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """The tiny tokenizer has no chat template: without --chat-template a chat cannot be rendered."""
    (tmp_path / "t.jinja").write_text(USER_CHAT_TEMPLATE)
    common = ["--model", str(tiny_llama.path), "w5", "--max-new-tokens", "2", "--dtype", "float32", "--num-blocks", "64"]
    assert main(["generate", *common]) == 2
    assert "chat_template" in capsys.readouterr().err  # transformers: no chat template set
    assert main(["generate", *common, "--chat-template", str(tmp_path / "t.jinja")]) == 0
    assert "### w5\n" in capsys.readouterr().out
    assert main(["generate", *common, "--chat-template", str(tmp_path / "missing.jinja")]) == 2
    assert "chat template file not found" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--tokenizer-mode", "--pipeline-parallel-size", "-pp", "--enable-sleep-mode"])
def test_a_vllm_flag_we_do_not_take_says_what_to_use(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "org/m", flag, "x"]) == 2
    name = flag.split("=")[0]
    assert capsys.readouterr().err == f"error: {name} (vLLM's) is not supported: {UNSUPPORTED[name]}\n"


def test_sizes_take_vllms_suffixes(capsys: pytest.CaptureFixture[str]) -> None:
    parser = serve_parser()
    for given, tokens in (("2048", 2048), ("32k", 32000), ("25.6k", 25600), ("32K", 32768), ("8Ki", 8192)):
        assert parser.parse_args(["--max-model-len", given]).max_model_len == tokens, given
    for bad in ("1.5K", "2048.5", "32m", "lots"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--max-model-len", bad])
        assert f"{bad!r} is not a token count (e.g. 2048, 32k = 32000, 32K = 32768)" in capsys.readouterr().err
    for given, size in (("4294967296", 2**32), ("4G", 4 * 2**30), ("4Gi", 4 * 2**30), ("4g", 4 * 10**9),
                        ("1.5g", 15 * 10**8), ("512M", 2**29)):
        assert config_from_args(parser.parse_args(["--kv-cache-memory-bytes", given])).kv_cache_memory_bytes == size
    for bad in ("1.5G", "4x", "-1"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--kv-cache-memory-bytes", bad])
        assert f"{bad!r} is not a number of bytes" in capsys.readouterr().err


def test_a_vllm_config_file_gives_options_the_command_line_overrides(tmp_path, capsys) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("port: 8100\nserved_model_name: [a, b]\nenable-prefix-caching: false\nmax-num-seqs: 7\n"
                      "speculative-config: {method: ngram, num_speculative_tokens: 3}\nenforce-eager: true\n")
    parser = serve_parser()
    known = {option for action in parser._actions for option in action.option_strings}
    argv = expand_config_file(["serve", "org/m", "--config", str(config), "--port", "9000"], known)
    args = parser.parse_args(argv[1:])
    assert (args.port, args.served_model_name, args.max_num_seqs, args.enforce_eager) == (9000, ["a", "b"], 7, True)
    assert model_from_args(args) == "org/m" and args.enable_prefix_caching is False
    assert json.loads(args.speculative_config) == {"method": "ngram", "num_speculative_tokens": 3}
    assert expand_config_file(["serve", "--port", "1"]) == ["serve", "--port", "1"]
    config.write_text("- a list\n")
    assert main(["serve", f"--config={config}"]) == 2
    assert "must map option names to values" in capsys.readouterr().err
    assert main(["serve", "--config", str(tmp_path / "none.yaml")]) == 2
    assert "none.yaml" in capsys.readouterr().err


def test_flags_asking_for_what_we_always_do_are_taken() -> None:
    argv, notes = check_vllm_flags(["org/m", "--trust-remote-code", "--port", "1", "--disable-log-requests"])
    assert argv == ["org/m", "--port", "1"]
    assert notes == [f"--trust-remote-code: no effect, {ALREADY_SO['--trust-remote-code']}",
                     f"--disable-log-requests: no effect, {ALREADY_SO['--disable-log-requests']}"]
    assert check_vllm_flags(["x", "--", "--tokenizer-mode"]) == (["x", "--", "--tokenizer-mode"], [])  # after --: kept


def test_a_server_takes_a_larger_token_budget_unless_told() -> None:
    """`conveyor serve` defaults to vLLM's CPU server budget; `generate` and `LLM` keep the config's."""
    serve, engine = serve_parser(), argparse.ArgumentParser()
    add_engine_args(engine)
    assert config_from_args(serve.parse_args([])).max_batch_tokens == SERVE_MAX_BATCH_TOKENS == 2048
    assert config_from_args(engine.parse_args([])).max_batch_tokens == ContinuousBatchingConfig().max_batch_tokens
    for argv in (["--max-batch-tokens", "256"], ["--max-num-batched-tokens", "256"]):  # told: no disagreement
        assert config_from_args(serve.parse_args(argv)).max_batch_tokens == 256


def test_vllm_names_on_the_command_line() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = config_from_args(parser.parse_args([
        "--max-model-len", "128", "--seed", "4", "--max-num-seqs", "2", "--max-num-batched-tokens", "64",
        "--gpu-memory-utilization", "0.3", "--no-enable-prefix-caching", "--block-size", "8", "--swap-space", "1",
        "--enforce-eager", "--num-gpu-blocks-override", "40"]))
    assert (config.max_model_len, config.seed, config.max_requests_per_batch, config.max_batch_tokens,
            config.max_memory_percent, config.allow_block_sharing, config.page_size, config.cpu_offload_space,
            config.use_cuda_graph, config.num_blocks) == (128, 4, 2, 64, 0.3, False, 8, 1.0, False, 40)
    assert config_from_args(parser.parse_args(["--scheduling-policy", "priority"])).scheduler_type == "priority"
    assert config_from_args(parser.parse_args(["--scheduling-policy", "fcfs", "--scheduler-type",
                                               "prefill_first"])).scheduler_type == "prefill_first"
    with pytest.raises(ConfigError, match="max_num_seqs .*=2 disagrees with max_requests_per_batch=8"):
        config_from_args(parser.parse_args(["--max-num-seqs", "2", "--max-requests-per-batch", "8"]))
    with pytest.raises(ConfigError, match="enable_prefix_caching.*disagrees with allow_block_sharing=False"):
        config_from_args(parser.parse_args(["--no-block-sharing", "--enable-prefix-caching"]))


def test_serve_flags_take_effect_on_the_server(tiny_llama: TinyModel) -> None:
    """`conveyor serve MODEL --max-model-len 64 --max-num-seqs 2`: the context the server answers with and
    enforces (a 400 naming max_model_len), and never more than two requests in a step."""
    args = serve_parser().parse_args([str(tiny_llama.path), "--max-model-len", "64", "--max-num-seqs", "2",
                                      "--dtype", "float32", "--num-blocks", "64"])
    llm = LLM(**llm_kwargs_from_args(args))
    sizes: list[int] = []
    schedule = llm.engine.schedule

    def recording():
        out = schedule()
        sizes.append(len(out.chunks))
        return out

    llm.engine.schedule = recording
    with BackgroundServer(llm) as url, httpx.Client(base_url=url, timeout=60) as http:
        assert http.get("/v1/models").json()["data"][0]["max_model_len"] == 64
        over = http.post("/v1/completions", json={"prompt": [5] * 60, "max_tokens": 5})
        assert over.status_code == 400 and "context length of 64 tokens (max_model_len)" in over.text

        async def five_at_once() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                return await asyncio.gather(*[
                    client.post("/v1/completions", json={"prompt": p, "max_tokens": 40, "ignore_eos": True})
                    for p in random_prompts([5, 9, 3, 7, 6])])

        responses = asyncio.run(five_at_once())
    assert [r.json()["usage"]["completion_tokens"] for r in responses] == [40] * 5
    assert max(sizes) == 2  # five at once were sent: two ran together, never more
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_total_blocks
    llm.shutdown()


def test_serve_help_is_grouped(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: conveyor serve [MODEL] [options]")
    groups = ["model:", "engine and scheduling", "vLLM's names for the options above:", "server:", "data parallel"]
    positions = [text.index("\n" + g) for g in groups]
    assert positions == sorted(positions)
    assert "--max-num-seqs N      --max-requests-per-batch" in text and "--tokenizer-mode" in text  # refused, listed


def test_replicas_get_the_new_options_as_given() -> None:
    argv = ["org/m", "--max-model-len", "128", "--no-enable-prefix-caching", "--seed", "3", "--revision", "v1",
            "--override-generation-config", json.dumps({"temperature": 0.5}), "--chat-template", "t.jinja",
            "--generation-config", "vllm", "--max-num-seqs", "4", "--data-parallel-size", "2",
            "--reasoning-parser", "qwen3", "--default-chat-template-kwargs", json.dumps({"enable_thinking": False})]
    args = serve_parser().parse_args(argv)
    args.model = model_from_args(args)  # as cmd_serve does before it starts replicas
    again = serve_parser().parse_args(forwarded_options(args))
    for name in ("model", "max_model_len", "enable_prefix_caching", "seed", "revision", "override_generation_config",
                 "chat_template", "generation_config", "max_num_seqs", "reasoning_parser",
                 "default_chat_template_kwargs"):
        assert getattr(again, name) == getattr(args, name), name


def test_reasoning_parser_and_default_template_kwargs_flags(capsys: pytest.CaptureFixture[str]) -> None:
    args = serve_parser().parse_args(["--reasoning-parser", "deepseek_r1", "--default-chat-template-kwargs",
                                      '{"enable_thinking": false}'])
    settings = ServerSettings.from_args(args)
    assert (settings.reasoning_parser, settings.default_chat_template_kwargs) == ("deepseek_r1",
                                                                                  {"enable_thinking": False})
    assert check_vllm_flags(["m", "--reasoning-parser", "qwen3"]) == (["m", "--reasoning-parser", "qwen3"], [])
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--reasoning-parser", "o1"])
    assert "invalid choice: 'o1' (choose from 'deepseek_r1', 'qwen3'," in capsys.readouterr().err
    for bad, message in (("{", "--default-chat-template-kwargs is not valid JSON"), ("[1]", "must be a JSON object")):
        with pytest.raises(ValueError, match=message):
            ServerSettings.from_args(serve_parser().parse_args(["--default-chat-template-kwargs", bad]))
    kwargs = llm_kwargs_from_args(serve_parser().parse_args(["--reasoning-parser", "qwen3", "--reasoning-config",
                                                             '{"reasoning_end_str": "Done.</think>"}']))
    assert (kwargs["reasoning_parser"], kwargs["reasoning_config"]) == ("qwen3", {"reasoning_end_str": "Done.</think>"})
    kwargs = llm_kwargs_from_args(serve_parser().parse_args(["--structured-outputs-config",
                                                             '{"enable_in_reasoning": true, "backend": "guidance"}']))
    assert StructuredOutputsConfig.of(kwargs["structured_outputs_config"]).enable_in_reasoning
    for bad, words in (({"backend": "xgrammar"}, "llguidance"), ({"disable_any_whitespace": True}, "not supported"),
                       ({"enable_in_reasoning": "yes"}, "boolean"), ({"in_reasoning": True}, "takes backend")):
        with pytest.raises(ValueError, match=words):
            StructuredOutputsConfig.of(bad)


def test_pooling_flags_reach_the_llm(tiny_llama: TinyModel, capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's --runner, --convert, --task, --pooler-config and --hf-overrides, taken now (no longer refused)."""
    parser = serve_parser()
    args = parser.parse_args([str(tiny_llama.path), "--task", "embed", "--pooler-config", '{"pooling_type": "MEAN"}',
                              "--hf-overrides", '{"is_matryoshka": true}', "--dtype", "float32", "--num-blocks", "64"])
    kwargs = llm_kwargs_from_args(args)
    assert (kwargs["runner"], kwargs["convert"], kwargs["task"]) == ("auto", "auto", "embed")
    assert kwargs["hf_overrides"] == {"is_matryoshka": True}
    llm = LLM(**kwargs)
    assert (llm.pooling_task, llm.engine.pooler.pooling_type, llm.engine.input_processor.matryoshka) == ("embed",
                                                                                                        "MEAN", [])
    for flag in ("--task", "--runner", "--hf-overrides"):
        assert flag not in UNSUPPORTED
    with pytest.raises(ValueError, match="--hf-overrides is not valid JSON"):
        llm_kwargs_from_args(parser.parse_args(["--hf-overrides", "{"]))
    assert main(["generate", str(tiny_llama.path), "w5", "--raw", "--runner", "pooling", "--dtype", "float32",
                 "--num-blocks", "64"]) == 2
    assert "this is a pooling model" in capsys.readouterr().err
