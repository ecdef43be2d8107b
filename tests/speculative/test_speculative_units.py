"""Speculative decoding's parts on their own: the config, n-gram proposals, and verification."""

from __future__ import annotations

import pytest
import torch

from conveyor.speculative import NgramProposer, SpeculativeConfig, verify


@pytest.mark.parametrize("bad, field", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "colour": 1}, "colour"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "quantization": "fp8"}, "quantization"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
])
def test_bad_configs_name_the_field(bad: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_dict(bad)


def test_config_defaults_and_self_draft() -> None:
    ngram = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4})
    assert (ngram.prompt_lookup_max, ngram.prompt_lookup_min) == (3, 1) and not ngram.self_draft
    assert SpeculativeConfig.from_dict({"method": "draft_model", "num_speculative_tokens": 3,
                                        "quantization": "int4"}).self_draft
    assert SpeculativeConfig.from_dict(None) is None


def test_ngram_copies_what_followed_the_last_occurrence_of_the_longest_suffix() -> None:
    proposer = NgramProposer(3, max_n=3, min_n=1)
    #            0  1  2  3  4  5  6  7  8  9
    assert proposer.propose([5, 1, 2, 3, 9, 9, 1, 2, 3]) == [9, 9, 1]  # "1 2 3" seen at 1..3
    assert proposer.propose([1, 2, 7, 8, 2, 4, 4, 1, 2]) == [7, 8, 2]  # "1 2" (longest with a match) at 0
    assert proposer.propose([4, 6, 1, 4, 6, 2, 4, 6]) == [2, 4, 6]  # the most recent "4 6" wins
    assert proposer.propose([1, 2, 3, 4]) == []  # nothing repeats
    assert proposer.propose([3, 8, 3]) == [8, 3]  # proposals stop where the sequence ends
    assert NgramProposer(3, max_n=3, min_n=2).propose([3, 8, 5, 3]) == []  # 1-grams are below min_n


def test_greedy_verification_keeps_the_argmax_tokens() -> None:
    target = torch.tensor([7, 8, 9, 4,   # request 0: proposals 7, 8, 1 -> 7, 8 accepted, then 9
                           3, 5,         # request 1: proposal 3 accepted, bonus 5
                           6])           # request 2: no proposals: plain decode
    out = verify([[7, 8, 1], [3], []], [True, True, True], target, None, [None, None, None])
    assert out.tokens == [[7, 8, 9], [3, 5], [6]] and out.num_accepted == [2, 1, 0]
    first_wrong = verify([[2, 8]], [True], torch.tensor([7, 8, 9]), None, [None])
    assert first_wrong.tokens == [[7]] and first_wrong.num_accepted == [0]


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((len(probs) - 1) / 2.0, dtype=torch.float64), stat / 2))


@pytest.mark.parametrize("with_draft_model", [False, True])
def test_rejection_sampling_keeps_the_target_distribution(with_draft_model: bool) -> None:
    """Each of n requests proposes one token (from a draft distribution q, or a fixed n-gram token);
    the first emitted token must be distributed as the target p (chi-square, 6 categories)."""
    g = torch.Generator().manual_seed(0)
    vocab, n = 6, 40000
    p = torch.softmax(torch.randn(vocab, generator=g, dtype=torch.float64) * 1.5, 0).float()
    q = torch.softmax(torch.randn(vocab, generator=g, dtype=torch.float64) * 1.5, 0).float()
    drafts = torch.multinomial(q, n, replacement=True, generator=g) if with_draft_model else torch.full((n,), 2)
    target_probs = p.repeat(2 * n, 1)
    target_ids = target_probs.argmax(dim=1)
    draft_probs = q.repeat(n, 1) if with_draft_model else None
    out = verify([[int(t)] for t in drafts], [False] * n, target_ids, target_probs, [None] * n, draft_probs)
    first = torch.tensor([t[0] for t in out.tokens])
    counts = torch.bincount(first, minlength=vocab).double()
    assert _chi_square_p(counts, p.double()) > 1e-3
    accepted = sum(out.num_accepted) / n
    expected_rate = float(torch.minimum(p, q).sum()) if with_draft_model else float(p[2])
    assert abs(accepted - expected_rate) < 0.02  # the acceptance rate theory predicts


def test_seeded_requests_verify_the_same_whatever_else_is_in_the_batch() -> None:
    vocab = 50
    g = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(8, vocab, generator=g), 1)

    def run(batch: list[int]) -> list[int]:
        rows = torch.cat([probs[:3]] + [probs[3:5]] * (len(batch) - 1))
        generators = [torch.Generator().manual_seed(42)] + [None] * (len(batch) - 1)
        proposals = [[int(probs[0].argmax()), 4]] + [[1]] * (len(batch) - 1)
        return verify(proposals, [False] * len(batch), rows.argmax(1), rows, generators).tokens[0]

    assert run([0]) == run([0, 1, 2]) == run([0, 1, 2, 3, 4])
