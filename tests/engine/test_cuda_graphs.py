"""CUDA graphs: configuration on every machine; capture and replay (graphs on vs off identical) on CUDA."""

from __future__ import annotations

import pytest
import torch

from conveyor import ContinuousBatchingConfig, SamplingParams
from conveyor.engine.graph_runner import graph_tokens, use_cuda_graphs
from conveyor.engine.stats import EngineStats
from conveyor.metrics import EngineStatsCollector

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_use_cuda_graph_resolves_per_device() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert use_cuda_graphs(ContinuousBatchingConfig(), cpu) is False
    assert use_cuda_graphs(ContinuousBatchingConfig(), gpu) is True
    assert use_cuda_graphs(ContinuousBatchingConfig(use_cuda_graph=False), gpu) is False
    with pytest.raises(ValueError, match="use_cuda_graph=True needs a CUDA device"):
        use_cuda_graphs(ContinuousBatchingConfig(use_cuda_graph=True), cpu)
    with pytest.raises(ValueError, match="pad_steps"):
        use_cuda_graphs(ContinuousBatchingConfig(use_cuda_graph=True, pad_steps=False), gpu)
    assert graph_tokens(ContinuousBatchingConfig(max_requests_per_batch=20, q_padding_interval_size=16)) == 32


def test_use_cuda_graph_true_on_cpu_is_refused(tiny_models) -> None:
    with pytest.raises(ValueError, match="use_cuda_graph=True needs a CUDA device"):
        tiny_models["llama"].llm(use_cuda_graph=True)


def test_graph_counters_are_exported() -> None:
    stats = EngineStats(cuda_graph_captures=3, cuda_graph_replays=40, cuda_graph_eager_steps=5)
    values = {m.name: m.samples[0].value for m in EngineStatsCollector(lambda: stats, "m").collect()}
    assert values["conveyor:cuda_graph_captures"] == 3
    assert values["conveyor:cuda_graph_replays"] == 40
    assert values["conveyor:cuda_graph_eager_steps"] == 5


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_graphs_on_and_off_give_the_same_tokens(tiny_models, kind: str) -> None:
    from conveyor import LLM

    model = tiny_models[kind]
    prompts = [[5 + i + j for j in range(n)] for i, n in enumerate((3, 17, 30, 9, 5))]
    params = [SamplingParams(max_new_tokens=6 + 3 * i, temperature=0, ignore_eos=True) for i in range(len(prompts))]

    def run(graphs: bool) -> tuple[list[list[int]], LLM]:
        llm = LLM(model.path, dtype="float32", device="cuda",
                  config=ContinuousBatchingConfig(num_blocks=256, use_cuda_graph=graphs, max_batch_tokens=40))
        return [o.token_ids for o in llm.generate(prompts, params)], llm

    eager, _ = run(False)
    graphed, llm = run(True)
    assert graphed == eager
    stats = llm.stats()
    assert stats.cuda_graph_captures > 0 and stats.cuda_graph_replays > stats.cuda_graph_captures
    assert stats.cuda_graph_eager_steps > 0  # the prefill steps
    assert stats.free_blocks == stats.total_blocks


@pytest.mark.cuda
@cuda
def test_graphs_with_async_batching_give_the_same_tokens_and_return_every_block(tiny_models) -> None:
    """The CUDA default (graphs + async batching, the tokens read back through the copy stream) equals
    the eager synchronous run, with a seeded sampled request and a cancel in the mix."""
    from conveyor import LLM

    model = tiny_models["llama"]
    prompts = [[5 + i + j for j in range(n)] for i, n in enumerate((3, 17, 30, 9, 5))]
    params = [SamplingParams(max_new_tokens=8 + 2 * i, temperature=0, ignore_eos=True) for i in range(len(prompts))]
    params[2] = SamplingParams(max_new_tokens=12, temperature=0.8, seed=7, ignore_eos=True)

    def run(fast: bool) -> tuple[list[list[int]], LLM]:
        llm = LLM(model.path, dtype="float32", device="cuda", config=ContinuousBatchingConfig(
            num_blocks=256, use_cuda_graph=fast, use_async_batching=fast, max_batch_tokens=40))
        return [o.token_ids for o in llm.generate(prompts, params)], llm

    eager, _ = run(False)
    fast, llm = run(True)
    assert fast == eager
    stats = llm.stats()
    assert stats.cuda_graph_replays > 0 and stats.free_blocks == stats.total_blocks


def test_cli_graph_and_async_flags() -> None:
    """Unset = auto (None); --no-use-cuda-graph and vLLM's --enforce-eager turn graphs off."""
    import argparse

    from conveyor.cli_args import add_engine_args, config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    auto = config_from_args(parser.parse_args([]))
    assert auto.use_cuda_graph is None and auto.use_async_batching is None and auto.pad_steps is None
    assert config_from_args(parser.parse_args(["--enforce-eager"])).use_cuda_graph is False
    chosen = config_from_args(parser.parse_args(["--no-use-cuda-graph", "--use-async-batching", "--pad-steps"]))
    assert (chosen.use_cuda_graph, chosen.use_async_batching, chosen.pad_steps) == (False, True, True)
