"""The device-side sampler against a row-by-row reference, and the transfer helpers it uses."""

from __future__ import annotations

import pytest
import torch

from conveyor.cache.transfer import HostCopy, to_device
from conveyor.kernels import cpu_sampling_ops
from conveyor.layers.sampler import SampledBatch, Sampler
from conveyor.request import Request
from conveyor.sampling_params import SamplingParams

VOCAB = 50


def _request(i: int, seed: int | None = None, **params: object) -> Request:
    request = Request(f"r{i}", [3, 4, 5], SamplingParams(max_new_tokens=8, seed=seed, **params))
    request.output_token_ids = [7, 7, 9]
    if seed is not None and not request.params.greedy:
        request.generator = torch.Generator().manual_seed(seed)
    return request


def _reference_row(row: torch.Tensor, request: Request) -> int:
    """One row alone, written out plainly: penalties, temperature, top-k, top-p, min-p, then the first
    token whose running probability passes the row's uniform number (the seed's first draw)."""
    p = request.params
    row = row.clone()
    if p.repetition_penalty != 1.0:
        for t in set(request.prompt_token_ids + request.output_token_ids):
            row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    if p.greedy:
        return int(row.argmax())
    row = row / p.temperature
    if p.top_k:
        row[row < row.sort(descending=True).values[p.top_k - 1]] = float("-inf")
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        drop = (sorted_probs.cumsum(0) - sorted_probs) > p.top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    if p.min_p:
        probs = probs.masked_fill(probs < probs.max() * p.min_p, 0.0)
    u = torch.rand(1, dtype=torch.float64, generator=torch.Generator().manual_seed(p.seed)).item()
    cum = probs.double().cumsum(0)
    return int((cum > u * cum[-1]).nonzero()[0])


