"""The device-side sampler against a row-by-row reference, and the transfer helpers it uses."""

from __future__ import annotations

import torch

from conveyor.cache.transfer import HostCopy, to_device
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
    """One row alone, written out plainly: penalties, temperature, top-k, top-p, min-p, exponential race."""
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
    noise = torch.empty_like(probs).exponential_(generator=torch.Generator().manual_seed(p.seed))
    return int((probs / noise).argmax())


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


def test_transfers_on_cpu_are_plain_tensors() -> None:
    cpu = torch.device("cpu")
    moved = to_device([3, 1, 2], torch.long, cpu)
    assert moved.dtype == torch.long and moved.tolist() == [3, 1, 2] and not moved.is_pinned()
    a, b = torch.arange(3), torch.ones(2)
    copy = HostCopy((a, b))
    assert copy.event is None and [t is s for t, s in zip(copy.wait(), (a, b))] == [True, True]
