"""Speculative decoding end to end: outputs equal speculation off (greedy, fp32; seeded sampling),
stops cut exactly, rejected positions' blocks come back, draft models and the self-draft."""

from __future__ import annotations

import inspect

import pytest
import transformers

from conveyor import LLM, ContinuousBatchingConfig, SamplingParams
from conveyor.engine.draft_runner import load_draft_model

from tests.utils import NGRAM, TINY_COMMON, TinyModel, copy_prompts, tiny_tokenizer


def mixed_params() -> list[SamplingParams]:
    """Mostly greedy speculating requests; one with a penalty (it never speculates)."""
    params = [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True) for n in (30, 17, 25, 9, 40, 22)]
    return params + [SamplingParams(temperature=0, max_new_tokens=20, repetition_penalty=1.3, ignore_eos=True)]


def generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def baseline(tiny_llama: TinyModel, one_thread: None) -> LLM:
    return tiny_llama.llm(max_batch_tokens=32)


def spec_stats(llm: LLM) -> dict:
    speculator = llm.engine.speculator
    assert speculator is not None
    return speculator.stats()


def assert_idle(llm: LLM) -> None:
    allocator = llm.engine.allocator
    assert allocator.num_free_blocks == allocator.num_total_blocks, "blocks still held after every request ended"


@pytest.mark.parametrize("kind", ["llama", "llama_smooth"])  # mostly rejected / mostly accepted proposals
def test_greedy_outputs_equal_speculation_off_in_mixed_batches(tiny_models: dict[str, TinyModel], kind: str,
                                                              one_thread: None) -> None:
    model = tiny_models[kind]
    spec = model.llm(max_batch_tokens=32, speculative_config=NGRAM)
    prompts, params = copy_prompts(), mixed_params()
    assert generate(spec, prompts, params) == generate(model.llm(max_batch_tokens=32), prompts, params)
    stats = spec_stats(spec)
    assert stats["num_drafts"] > 0 and stats["num_accepted_tokens"] <= stats["num_draft_tokens"]
    if kind == "llama_smooth":  # its outputs repeat: long accepted runs
        assert stats["num_accepted_tokens"] > stats["num_draft_tokens"] / 2
    assert_idle(spec)


def test_speculation_in_padded_steps_equals_speculation_off(tiny_models: dict[str, TinyModel],
                                                           one_thread: None) -> None:
    """Padded steps (the CUDA-graph shapes) move a speculating chunk's verify rows with the padding."""
    model = tiny_models["llama_smooth"]
    spec = model.llm(max_batch_tokens=32, speculative_config=NGRAM, pad_steps=True)
    prompts, params = copy_prompts(), mixed_params()
    assert generate(spec, prompts, params) == generate(model.llm(max_batch_tokens=32), prompts, params)
    assert spec_stats(spec)["num_accepted_tokens"] > 0
    assert_idle(spec)


def test_stops_inside_accepted_runs_cut_exactly(tiny_models: dict[str, TinyModel], one_thread: None) -> None:
    """The smooth model repeats a token: its proposals are accepted in runs, and each stop falls inside one."""
    model = tiny_models["llama_smooth"]
    spec, baseline = model.llm(max_batch_tokens=32, speculative_config=NGRAM), model.llm(max_batch_tokens=32)
    prompts = copy_prompts()[:3]
    free = baseline.generate(prompts, SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True),
                             use_tqdm=False)
    params = [SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True, stop=[free[0].text[9:17]]),
              SamplingParams(temperature=0, max_new_tokens=30, stop_token_ids=[free[1].token_ids[-1]]),
              SamplingParams(temperature=0, max_new_tokens=11, ignore_eos=True)]
    ours = spec.generate(prompts, params, use_tqdm=False)
    ref = baseline.generate(prompts, params, use_tqdm=False)
    assert [(o.token_ids, o.text, o.finish_reason) for o in ours] == [(o.token_ids, o.text, o.finish_reason)
                                                                       for o in ref]
    assert [o.finish_reason for o in ours] == ["stop", "stop", "length"]
    assert len(ours[0].token_ids) < 6 and len(ours[2].token_ids) == 11
    assert spec_stats(spec)["num_accepted_tokens"] > 0
    assert_idle(spec)


def test_seeded_sampling_is_reproducible_with_speculation(tiny_llama: TinyModel, baseline: LLM) -> None:
    spec = tiny_llama.llm(max_batch_tokens=32, speculative_config=NGRAM)
    prompts = copy_prompts()[:4]
    seeded = [SamplingParams(temperature=0.8, top_k=20, seed=7 + i, max_new_tokens=25, ignore_eos=True)
              for i in range(4)]
    alone = generate(spec, prompts[:1], seeded[:1])
    together = generate(spec, prompts, seeded)
    assert together[0] == alone[0]
    assert together == generate(baseline, prompts, seeded)  # the very tokens of speculation off
    assert spec_stats(spec)["num_drafts"] > 0


