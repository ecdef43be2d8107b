"""The throughput report: system names, greedy-output agreement, and the text table.

Greedy outputs are compared request by request against Conveyor's: identical requests are
counted and every mismatch is listed with the index of its first differing token (never dropped);
the agreement is also summed up as the identical fraction and the mean common-prefix length, the
numbers that say how far two systems in different precisions stay together.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from .modes import describe_mode

CONVEYOR = "conveyor"
HF_CB = "hf_generate_batch"
HF_STATIC = "hf_generate"
VLLM = "vllm"
SYSTEM_LABELS = {CONVEYOR: "conveyor", HF_CB: "hf generate_batch", HF_STATIC: "hf generate", VLLM: "vllm"}


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token; the shorter length if one is a prefix of the other; None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_outputs(reference: Sequence[Sequence[int]], other: Sequence[Sequence[int]],
                    other_errors: Sequence[str | None] | None = None) -> dict[str, Any]:
    """Per-request exact-match comparison of greedy token ids (reference = Conveyor), with the agreement
    in two numbers: the fraction of identical requests and the mean common-prefix length in tokens."""
    mismatches, prefixes = [], []
    for i, (a, b) in enumerate(zip(reference, other)):
        diff = first_difference(a, b)
        error = other_errors[i] if other_errors else None
        prefixes.append(len(a) if diff is None else diff)
        if diff is not None or error:
            mismatches.append({"index": i, "first_diff": diff, "conveyor_len": len(a), "baseline_len": len(b),
                               **({"error": error} if error else {})})
    n = len(reference)
    return {"num_requests": n, "exact_matches": n - len(mismatches),
            "identical_fraction": (n - len(mismatches)) / n if n else None,
            "mean_common_prefix": sum(prefixes) / n if n else None,
            "mean_conveyor_len": sum(len(a) for a in reference) / n if n else None,
            "mismatches": mismatches}


def count_values(values: Iterable[Any]) -> dict[str, int]:
    """How often each value occurs, keyed by its str (JSON-able)."""
    counts: dict[str, int] = {}
    for v in values:
        counts[str(v)] = counts.get(str(v), 0) + 1
    return counts


def format_report(report: dict[str, Any]) -> str:
    """The report as text: the workload and mode, one row per system, notes, greedy agreement."""
    w, m, env = report["workload"], report["model"], report["environment"]
    lines = [
        f"Workload {w['name']}: {w['num_requests']} requests, {w['prompt_tokens']} prompt tokens "
        f"(longest {w['max_prompt_len']}), max_new_tokens {_span(w['max_new_tokens'])}"
        + (", EOS ignored" if w["ignore_eos"] else ", greedy, stop at EOS"),
        f"Model {Path(m['path']).name} on {m['device']} ({describe_mode(m, env)}), torch {env['torch']} "
        f"({env['torch_threads']} threads), transformers {env['transformers']}",
        "",
    ]
    header = ("system", "wall s", "req/s", "out tok/s", "total tok/s", "out tokens", "conveyor is: out", "total")

    def times(ratio: float | None) -> str:
        return f"{ratio:.2f}x" if ratio else "n/a"

    rows = []
    for name, s in report["systems"].items():
        ratios = ("-", "-") if name == CONVEYOR else (times(report["ratios"].get(name)),
                                                      times(report["total_ratios"].get(name)))
        rows.append((SYSTEM_LABELS.get(name, name), f"{s['wall_s']:.2f}", f"{s['requests_per_s']:.2f}",
                     f"{s['output_tok_per_s']:.1f}", f"{s['total_tok_per_s']:.1f}", str(s["output_tokens"]), *ratios))
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r))  # noqa: E731
    lines += [fmt(header), fmt(tuple("-" * x for x in widths))] + [fmt(r) for r in rows]
    notes = []
    for name, s in report["systems"].items():
        if s.get("num_errors"):
            notes.append(f"{SYSTEM_LABELS.get(name, name)}: {s['num_errors']} requests FAILED: {s['errors'][:3]}")
    engine = report["systems"].get(CONVEYOR, {}).get("engine")
    if engine:
        c = report["conveyor_config"]
        caching = ("on" if engine.get("prefix_caching", c["allow_block_sharing"]) else
                   "off: a window shorter than a page, or sliding or state layers under tensor parallelism"
                   if c["allow_block_sharing"] else "off")
        notes.append(f"conveyor: page_size {c['page_size']}, {engine['total_blocks']} KV blocks, max_batch_tokens "
                     f"{c['max_batch_tokens']}, {c['scheduler_type']}; prefilled {engine['prefill_tokens']} tokens, "
                     f"prefix cache {engine['prefix_cache_hit_tokens']} of {engine['prefix_cache_query_tokens']} "
                     f"queried tokens hit ({caching}); offloads "
                     f"{engine['offloads']} (swapped {engine['swap_outs']}, swapped in {engine['swap_ins']}, "
                     f"soft resets {engine['soft_resets']})"
                     + ("; batch-invariant" if c.get("batch_invariant") else ""))
    if report.get("structured"):
        notes.append(f"structured: every request constrained by {report['structured']['constraint'][:60]}...; "
                     f"constrained / plain output tok/s = {report['structured']['output_tok_per_s_ratio']:.2f}")
    cb = report["systems"].get(HF_CB)
    if cb:
        notes.append(f"hf generate_batch: {cb['api']}, attn {cb['attn_implementation']}, page_size {cb['page_size']}, "
                     f"num_blocks {cb['num_blocks']}, max_batch_tokens {cb['max_batch_tokens']}, "
                     f"max_requests_per_batch {cb['max_requests_per_batch']}; wall excludes {cb['setup_s']:.2f} s of "
                     f"manager/cache setup (whole call {cb['call_s']:.2f} s)")
    st = report["systems"].get(HF_STATIC)
    if st:
        notes.append(f"hf generate: batches of {st['batch_size']}, left-padded, attn {st['attn_implementation']}")
    if VLLM in report["systems"]:
        notes.append(describe_vllm(report["systems"][VLLM]))
    if "hf_loaded_via" in m:
        notes.append(f"hf model: {m['hf_loaded_via']}")
    if notes:
        lines += [""] + notes
    if report["greedy_match"]:
        lines += ["", "Greedy outputs vs conveyor (token ids, per request):"]
        for name, g in report["greedy_match"].items():
            label = SYSTEM_LABELS.get(name, name)
            prefix = (f"; mean common prefix {g['mean_common_prefix']:.1f} of {g['mean_conveyor_len']:.1f} tokens"
                      if g.get("mean_common_prefix") is not None else "")
            lines.append(f"  {label}: {g['exact_matches']}/{g['num_requests']} identical{prefix}"
                         + ("" if not g["mismatches"] else f"; {len(g['mismatches'])} MISMATCHED:"))
            for mm in g["mismatches"]:
                detail = (f"first difference at output token {mm['first_diff']}" if mm["first_diff"] is not None
                          else "same tokens")
                err = f", error: {mm['error']}" if mm.get("error") else ""
                lines.append(f"    request {mm['index']}: {detail} (conveyor {mm['conveyor_len']} tokens, "
                             f"baseline {mm['baseline_len']}){err}")
    return "\n".join(lines)


def _span(values: list[int]) -> str:
    return str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}"


def describe_vllm(system: dict[str, Any]) -> str:
    """One report line: what vLLM ran."""
    env = system["env"]
    return (f"vllm {system['vllm_version']}: {system['model']} (tokenizer {system['tokenizer'] or 'the model'}), "
            f"dtype {system['dtype'] or system['dtype_requested']}, quantization {system['quantization'] or 'none'}, "
            f"KV cache {env.get('VLLM_CPU_KVCACHE_SPACE', '?')} GiB, OpenMP threads on CPUs "
            f"{env.get('VLLM_CPU_OMP_THREADS_BIND', '?')}"
            + (f", LLM kwargs {system['llm_kwargs']}" if system["llm_kwargs"] else "")
            + f"; wall excludes {system['load_s']:.1f} s of loading")
