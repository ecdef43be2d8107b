"""Greedy outputs equal Hugging Face transformers' (fp32, eager attention), token for token."""

from __future__ import annotations

import pytest
import torch
import transformers

from conveyor import LLM, SamplingParams
from conveyor.models import build_model
from conveyor.models.loader import load_checkpoint

from tests.utils import (LENGTHS, MAX_NEW, MOE_CONFIGS, ROPE_BY_LENGTH_CONFIGS, TINY_CONFIGS, TinyModel,
                         assert_greedy_match, hf_greedy, next_token_logprobs, random_prompts, run_and_compare)


@pytest.mark.parametrize("kind", list(TINY_CONFIGS))
def test_tiny_models_match_transformers(tiny_models: dict[str, TinyModel], kind: str) -> None:
    model = tiny_models[kind]
    llm = model.llm(max_batch_tokens=64)
    run_and_compare(model, llm, random_prompts(LENGTHS), MAX_NEW, kind)
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_total_blocks


def reference_logprobs(model: TinyModel, prompts: list[list[int]]) -> torch.Tensor:
    """transformers' log-probabilities of each prompt's next token."""
    with torch.inference_mode():
        return torch.stack([torch.log_softmax(model.reference(torch.tensor([p])).logits[0, -1].float(), -1)
                            for p in prompts])


@pytest.mark.parametrize("kind", list(TINY_CONFIGS) + list(MOE_CONFIGS))
def test_norms_in_place_match_transformers(kind: str, tmp_path) -> None:
    """Every family with its norm weights drawn away from their initial ones (which would let a norm move
    across RoPE, or be read into another norm's place, unseen): the next tokens' log-probabilities."""
    model = TinyModel(kind, tmp_path, (TINY_CONFIGS.get(kind) or MOE_CONFIGS[kind])())
    with torch.no_grad():
        for name, param in model.reference.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.reference.save_pretrained(model.path)
    prompts = random_prompts([5, 30, 64])
    torch.testing.assert_close(next_token_logprobs(model.llm(max_batch_tokens=64), prompts),
                               reference_logprobs(model, prompts), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("kind", "supported"), [("arcee", "relu2"), ("glm", "silu"), ("phi4", "silu"),
                                               ("starcoder2", "gelu_pytorch_tanh"), ("mixtral", "silu")])
