"""Verifying proposed tokens in one pass, so outputs follow the target model exactly.

A request with k proposals has k + 1 rows of target logits: the rows that predict each proposal and
one after the last. Greedy requests accept proposals while they equal the target's argmax, then
take the argmax: their tokens are those of decoding without speculation. Sampled requests use
rejection sampling (Leviathan et al. 2023; Chen et al. 2023): proposal x is accepted with
probability min(1, p(x) / q(x)) (q = the draft's distribution; one-hot for n-gram proposals), the
first rejected position draws from norm(max(p - q, 0)), and a fully accepted run draws one bonus
token from the last row; the emitted tokens are distributed as the target's. Seeded requests draw
every random number from their own generator, in a fixed order, so their tokens depend only on
their seed and logits, never on the rest of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class VerifyResult:
    """Per request: the tokens to append (accepted proposals, then one target token), and how many
    proposals were accepted."""

    tokens: list[list[int]]
    num_accepted: list[int]


def _race(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One draw per row from `probs [n, V]` (exponential race: argmax p / Exp(1) noise), each seeded
    row's noise from its own generator."""
    noise = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            noise[i].exponential_(generator=g)
    return (probs / noise).argmax(dim=-1)


def verify(proposals: list[list[int]], greedy: list[bool], target_ids: torch.Tensor,
           target_probs: torch.Tensor | None, generators: list[torch.Generator | None],
           draft_probs: torch.Tensor | None = None) -> VerifyResult:
    """proposals: per request its k_i proposed tokens (k_i >= 0). Request i owns the
    `k_i + 1` consecutive rows of `target_ids [R]` (the target's argmax per row) and of
    `target_probs [R, V]` (its sampling distribution per row, after temperature, top-k/p, min-p;
    needed when some request is not greedy). `draft_probs [sum k_i, V]`: the draft's distribution
    for each proposal (None: n-gram proposals, one-hot)."""
    device = target_ids.device
    counts = [len(p) for p in proposals]
    n, k_max = len(proposals), max(counts, default=0)
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c + 1)
    draft_rows = torch.tensor([offsets[i] + j for i, c in enumerate(counts) for j in range(c)], dtype=torch.long,
                              device=device)
    drafted = torch.tensor([t for p in proposals for t in p], dtype=torch.long, device=device)
    accept = torch.zeros(drafted.shape[0], dtype=torch.bool, device=device)
    is_greedy = torch.tensor([g for g, c in zip(greedy, counts) for _ in range(c)], dtype=torch.bool, device=device)
    if drafted.numel():
        accept = target_ids[draft_rows] == drafted
        if not all(greedy):
            assert target_probs is not None, "sampled requests need target_probs"
            p = target_probs[draft_rows].gather(1, drafted.unsqueeze(1)).squeeze(1)
            q = torch.ones_like(p) if draft_probs is None else draft_probs.gather(1, drafted.unsqueeze(1)).squeeze(1)
            u = torch.empty_like(p)
            for i, c in enumerate(counts):
                if c and not greedy[i]:
                    rows = slice(offsets[i] - i, offsets[i] - i + c)  # this request's proposals in `drafted`
                    u[rows] = torch.rand(c, device=device, generator=generators[i])
            sampled_accept = u * q < p  # u < p / q without dividing by a zero q
            accept = torch.where(is_greedy, accept, sampled_accept)
    grid = torch.zeros(n, k_max + 1, dtype=torch.bool, device=device)
    if drafted.numel():
        columns = torch.tensor([j for c in counts for j in range(c)], dtype=torch.long, device=device)
        owners = torch.tensor([i for i, c in enumerate(counts) for _ in range(c)], dtype=torch.long, device=device)
        grid[owners, columns] = accept
    num_accepted = grid.to(torch.int64).cumprod(dim=1).sum(dim=1)  # leading accepted proposals
    final_rows = torch.tensor(offsets[:-1], dtype=torch.long, device=device) + num_accepted
    final = target_ids[final_rows].clone()
    accepted_list = num_accepted.tolist()
    sampled = [i for i in range(n) if not greedy[i]]
    if sampled:
        assert target_probs is not None, "sampled requests need target_probs"
        index = torch.tensor(sampled, dtype=torch.long, device=device)
        probs = target_probs[final_rows[index]].clone()
        for j, i in enumerate(sampled):  # the residual at a rejected position: remove the draft's mass
            a = accepted_list[i]
            if a < counts[i]:
                d = offsets[i] - i + a
                if draft_probs is None:
                    probs[j, proposals[i][a]] = 0.0
                else:
                    probs[j] = (probs[j] - draft_probs[d]).clamp(min=0.0)
        empty = probs.sum(dim=1) <= 0
        if bool(empty.any()):
            probs[empty] = target_probs[final_rows[index]][empty]
        final[index] = _race(probs, [generators[i] for i in sampled])
    final_list = final.tolist()
    tokens = [proposals[i][:accepted_list[i]] + [final_list[i]] for i in range(n)]
    return VerifyResult(tokens=tokens, num_accepted=accepted_list)