def test_sampler_matches_a_row_by_row_reference() -> None:
    requests = [_request(0, temperature=0), _request(1, seed=11, temperature=0.7, top_k=5),
                _request(2, temperature=0, repetition_penalty=1.3),
                _request(3, seed=12, temperature=1.0, top_p=0.8, min_p=0.05),
                _request(4, seed=13, temperature=1.5, logprobs=3), _request(5, temperature=0, logprobs=0)]
    logits = torch.randn(len(requests), VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    batch = Sampler().sample(logits, requests)
    assert isinstance(batch, SampledBatch) and batch.tokens.shape == (len(requests),)
    tokens, logprobs = batch.to_host()
    assert tokens == [_reference_row(logits[i], r) for i, r in enumerate(requests)]
    lp = torch.log_softmax(logits, dim=-1)
    assert logprobs[:4] == [None] * 4
    top = lp[4].topk(3)
    expected = dict(zip(top.indices.tolist(), top.values.tolist())) | {tokens[4]: lp[4, tokens[4]].item()}
    assert logprobs[4] == expected
    assert logprobs[5] == {tokens[5]: lp[5, tokens[5]].item()}  # logprobs=0: the chosen token only


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_sampling_rule_on_a_big_vocabulary(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The native kernel and PyTorch's `probs` + `draw` take the same token for the same uniforms over a
    49k vocabulary (top-k through a heap, top-p sorting only the tokens above a threshold; a masked token never drawn, even
    at u = 0), and the token frequencies of many draws follow the filtered distribution."""
    if native and cpu_sampling_ops() is None:
        pytest.skip("native kernels unavailable")
    if not native:
        monkeypatch.setattr("conveyor.layers.sampler.cpu_sampling_ops", lambda: None)
    vocab = 49152
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, vocab, generator=g) * 4
    logits[:, 0] = -1e30  # a grammar mask
    settings = [dict(temperature=0.7), dict(temperature=1.0, top_k=40), dict(temperature=0.9, top_p=0.9),
                dict(temperature=1.3, top_p=0.5, min_p=0.05), dict(temperature=0.5, min_p=0.2),
                dict(temperature=2.0, top_k=1000, top_p=0.95)]
    requests = [_request(i, **kw) for i, kw in enumerate(settings)]
    probs = Sampler.probs(logits, requests)
    for _ in range(20):
        u = torch.rand(6, dtype=torch.float64, generator=g)
        tokens = Sampler.sample_with(logits, requests, u)
        assert torch.equal(tokens, Sampler.draw(probs, u)), (u, tokens)
    for u in (0.0, 1 - 2**-40):  # the ends, where rounding picks among the least likely tokens: never a masked one
        tokens = Sampler.sample_with(logits, requests, torch.full((6,), u, dtype=torch.float64))
        assert (tokens != 0).all(), (u, tokens)
    row = logits[2:3].repeat(1500, 1)  # top-p 0.9 at temperature 0.9: draws follow the kept probabilities
    drawn = Sampler.sample_with(row, [requests[2]] * 1500, torch.rand(1500, dtype=torch.float64, generator=g))
    kept = probs[2] / probs[2].sum()
    top = kept.topk(5).indices
    freq = torch.stack([(drawn == t).float().mean() for t in top])
    assert (freq - kept[top]).abs().max() < 0.03, (freq, kept[top])


def test_native_batch_matches_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU greedy and sampled rows go through one native call: greedy rows take their first largest
    logit (ties included), sampled rows the same token as PyTorch's argmax + `probs` + `draw` for the same
    uniforms (seeded rows), on a vocabulary that is not a multiple of the kernel's blocks of 16; a greedy row with a seed
    leaves its generator alone."""
    if cpu_sampling_ops() is None:
        pytest.skip("native kernels unavailable")
    vocab = 1000
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, vocab, generator=g) * 2
    logits[0, 10] = logits[0, 700] = logits[0].max() + 1  # a tie: the first one wins
    requests = [_request(0, temperature=0), _request(1, seed=4, temperature=0.8),
                _request(2, seed=6, temperature=1.0, top_k=30), _request(3, temperature=1e-7),
                _request(4, seed=5, temperature=1.2, top_p=0.7)]
    requests[3].generator = torch.Generator().manual_seed(9)  # greedy (tiny temperature) but seeded
    untouched = requests[3].generator.get_state()
    for _ in range(30):
        seeded = [r.generator.get_state() for r in requests if r.generator is not None]
        torch.manual_seed(len(seeded))
        native = Sampler().sample(logits.clone(), requests).tokens
        for r, state in zip([r for r in requests if r.generator is not None], seeded):
            r.generator.set_state(state)
        monkeypatch.setattr("conveyor.layers.sampler.cpu_sampling_ops", lambda: None)
        torch.manual_seed(len(seeded))
        reference = Sampler().sample(logits.clone(), requests).tokens
        monkeypatch.undo()
        assert torch.equal(native, reference), (native, reference)
        assert native[0] == 10 and native[3] == logits[3].argmax()
    assert torch.equal(requests[3].generator.get_state(), untouched)


@pytest.mark.parametrize("temperature", [1e-300, 6e-173, 1e-6])
def test_a_tiny_temperature_is_greedy(temperature: float) -> None:
    """Dividing by a temperature that rounds to 0 in fp32 would make every logit infinite (a fuzzer's
    request once drew token -1): below 1e-5 a request decodes greedily, as in vLLM."""
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(2))
    requests = [_request(i, temperature=temperature) for i in range(3)]
    assert requests[0].params.greedy
    assert torch.equal(Sampler().sample(logits.clone(), requests).tokens, logits.argmax(dim=-1))


def test_transfers_on_cpu_are_plain_tensors() -> None:
    cpu = torch.device("cpu")
    moved = to_device([3, 1, 2], torch.long, cpu)
    assert moved.dtype == torch.long and moved.tolist() == [3, 1, 2] and not moved.is_pinned()
    a, b = torch.arange(3), torch.ones(2)
    copy = HostCopy((a, b))
    assert copy.event is None and [t is s for t, s in zip(copy.wait(), (a, b))] == [True, True]
