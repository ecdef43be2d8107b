"""The one table of quantization formats, the one of scheduler types and the one of reasoning parsers are
what every reader reads (the CLI, precision resolution, weight planning, `SpeculativeConfig`,
`ContinuousBatchingConfig`, the server's parser lookup); engine errors carry a code and the parameter
at fault."""

from __future__ import annotations

import argparse

import pytest
import torch

from conveyor import ContinuousBatchingConfig, SamplingParams
from conveyor.cli_args import add_engine_args, add_serve_args
from conveyor.errors import ConfigError, InvalidRequestError, RequestErrorCode
from conveyor.layers.precision import resolve_precision
from conveyor.layers.quantization.linear import plan_weights
from conveyor.layers.quantization.registry import QUANTIZATION_METHODS, QUANTIZATIONS, QuantizationMethod
from conveyor.layers.quantization.tensors import type_name
from conveyor.sampling_params import StructuredOutputsParams
from conveyor.reasoning import REASONING_PARSERS, get_reasoning_parser
from conveyor.reasoning.think_tags import Qwen3Parser
from conveyor.sched.scheduler import SCHEDULERS, FIFOScheduler, Scheduler
from conveyor.speculative import SpeculativeConfig

from tests.utils import TinyModel


def choices(parser: argparse.ArgumentParser, dest: str) -> list[str]:
    return next(a.choices for a in parser._actions if a.dest == dest)  # argparse keeps them there


def test_the_cli_offers_the_tables() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert list(QUANTIZATIONS) == ["none", "int8", "int4", "gguf", "mxfp4", "compressed-tensors", "gptq", "awq"]
    assert list(choices(parser, "quantization")) == [*QUANTIZATIONS, "gptq_marlin", "awq_marlin"]  # (vLLM's names)
    assert list(choices(parser, "scheduler_type")) == list(SCHEDULERS) == ["fifo", "prefill_first", "priority"]


def test_each_format_quantizes_into_its_weight_types() -> None:
    weight = torch.randn(8, 64)
    for method in QUANTIZATION_METHODS.values():
        planned = plan_weights({"w.weight": weight}, method.name, torch.float32, {"w.weight"})["w.weight"]
        if method.quantize is None:
            assert isinstance(planned, torch.Tensor)  # "gguf" keeps stored tensors; float ones stay dense
        else:
            assert [type_name(t.qtype) for t in planned] == list(method.weight_types), method.name
    assert [m.name for m in QUANTIZATION_METHODS.values() if m.dense] == ["none"]
    assert [m.name for m in QUANTIZATION_METHODS.values() if m.keeps_stored] == ["gguf", "mxfp4", "compressed-tensors",
                                                                                     "gptq", "awq"]


def test_a_new_row_reaches_every_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    """Adding a format is a row: precision accepts it on its devices, planning quantizes with it, and a
    self-draft format is taken by `SpeculativeConfig`."""
    halves = QuantizationMethod("halves", QUANTIZATION_METHODS["int8"].quantize, ("I8",), ("cpu",),
                                self_draft=True)  # int8 under another name
    monkeypatch.setitem(QUANTIZATION_METHODS, "halves", halves)
    cpu = torch.device("cpu")
    assert resolve_precision("bfloat16", "halves", cpu, "/hf-dir").quantization == "halves"
    with pytest.raises(ValueError, match="runs on CPU only"):
        resolve_precision("bfloat16", "halves", torch.device("cuda"), "/hf-dir")
    with pytest.raises(ValueError, match="exact path"):
        resolve_precision("float32", "halves", cpu, "/hf-dir")
    [planned] = plan_weights({"w.weight": torch.randn(4, 32)}, "halves", torch.float32, {"w.weight"})["w.weight"]
    assert type_name(planned.qtype) == "I8"
    assert SpeculativeConfig.from_dict({"method": "draft_model", "num_speculative_tokens": 2,
                                        "quantization": "halves"}).self_draft
    with pytest.raises(ValueError, match="quantization must be one of"):
        SpeculativeConfig.from_dict({"method": "draft_model", "num_speculative_tokens": 2, "quantization": "none"})


def test_scheduler_types_bring_their_default_margin(monkeypatch: pytest.MonkeyPatch) -> None:
    class Lifo(FIFOScheduler):
        default_safety_margin = 0.3

    assert issubclass(SCHEDULERS["prefill_first"], Scheduler)
    with pytest.raises(ConfigError, match="scheduler_type must be one of"):
        ContinuousBatchingConfig(scheduler_type="lifo")
    monkeypatch.setitem(SCHEDULERS, "lifo", Lifo)
    assert ContinuousBatchingConfig(scheduler_type="lifo").safety_margin == 0.3


def test_invalid_requests_carry_a_code_and_the_parameter(tiny_llama: TinyModel) -> None:
    llm = tiny_llama.llm()
    cases = [
        ([], SamplingParams(), RequestErrorCode.INVALID_PROMPT, "prompt"),
        ([1] * llm.max_model_len, SamplingParams(max_new_tokens=1), RequestErrorCode.CONTEXT_LENGTH_EXCEEDED, None),
        ([1, 2], SamplingParams(logit_bias={llm.vocab_size: 1.0}), RequestErrorCode.INVALID_VALUE, "logit_bias"),
        ([1, 2], SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")),
         RequestErrorCode.INVALID_STRUCTURED_OUTPUTS, "structured_outputs"),
    ]
    for prompt, params, code, param in cases:
        with pytest.raises(InvalidRequestError) as info:
            llm.make_request("r", prompt, params)
        assert (info.value.code, info.value.param) == (code, param), str(info.value)
    request = llm.make_request("dup", [1, 2], SamplingParams(max_new_tokens=1))
    llm.engine.add_request(request)
    with pytest.raises(InvalidRequestError) as info:
        llm.engine.add_request(llm.make_request("dup", [1, 2], SamplingParams(max_new_tokens=1)))
    assert info.value.code is RequestErrorCode.DUPLICATE_REQUEST_ID
    llm.engine.cancel_request("dup")
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_total_blocks


def test_a_reasoning_parser_row_reaches_the_cli_and_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    class Bracketed(Qwen3Parser):
        name = "bracketed"
        starts, ends = ("[[",), ("]]",)

    monkeypatch.setitem(REASONING_PARSERS, "bracketed", Bracketed)
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert "bracketed" in choices(parser, "reasoning_parser")
    assert get_reasoning_parser("bracketed")().parse("[[why]] so") == ("why", "so")
