"""Load generation for `conveyor bench serve`: when requests arrive, and synthetic text prompts."""

from __future__ import annotations

import math
import random

from .workloads import BenchRequest, Workload, WorkloadError, check_synthetic_sizes

# Common short English words: nearly all are a single token (with their leading space) in the
# usual BPE vocabularies, so N words are roughly N prompt tokens. The server's usage chunk reports
# the exact count.
# Common short English words: nearly all are a single token (with their leading space) in the
# usual BPE vocabularies, so N words are roughly N prompt tokens. The server's usage chunk reports
# the exact count.
_WORDS = tuple(dict.fromkeys("""
the of and to in is was for on that with as by at from his her he she it they we you this be are
have had not but or an which one all were when there can more if out so said what up its about
into than them time only new some could these two may then first any like now my such over man
also make did made after well back most way even many before must through years where much your
way down should because long each just people those too how little state good very world still
own see men work last never us day same another know year while last might great old off come
since against go came right used take three small house part hand high place old case point
""".split()))


def arrival_times(num_requests: int, request_rate: float, *, seed: int = 0, burstiness: float = 1.0,
                  normalize: bool = True) -> list[float]:
    """Send times (seconds from the start) of `num_requests` requests.

    `request_rate` inf: all at 0. Otherwise the gaps are gamma(shape=burstiness,
    scale=1/(rate*burstiness)) -- exponential, i.e. a Poisson process, for burstiness 1 -- drawn
    from `random.Random(seed)`, and the first request waits one gap, as in vllm. With `normalize`
    (vllm's behaviour) the times are rescaled so that the last one is exactly num_requests / rate:
    the run's offered load is then the requested rate whatever the seed.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (or inf), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate) or num_requests == 0:
        return [0.0] * num_requests
    rng = random.Random(seed)
    theta = 1.0 / (request_rate * burstiness)
    times, t = [], 0.0
    for _ in range(num_requests):
        t += theta if math.isinf(burstiness) else rng.gammavariate(burstiness, theta)
        times.append(t)
    if normalize and times[-1] > 0:
        scale = (num_requests / request_rate) / times[-1]
        times = [x * scale for x in times]
    return times


def synthetic_text_workload(input_len: int, output_len: int, num_prompts: int, *, seed: int = 0) -> Workload:
    """`num_prompts` prompts of `input_len` random common English words (about one token each; the
    server's usage reports the exact count), each asking for exactly `output_len` tokens (EOS
    ignored). Text, not token ids, so that it works on every endpoint of every server."""
    check_synthetic_sizes(input_len, output_len, num_prompts)
    rng = random.Random(seed)
    requests = [BenchRequest(max_new_tokens=output_len, prompt=" ".join(rng.choices(_WORDS, k=input_len)),
                             ignore_eos=True)
                for _ in range(num_prompts)]
    return Workload(name=f"random-in{input_len}-out{output_len}-n{num_prompts}", requests=requests,
                    description=f"{num_prompts} prompts of {input_len} random words (seed {seed}), exactly "
                                f"{output_len} new tokens each (ignore_eos)",
                    temperature=0.0, source="synthetic")


def prefix_repetition_workload(prefix_len: int, num_prefixes: int, suffix_len: int, output_len: int,
                               num_prompts: int, *, seed: int = 0) -> Workload:
    """vLLM's `prefix_repetition` dataset: `num_prefixes` random prefixes of `prefix_len` words, each
    shared by `num_prompts / num_prefixes` prompts that go on with `suffix_len` words of their own
    (shuffled, exactly `output_len` new tokens each). The shape of many questions about a few documents
    or system prompts: what prefix caching, and cache-aware routing over replicas, are for."""
    check_synthetic_sizes(suffix_len, output_len, num_prompts)
    if prefix_len < 1 or not 1 <= num_prefixes <= num_prompts:
        raise WorkloadError(f"need prefix_len >= 1 and 1 <= num_prefixes <= num_prompts, got {prefix_len}, "
                         f"{num_prefixes}, {num_prompts}")
    rng = random.Random(seed)
    prefixes = [" ".join(rng.choices(_WORDS, k=prefix_len)) for _ in range(num_prefixes)]
    prompts = [f"{prefixes[i % num_prefixes]} {' '.join(rng.choices(_WORDS, k=suffix_len))}"
               for i in range(num_prompts)]
    rng.shuffle(prompts)
    return Workload(name=f"prefix-repetition-p{prefix_len}x{num_prefixes}-s{suffix_len}-out{output_len}-n{num_prompts}",
                    requests=[BenchRequest(max_new_tokens=output_len, prompt=p, ignore_eos=True) for p in prompts],
                    description=f"{num_prompts} prompts: {num_prefixes} shared prefixes of {prefix_len} random words, "
                                f"each prompt then {suffix_len} words of its own (seed {seed}); exactly {output_len} "
                                "new tokens each (ignore_eos)",
                    temperature=0.0, source="synthetic")
