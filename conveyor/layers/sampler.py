"""Sampling for the whole batch in one vectorized pass, each row with its request's own parameters.

Greedy and sampled rows mix freely. A sampled row draws one uniform number, from the request's own
generator when it has a seed (else the global one), and takes the token where the running sum of
its filtered distribution (vocabulary order) passes that fraction of the total (inverse CDF): a
seeded request's tokens depend only on its seed and its logits, never on what else is in the batch.
On CPU the whole batch is one native call, a pass per row: a greedy row's argmax, a sampled row's
filtering and draw (`kernels/sampling_cpu.cpp`: 64 rows of a 49k vocabulary with top-p took ~300 ms
sorting in PyTorch; one row at temperature 1, ~1 ms a token with PyTorch's argmax beside the scalar
kernel, now ~0.05 ms); elsewhere argmax, then `probs` + `draw` for the sampled rows in PyTorch, the same rule.

Everything runs on the logits' device: per-request parameters and row indices are staged through
pinned memory (`transfer.to_device`), and `Sampler.sample` returns device tensors, so nothing
waits for the GPU until `SampledBatch.to_host` reads the tokens (and the logprobs asked for) in
one copy: the step's only host sync (`start_copy` queues that copy early, so async batching can
launch the next step before waiting for it).

A row with a forced token (a reasoning marker's, `reasoning_state`) takes it whatever it drew; a grammar
masks a row only outside its reasoning, and a row that may open its reasoning keeps the start marker's
first token beside the grammar's.

Structured outputs, logit_bias, allowed_token_ids and bad_words edit the logits before sampling: the
bias added, the tokens a row may not take set to -inf, then the constrained rows' grammar masks
(`structured.masks`) applied in one pass, in place (a copy when the batch asks for logprobs, which
stay those of the raw logits, as with penalties).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..cache.transfer import HostCopy, to_device
from ..kernels import cpu_sampling_ops, native_kernels_enabled
from ..kernels.sampling_ops import SamplingOps
from ..request import Request, ranked_entry

if TYPE_CHECKING:
    from ..structured.masks import GrammarMasks


def native_sampling(device: torch.device) -> SamplingOps | None:
    """The native sampling kernel where it runs (CPU, kernels on and built), else None."""
    return cpu_sampling_ops() if device.type == "cpu" and native_kernels_enabled() else None


@dataclass
class SampledBatch:
    """One step's samples, still on the device: `tokens` `[rows]`; for the rows in `wanted` (those that
    ask for logprobs) the chosen token's logprob and the top-`k` ids and values, `k` the largest asked."""

    tokens: torch.Tensor
    wanted: list[int]
    top_n: list[int]
    chosen: torch.Tensor | None = None
    ranks: torch.Tensor | None = None  # the sampled tokens' ranks among the vocabulary (vLLM's: ties counted)
    top_ids: torch.Tensor | None = None
    top_vals: torch.Tensor | None = None

    copy: HostCopy | None = None

    def start_copy(self) -> SampledBatch:
        """Queue the copies to the host now (behind the sampling kernels); `to_host` waits for them."""
        if self.copy is None:
            extra = (self.chosen, self.ranks, self.top_ids, self.top_vals) if self.wanted else ()
            self.copy = HostCopy((self.tokens, *extra))  # type: ignore[arg-type]  # set when wanted
        return self

    def to_host(self) -> tuple[list[int], list[dict[int, float] | None]]:
        """Token ids and per-row logprobs (`{token: logprob}`, None where not asked), read in one sync."""
        copies = self.start_copy().copy.wait()  # type: ignore[union-attr]
        if not self.wanted:
            return copies[0].tolist(), [None] * self.tokens.shape[0]
        tokens, chosen, ranks, top_ids, top_vals = (t.tolist() for t in copies)
        logprobs: list[dict[int, float] | None] = [None] * len(tokens)
        for j, (i, n) in enumerate(zip(self.wanted, self.top_n)):
            logprobs[i] = ranked_entry(top_ids[j][:n], top_vals[j][:n], tokens[i], chosen[j], ranks[j])
        return tokens, logprobs