def test_rollback_trims_blocks_and_cancelling_mid_verification_returns_them(tiny_models: dict[str, TinyModel],
                                                                           one_thread: None) -> None:
    llm = tiny_models["llama"].llm(max_batch_tokens=32, page_size=2, speculative_config=NGRAM)
    engine, allocator = llm.engine, llm.engine.allocator
    engine.add_request(engine.make_request("r", copy_prompts()[0], SamplingParams(temperature=0, max_new_tokens=60,
                                                                                   ignore_eos=True)))
    request = engine.requests["r"]
    while not request.is_finished:
        engine.step()
        if not request.is_finished:  # blocks cover the K/V kept, not the rejected proposals
            assert len(allocator.block_table("r")) == allocator.blocks_for_tokens(request.num_computed_tokens)
    stats = spec_stats(llm)
    assert stats["num_draft_tokens"] > stats["num_accepted_tokens"]  # some were rejected
    assert_idle(llm)

    llm = tiny_models["llama_smooth"].llm(max_batch_tokens=32, speculative_config=NGRAM)
    engine = llm.engine
    engine.add_request(engine.make_request("c", copy_prompts()[0], SamplingParams(temperature=0, max_new_tokens=60,
                                                                                   ignore_eos=True)))
    request, run = engine.requests["c"], engine.runner.execute

    def cancel_during(chunks):  # the request is cancelled while its verification pass runs
        result = run(chunks)
        if any(c.draft_tokens for c in chunks):
            engine.cancel_request("c")
        return result

    engine.runner.execute = cancel_during
    while not request.is_finished:
        before = len(request.output_token_ids)
        engine.step()
    assert len(request.output_token_ids) == before and request.finish_reason == "abort"
    assert spec_stats(llm)["num_drafts"] == 0  # the cancelled run was not counted
    assert_idle(llm)


def test_draft_models_and_self_draft_equal_speculation_off(tiny_models: dict[str, TinyModel], baseline: LLM) -> None:
    prompts, params = copy_prompts(), mixed_params()
    ref = generate(baseline, prompts, params)
    for draft in ({"model": str(tiny_models["llama_tied"].path)}, {"quantization": "int4"}):
        spec = tiny_models["llama"].llm(max_batch_tokens=32, speculative_config={
            "method": "draft_model", "num_speculative_tokens": 3, "disable_by_batch_size": 64, **draft})
        assert generate(spec, prompts, params) == ref, draft
        stats = spec_stats(spec)
        assert stats["num_drafts"] > 0, draft
        assert_idle(spec)
    assert stats["num_accepted_tokens"] > 0  # the target's own weights in int4 guess right now and then


def test_bad_speculative_configs_name_the_field(tiny_llama: TinyModel, tmp_path) -> None:
    for bad, field in (({"method": "eagle", "num_speculative_tokens": 2}, "method"),
                       ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens")):
        with pytest.raises(ValueError, match=field):
            ContinuousBatchingConfig(speculative_config=bad)
    with pytest.raises(ValueError, match="use_async_batching"):
        ContinuousBatchingConfig(speculative_config=NGRAM, use_async_batching=True)
    config = transformers.LlamaConfig(**(TINY_COMMON | {"vocab_size": 320}))
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    llm = tiny_llama.llm()
    spec = ContinuousBatchingConfig(speculative_config={"method": "draft_model", "model": str(tmp_path),
                                                        "num_speculative_tokens": 2}).speculative_config
    with pytest.raises(ValueError, match="speculative_config.model.*vocabulary"):
        load_draft_model(spec, tiny_llama.path, llm.engine.model, llm.device)


def test_counters_in_stats_and_metrics_and_the_options(tiny_models: dict[str, TinyModel], one_thread: None) -> None:
    from conveyor.bench.workloads import copy_workload
    from conveyor.cli_args import add_engine_args, config_from_args
    from conveyor.server.metrics import ServerMetrics

    llm = tiny_models["llama_smooth"].llm(max_batch_tokens=32, speculative_config=NGRAM)
    generate(llm, copy_prompts()[:3], [SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)] * 3)
    s = llm.stats()
    assert s.spec_decode_num_drafts > 0 and len(s.spec_decode_num_accepted_tokens_per_pos) == 3
    assert s.spec_decode_num_accepted_tokens == sum(s.spec_decode_num_accepted_tokens_per_pos) > 0
    text = ServerMetrics(llm.stats, "m").render().decode()
    accepted = float(s.spec_decode_num_accepted_tokens)
    assert f'conveyor:spec_decode_num_accepted_tokens_total{{model_name="m"}} {accepted}' in text
    assert 'conveyor:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"}' in text
    from conveyor.metrics import Counter, Histogram, Vector

    metrics = {m.name: m for m in llm.get_metrics()}  # vLLM's offline reader, as its spec-decode example reads it
    per_pos = metrics["conveyor:spec_decode_num_accepted_tokens_per_pos"]
    assert isinstance(per_pos, Vector) and per_pos.values == s.spec_decode_num_accepted_tokens_per_pos
    drafts = metrics["conveyor:spec_decode_num_drafts"]
    assert isinstance(drafts, Counter) and drafts.value == s.spec_decode_num_drafts
    ttft = metrics["conveyor:time_to_first_token_seconds"]
    assert isinstance(ttft, Histogram) and ttft.count == 3 and ttft.buckets["+Inf"] == 3 and ttft.sum > 0
    assert metrics["conveyor:num_requests_running"].value == 0

    import argparse
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'])
    config = config_from_args(args)
    assert config.speculative_config.num_speculative_tokens == 4 and config.speculative_config.prompt_lookup_max == 3
    with pytest.raises(ValueError, match="speculative_config"):
        config_from_args(parser.parse_args(["--speculative-config", "{method: ngram}"]))
    workload = copy_workload(3, 64)
    assert len(workload) == 3 and all("river rose slowly" in r.prompt for r in workload.requests)


