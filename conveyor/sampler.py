"""Sampling for the whole batch in one vectorized pass, each row with its request's own parameters.

Greedy and sampled rows mix freely. Sampled rows draw with the exponential-race trick
(`argmax(p / q)`, `q ~ Exp(1)`), which equals sampling from `p` and lets every seeded request fill
its own noise row from its own generator: its tokens depend only on its seed and its logits,
never on what else is in the batch.
"""

from __future__ import annotations

import torch

from .request import Request


class Sampler:
    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> tuple[list[int], list[dict[int, float] | None]]:
        """logits: fp32 `[rows, vocab]`, one row per request. Returns token ids and optional logprobs."""
        raw = logits
        params = [r.params for r in requests]
        adjusted = [i for i, (p, r) in enumerate(zip(params, requests))
                    if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
                    or len(r.output_token_ids) < p.min_tokens]
        if adjusted:
            logits = logits.clone()
            for i in adjusted:
                self._adjust_row(logits[i], requests[i])
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            tokens[sampled] = self._sample(logits[sampled], [requests[i] for i in sampled])
        token_list = tokens.tolist()
        logprobs: list[dict[int, float] | None] = [None] * len(requests)
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        if wanted:
            lp = torch.log_softmax(raw[wanted], dim=-1)
            k = max(params[i].logprobs for i in wanted)
            top_vals, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
            chosen = lp.gather(1, tokens[wanted].unsqueeze(1)).squeeze(1).tolist()
            top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
            for j, i in enumerate(wanted):
                n = params[i].logprobs
                entry = dict(zip(top_ids[j][:n], top_vals[j][:n]))
                entry[token_list[i]] = chosen[j]
                logprobs[i] = entry
        return token_list, logprobs

    @staticmethod
    def _adjust_row(row: torch.Tensor, request: Request) -> None:
        """Penalties and min_tokens for one row (only rows that ask for them pay for this)."""
        p = request.params
        if p.repetition_penalty != 1.0:  # transformers' rule: divide positive logits, multiply negative ones
            seen = torch.tensor(request.prompt_token_ids + request.output_token_ids, device=row.device).unique()
            score = row[seen]
            row[seen] = torch.where(score > 0, score / p.repetition_penalty, score * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and request.output_token_ids:
            counts = torch.bincount(torch.tensor(request.output_token_ids, device=row.device),
                                    minlength=row.shape[0])[:row.shape[0]].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        if len(request.output_token_ids) < p.min_tokens and request.stop_token_ids:
            row[list(request.stop_token_ids)] = float("-inf")

    @staticmethod
    def _sample(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        params = [r.params for r in requests]
        device = logits.device
        temperature = torch.tensor([p.temperature for p in params], device=device)
        logits = logits / temperature.unsqueeze(1)
        top_k = [p.top_k for p in params]
        if any(top_k):
            k = torch.tensor([k if k else logits.shape[1] for k in top_k], device=device).clamp(max=logits.shape[1])
            kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1).unsqueeze(1))
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], device=device).unsqueeze(1)
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) > top_p  # mass before this token already enough
            probs = probs.scatter(1, order, sorted_probs.masked_fill(drop, 0.0))
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
            probs = probs.masked_fill(probs < probs.max(dim=-1, keepdim=True).values * min_p, 0.0)
        noise = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(requests) if r.generator is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=device).exponential_()
        for i, r in enumerate(requests):
            if r.generator is not None:
                noise[i].exponential_(generator=r.generator)
        return (probs / noise).argmax(dim=-1)