class Sampler:
    def __init__(self) -> None:
        self._masks: GrammarMasks | None = None

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> tuple[list[int], list[dict[int, float] | None]]:
        """logits: fp32 `[rows, vocab]`, one row per request. Returns token ids and optional logprobs."""
        return self.sample(logits, requests).to_host()

    @staticmethod
    def plain_greedy(requests: list[Request]) -> bool:
        """Whether every row is the argmax of its raw logits (no sampling, penalties, min_tokens, bias,
        grammar, forced token or logprobs): then the LM head may fuse the argmax (`CausalLM.greedy_tokens`)."""
        return all(r.params.greedy and r.params.logprobs is None and not r.params.logit_bias and r.grammar is None
                   and r.forced_token is None and not r.restricts_tokens and r.params.repetition_penalty == 1.0
                   and not r.params.presence_penalty and not r.params.frequency_penalty
                   and len(r.output_token_ids) >= r.params.min_tokens
                   for r in requests)

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> SampledBatch:
        """The batch's tokens (and logprobs) on the logits' device; no host sync. `logits` may be edited."""
        raw, device = logits, logits.device
        params = [r.params for r in requests]
        adjusted = [i for i, (p, r) in enumerate(zip(params, requests))
                    if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
                    or len(r.output_token_ids) < p.min_tokens]
        biased = [i for i, p in enumerate(params) if p.logit_bias]
        restricted = [i for i, r in enumerate(requests) if r.restricts_tokens]
        grammars = [r.active_grammar for r in requests]
        constrained = any(g is not None for g in grammars)
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        if adjusted or wanted and (biased or restricted or constrained):  # else they edit the logits in place
            logits = logits.clone()
        for i in adjusted:
            self._adjust_row(logits[i], requests[i])
        if biased:
            self._add_logit_bias(logits, [(i, params[i].logit_bias) for i in biased])
        for i in restricted:
            self._restrict_row(logits[i], requests[i])
        if constrained:  # last: nothing after it may lift a masked token, but the reasoning's opening
            opening = [(i, r.opening_token) for i, r in enumerate(requests) if r.opening_token is not None]
            kept = self._opening_logits(logits, opening)
            self._grammar_masks(logits.shape[1]).apply(logits, grammars)
            self._opening_logits(logits, opening, kept)
        native = native_sampling(device)
        if native is not None:  # greedy and sampled rows in one native pass
            tokens = Sampler.native_rows(native, logits, requests, Sampler.uniforms(requests, device))
        else:
            tokens = logits.argmax(dim=-1)
            sampled = [i for i, p in enumerate(params) if not p.greedy]
            if sampled:
                rows = to_device(sampled, torch.long, device)
                tokens[rows] = self._sample(logits.index_select(0, rows), [requests[i] for i in sampled])
        forced = [(i, r.forced_token) for i, r in enumerate(requests) if r.forced_token is not None]
        if forced:  # a thinking budget's end, over whatever was drawn (its logprob is still the model's)
            rows, ids = zip(*forced)
            tokens[to_device(list(rows), torch.long, device)] = to_device(list(ids), tokens.dtype, device)
        top_n = [params[i].logprobs or 0 for i in wanted]
        batch = SampledBatch(tokens, wanted, top_n)
        if wanted:
            rows = to_device(wanted, torch.long, device)
            lp = torch.log_softmax(raw.index_select(0, rows), dim=-1)
            k = max(top_n)
            batch.top_vals, batch.top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
            batch.chosen = lp.gather(1, tokens.index_select(0, rows).unsqueeze(1)).squeeze(1)
            batch.ranks = (lp >= batch.chosen.unsqueeze(1)).sum(dim=1)
        return batch

    @staticmethod
    def _opening_logits(logits: torch.Tensor, opening: list[tuple[int, int]],
                        kept: torch.Tensor | None = None) -> torch.Tensor | None:
        """The (row, token) logits of rows that may open their reasoning beside their grammar's tokens: read
        before the masks (`kept` None), written back after them."""
        if not opening:
            return None
        rows, tokens = (to_device(list(v), torch.long, logits.device) for v in zip(*opening))
        if kept is None:
            return logits[rows, tokens].clone()
        logits[rows, tokens] = kept
        return kept

    def _grammar_masks(self, vocab_size: int) -> GrammarMasks:
        """Made on the first constrained batch (llguidance is imported only when a grammar is used)."""
        if self._masks is None:
            from ..structured.masks import GrammarMasks
            self._masks = GrammarMasks(vocab_size, max_rows=64)
        return self._masks

    @staticmethod
    def _add_logit_bias(logits: torch.Tensor, rows: list[tuple[int, dict[int, float]]]) -> None:
        """OpenAI's logit_bias: each row's {token: bias} added to its logits, all rows in one scatter."""
        index = [i for i, bias in rows for _ in bias]
        tokens = [t for _, bias in rows for t in bias]
        values = [float(v) for _, bias in rows for v in bias.values()]
        device = logits.device
        logits.index_put_((to_device(index, torch.long, device), to_device(tokens, torch.long, device)),
                          to_device(values, logits.dtype, device), accumulate=True)

    @staticmethod
    def _restrict_row(row: torch.Tensor, request: Request) -> None:
        """-inf for the tokens the request may not take now: those outside `allowed_token_ids`, and each bad
        word's last token where its tokens before it end the output so far."""
        allowed = request.params.allowed_token_ids
        if allowed is not None:
            keep = to_device(allowed, torch.long, row.device)
            row.copy_(torch.full_like(row, float("-inf")).index_copy_(0, keep, row.index_select(0, keep)))
        out = request.output_token_ids
        banned = [word[-1] for word in request.bad_words_token_ids
                  if len(word) <= len(out) + 1 and out[len(out) - len(word) + 1:] == word[:-1]]
        if banned:
            row.index_fill_(0, to_device(banned, torch.long, row.device), float("-inf"))

    @staticmethod
    def _adjust_row(row: torch.Tensor, request: Request) -> None:
        """Penalties and min_tokens for one row (only rows that ask for them pay for this)."""
        p = request.params
        if p.repetition_penalty != 1.0:  # transformers' rule: divide positive logits, multiply negative ones
            # index_fill_, not `seen[ids] = True`: a Python scalar assigned by index goes through a host
            # tensor copied to the device, which waits for it
            seen = torch.zeros_like(row, dtype=torch.bool).index_fill_(
                0, to_device(request.prompt_token_ids + request.output_token_ids, torch.long, row.device), True)
            penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row.copy_(torch.where(seen, penalized, row))
        if (p.presence_penalty or p.frequency_penalty) and request.output_token_ids:
            # counts by index_add_ (no unique/bincount: on CUDA they wait for the device to size their output)
            ids = to_device(request.output_token_ids, torch.long, row.device)
            counts = torch.zeros_like(row).index_add_(0, ids, torch.ones_like(ids, dtype=row.dtype))
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        if len(request.output_token_ids) < p.min_tokens and request.stop_token_ids:
            row.index_fill_(0, to_device(sorted(request.stop_token_ids), torch.long, row.device), float("-inf"))

    @staticmethod
    def _sample(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        return Sampler.sample_with(logits, requests, Sampler.uniforms(requests, logits.device))

    @staticmethod
    def uniforms(requests: list[Request], device: torch.device,
                 drawn: Callable[[int], None] | None = None) -> torch.Tensor:
        """One uniform number in [0, 1) per row (fp64): a seeded request's from its own generator (then
        `drawn(row)`, e.g. to keep the generator's state), the others' from the global one in one call."""
        u = torch.rand(len(requests), dtype=torch.float64, device=device)
        for i, r in enumerate(requests):
            if r.generator is not None and not r.params.greedy:  # a greedy row's u goes unused
                u[i] = torch.rand(1, dtype=torch.float64, generator=r.generator, device=r.generator.device)[0]
                if drawn is not None:
                    drawn(i)
        return u

    @staticmethod
    def sample_with(logits: torch.Tensor, requests: list[Request], u: torch.Tensor) -> torch.Tensor:
        """Each row's token from its filtered distribution and its uniform `u` (see the module docstring)."""
        ops = native_sampling(logits.device)
        if ops is None:
            return Sampler.draw(Sampler.probs(logits, requests), u)
        return Sampler.native_rows(ops, logits, requests, u)

    @staticmethod
    def native_rows(ops: SamplingOps, logits: torch.Tensor, requests: list[Request], u: torch.Tensor) -> torch.Tensor:
        """Every row's token in one native call (`kernels/sampling_cpu.cpp`): a greedy row's first largest
        logit, a sampled row's draw. Its parameters travel as one fp64 tensor (temperature 0 = greedy)."""
        params = [(0.0 if p.greedy else p.temperature, p.top_k, p.top_p, p.min_p) for p in (r.params for r in requests)]
        return ops.sample_rows(logits.float().contiguous(), torch.tensor(params, dtype=torch.float64), u)

    @staticmethod
    def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Inverse CDF: per row the first token (vocabulary order) where the running sum of `probs` (kept,
        not normalized) exceeds `u` times their total."""
        cum = probs.double().cumsum(dim=-1)
        target = (u.to(cum.dtype) * cum[:, -1]).unsqueeze(1)
        return torch.searchsorted(cum, target, right=True).squeeze(1).clamp(max=probs.shape[1] - 1)

    @staticmethod
    def probs(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Each row's sampling distribution: temperature, then top-k, top-p and min-p."""
        params = [r.params for r in requests]
        device = logits.device
        temperature = to_device([p.temperature for p in params], torch.float32, device)
        logits = logits / temperature.unsqueeze(1)
        top_k = [p.top_k for p in params]
        if any(top_k):
            k = to_device([k if k else logits.shape[1] for k in top_k], torch.long, device).clamp(max=logits.shape[1])
            kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1).unsqueeze(1))
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if any(p.top_p < 1.0 for p in params):
            top_p = to_device([p.top_p for p in params], torch.float32, device).unsqueeze(1)
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) > top_p  # mass before this token already enough
            probs = probs.scatter(1, order, sorted_probs.masked_fill(drop, 0.0))
        if any(p.min_p > 0.0 for p in params):
            min_p = to_device([p.min_p for p in params], torch.float32, device).unsqueeze(1)
            probs = probs.masked_fill(probs < probs.max(dim=-1, keepdim=True).values * min_p, 0.0)
        return probs