@pytest.mark.slow
def test_builtin_model_copy_prompt_equals_speculation_off() -> None:
    """The built-in model, exact path, a copy-heavy prompt: same tokens, most proposals accepted."""
    from conveyor.bench.workloads import copy_workload

    prompt = copy_workload(1, 64).requests[0].prompt
    params = SamplingParams(temperature=0, max_new_tokens=64)
    spec = LLM(dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    ours = spec.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)[0]
    ref = LLM(dtype="float32").chat([{"role": "user", "content": prompt}], params, use_tqdm=False)[0]
    assert ours.token_ids == ref.token_ids
    s = spec.stats()
    assert s.spec_decode_num_accepted_tokens > s.spec_decode_num_draft_tokens / 2


def test_constrained_and_biased_requests_do_not_speculate_beside_those_that_do(tiny_models: dict[str, TinyModel],
                                                                             one_thread: None) -> None:
    """A grammar or a logit_bias changes the distribution verification would check against: such
    requests decode plainly in a speculating engine, with the tokens of a plain engine."""
    from conveyor.request import Request
    from conveyor.speculative import Speculator

    model = tiny_models["llama_smooth"]
    spec = model.llm(max_batch_tokens=32, speculative_config=NGRAM)
    prompts = copy_prompts()[:2]
    params = [SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True, logit_bias={7: 5.0, 9: -100.0})]
    assert generate(spec, prompts, params) == generate(model.llm(max_batch_tokens=32), prompts, params)
    assert 0 < spec_stats(spec)["num_drafts"] <= 20  # only the plain request proposed
    assert_idle(spec)
    constrained = Request("c", [5, 6, 7], SamplingParams(temperature=0))
    assert Speculator.serves(constrained)
    constrained.grammar = object()  # a matcher (the tiny tokenizer has no llguidance decoder)
    assert not Speculator.serves(constrained)


def test_speculating_rows_run_in_the_decode_stack_and_equal_speculation_off(tiny_models: dict[str, TinyModel]) -> None:
    """Quantized weights: a speculating chunk runs as decode rows through the native decode stack (its
    rows' K/V stored before any row attends), whose rows do not depend on each other, so even outside
    the fp32 exact path greedy tokens equal speculation off. Every prompt prefills whole in the first
    step of both runs: in bf16 where a prompt is cut into chunks changes the order its attention sums
    in (context from the cache, then the chunk's own keys), which the batches of the two runs would
    cut differently."""
    model = tiny_models["llama_smooth"]
    spec = model.llm(dtype="auto", quantization="int8", max_batch_tokens=256, speculative_config=NGRAM)
    stack = spec.engine.model.decode_stack
    assert stack is not None and spec.engine.runner.drafts_decode
    native, shared = stack.native, []

    class Recorder:  # the stack's native object, recording its `shared_rows` argument
        def forward(self, *args):
            shared.append(inspect.signature(native.forward).bind(*args).arguments["shared_rows"])
            return native.forward(*args)

    stack.native = Recorder()
    prompts, params = copy_prompts(), mixed_params()
    plain = model.llm(dtype="auto", quantization="int8", max_batch_tokens=256)
    assert generate(spec, prompts, params) == generate(plain, prompts, params)
    assert any(shared) and spec_stats(spec)["num_accepted_tokens"] > 0
    assert_idle(spec)