def test_an_activation_the_layers_do_not_compute_is_refused(kind: str, supported: str) -> None:
    """A family whose layers compute one activation names the config's other one and its own."""
    config = (TINY_CONFIGS.get(kind) or ROPE_BY_LENGTH_CONFIGS.get(kind) or MOE_CONFIGS[kind])()
    config.hidden_act = "gelu_new"
    with pytest.raises(ValueError, match=f"hidden_act 'gelu_new' is not supported for {config.model_type} "
                                         rf"\(supported: {supported}\)"):
        build_model(config, {}, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("kind", ["granite", "cohere"])
def test_scaled_logits_give_transformers_log_probs(tiny_models: dict[str, TinyModel], kind: str) -> None:
    """Granite divides its logits by `logits_scaling` (4 here), Cohere multiplies them by `logit_scale` (0.25),
    which leaves the argmax alone: the next tokens' log-probabilities equal transformers'."""
    model = tiny_models[kind]
    prompts = random_prompts([5, 9, 14], seed=21)
    torch.testing.assert_close(next_token_logprobs(model.llm(), prompts), reference_logprobs(model, prompts),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("max_batch_tokens", "max_requests_per_batch", "page_size"), [
    (16, 64, 4), (16, 1, 16), (4096, 64, 16), (4096, 1, 256), (16, 64, 256), (37, 3, 4)])
def test_outputs_independent_of_batching_limits(tiny_llama: TinyModel, max_batch_tokens: int,
                                                max_requests_per_batch: int, page_size: int) -> None:
    llm = tiny_llama.llm(max_batch_tokens=max_batch_tokens, max_requests_per_batch=max_requests_per_batch,
                         page_size=page_size, num_blocks=max(4096 // page_size, 16))
    run_and_compare(tiny_llama, llm, random_prompts(LENGTHS), MAX_NEW,
                    f"tokens={max_batch_tokens} requests={max_requests_per_batch} page={page_size}")
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_total_blocks


def test_outputs_independent_of_arrival_order(tiny_llama: TinyModel) -> None:
    """Requests joining a running batch at different steps still get the reference output."""
    llm = tiny_llama.llm(max_batch_tokens=32, page_size=4)
    engine = llm.engine
    prompts = random_prompts(LENGTHS, seed=3)
    order = [5, 2, 7, 0, 1, 6, 3, 4]
    requests = {}
    for step, i in enumerate(order):
        requests[i] = engine.make_request(f"r{i}", prompts[i], SamplingParams(max_new_tokens=MAX_NEW[i],
                                                                              temperature=0, ignore_eos=True))
        engine.add_request(requests[i])
        for _ in range(step % 3):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    for i, prompt in enumerate(prompts):
        ref, logits = hf_greedy(tiny_llama.reference, prompt, MAX_NEW[i])
        assert_greedy_match(requests[i].output_token_ids, ref, logits, f"arrival prompt {i}")
    assert engine.allocator.num_free_blocks == engine.allocator.num_total_blocks


def test_preempted_requests_keep_their_outputs(tiny_llama: TinyModel) -> None:
    """A pool too small for every request at once forces soft resets; outputs stay exact."""
    llm = tiny_llama.llm(page_size=4, num_blocks=40, max_batch_tokens=64, safety_margin=0.0)
    prompts = random_prompts([30, 25, 40, 20, 35, 10], seed=5)
    max_new = [40, 30, 20, 45, 25, 50]
    run_and_compare(tiny_llama, llm, prompts, max_new, "small pool")
    stats = llm.stats()
    assert stats.soft_resets > 0, "the pool was meant to be too small to hold every request"
    assert stats.prefill_tokens > sum(map(len, prompts)), "a soft reset recomputes the tokens it dropped"
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_total_blocks


@pytest.mark.slow
def test_builtin_smollm2_matches_transformers() -> None:
    """The built-in model on 8 chat prompts of different lengths, all in one continuous batch."""
    llm = LLM(dtype="float32")  # the exact path: the file's weights dequantized, fp32 everywhere
    checkpoint = load_checkpoint(None)
    reference = transformers.LlamaForCausalLM(checkpoint.config).eval()
    reference.load_state_dict(checkpoint.state_dict, strict=False)
    reference.tie_weights()
    questions = ["Hi.", "Write one sentence about the moon.", "Give three facts about photosynthesis.",
                 "Explain TCP handshakes to a child in a short paragraph.", "What is 2 + 2?",
                 "Write a short poem about bread baking, with a title and two stanzas of four lines each.",
                 "Translate 'good morning' into French.",
                 "Summarise the plot of a story where a robot learns to paint, in three sentences, and then "
                 "explain what the story says about creativity and whether machines can have it."]
    prompts = [llm.render_chat([{"role": "user", "content": q}]) for q in questions]
    assert len({len(p) for p in prompts}) == len(prompts)
    max_new = [8, 20, 24, 16, 6, 24, 10, 18]
    params = [SamplingParams(max_new_tokens=n, temperature=0) for n in max_new]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for i, (prompt, n, out) in enumerate(zip(prompts, max_new, outputs)):
        ref, logits = hf_greedy(reference, prompt, n, eos_token_id=checkpoint.config.eos_token_id)
        if ref and ref[-1] == checkpoint.config.eos_token_id:
            assert out.finish_reason == "stop"
        assert_greedy_match(out.token_ids, ref, logits, f"SmolLM2 prompt {i}")
        assert out.text == llm.get_tokenizer().decode(out.token_ids, skip_special_tokens=True)
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_total_blocks
    torch.testing.assert_close(llm.engine.model.embed_tokens.weight, checkpoint.state_dict["model.embed_tokens.weight"])
