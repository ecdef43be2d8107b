"""Offline throughput: Conveyor's `LLM.generate` on a whole workload, optionally against transformers.

Conveyor runs every prompt in one `LLM.generate` call; only that call is timed, after one small
warm-up generate. With `compare=("hf",)` the same chat-templated prompt token ids and the same
`max_new_tokens` run greedily through transformers' continuous batching (`generate_batch`) and
static `generate` (batches of 16, left-padded) on the same weights, and every request's greedy
token ids are compared with Conveyor's: exact matches are counted and, for each mismatch, the
index of the first differing token is reported (mismatches are listed, never dropped).
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import platform
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .workloads import Workload, WorkloadError, render_prompts

logger = logging.getLogger("conveyor.bench")

CONVEYOR = "conveyor"
HF_CB = "hf_generate_batch"
HF_STATIC = "hf_generate"
SYSTEM_LABELS = {CONVEYOR: "conveyor", HF_CB: "hf generate_batch", HF_STATIC: "hf generate"}
# --compare values -> systems they run
COMPARE_CHOICES = {"hf": (HF_CB, HF_STATIC), "hf-cb": (HF_CB,), "hf-generate": (HF_STATIC,)}
WARMUP_PROMPT_LEN = 32
WARMUP_NEW_TOKENS = 4


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token; the shorter length if one is a prefix of the other; None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_outputs(reference: Sequence[Sequence[int]], other: Sequence[Sequence[int]],
                    other_errors: Sequence[str | None] | None = None) -> dict[str, Any]:
    """Per-request exact-match comparison of greedy token ids (reference = Conveyor)."""
    mismatches = []
    for i, (a, b) in enumerate(zip(reference, other)):
        diff = first_difference(a, b)
        error = other_errors[i] if other_errors else None
        if diff is not None or error:
            mismatches.append({"index": i, "first_diff": diff, "conveyor_len": len(a), "baseline_len": len(b),
                               **({"error": error} if error else {})})
    return {"num_requests": len(reference), "exact_matches": len(reference) - len(mismatches),
            "mismatches": mismatches}


def _summary(token_ids: list[list[int]], prompt_lens: list[int], wall_s: float,
             errors: Sequence[str | None]) -> dict[str, Any]:
    n = len(token_ids)
    out = sum(len(t) for t in token_ids)
    prompt = sum(prompt_lens)
    wall = max(wall_s, 1e-9)
    return {"wall_s": wall_s, "num_requests": n, "prompt_tokens": prompt, "output_tokens": out,
            "requests_per_s": n / wall, "output_tok_per_s": out / wall, "total_tok_per_s": (prompt + out) / wall,
            "num_errors": sum(1 for e in errors if e), "errors": [e for e in errors if e][:10],
            "output_lens": [len(t) for t in token_ids]}


def _warmup_prompt(vocab_size: int, special_ids: Sequence[int]) -> list[int]:
    """Fixed random tokens: they share no prefix with the workload, so the warm-up leaves no useful cache."""
    special = set(special_ids)
    rng = random.Random(1234)
    return [t for t in rng.sample(range(vocab_size), WARMUP_PROMPT_LEN * 2) if t not in special][:WARMUP_PROMPT_LEN]


def environment() -> dict[str, Any]:
    import torch
    import transformers

    try:
        version = importlib.metadata.version("conveyor")
    except importlib.metadata.PackageNotFoundError:
        version = None
    return {"conveyor": version, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "machine": platform.machine(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


# Engine counters reported for the timed run (differences of `LLM.stats()`; the warm-up excluded).
ENGINE_COUNTERS = ("prefill_tokens", "prefix_cache_query_tokens", "prefix_cache_hit_tokens", "offloads", "swap_outs",
                   "swap_ins", "soft_resets")


def run_conveyor(llm: Any, prompts: list[list[int]], workload: Workload, *, progress: bool = True,
                 warmup_prompt: Sequence[int] | None = None):
    """One timed `LLM.generate` over all prompts, after a small untimed warm-up generate."""
    import torch

    from .. import SamplingParams
    from .hf_baselines import RunResult

    if warmup_prompt is not None:
        llm.generate([list(warmup_prompt)], SamplingParams(max_new_tokens=WARMUP_NEW_TOKENS, temperature=0.0),
                     use_tqdm=False)
    params = [SamplingParams(max_new_tokens=r.max_new_tokens, temperature=0.0, ignore_eos=r.ignore_eos)
              for r in workload.requests]
    cuda = llm.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(llm.device)
    before = llm.stats()
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=progress)
    if cuda:
        torch.cuda.synchronize(llm.device)
    wall = time.perf_counter() - started
    after = llm.stats()
    engine = {k: getattr(after, k) - getattr(before, k) for k in ENGINE_COUNTERS}
    engine["total_blocks"] = after.total_blocks
    return RunResult(token_ids=[list(o.token_ids) for o in outputs], wall_s=wall,
                     errors=[o.error or (f"finish_reason={o.finish_reason}" if o.finish_reason in ("error", "abort")
                                         else None) for o in outputs],
                     extra={"finish_reasons": _count(o.finish_reason for o in outputs), "engine": engine})


def _count(values) -> dict[str, int]:
    counts: dict[str, int] = {}
    for v in values:
        counts[str(v)] = counts.get(str(v), 0) + 1
    return counts


def run_throughput(workload: Workload, *, llm: Any = None, model: str | os.PathLike[str] | None = None,
                   compare: Sequence[str] = (), device: str = "auto", dtype: str = "auto",
                   config: Any = None, hf_batch_size: int = 16, hf_max_batch_tokens: int | None = -1,
                   hf_max_requests_per_batch: int | None = -1, progress: bool = True,
                   include_token_ids: bool = True) -> dict[str, Any]:
    """Run the workload on Conveyor (and the chosen baselines); return the report as a JSON-able dict.

    `compare` holds keys of COMPARE_CHOICES ("hf" = both transformers baselines).
    `hf_max_batch_tokens` / `hf_max_requests_per_batch`: -1 (default) = the same as Conveyor's
    config, None = transformers' own defaults, or a number.
    """
    from .. import LLM, ContinuousBatchingConfig

    if workload.temperature != 0:
        raise WorkloadError(f"workload {workload.name!r} has temperature {workload.temperature}: the throughput "
                            "benchmark decodes greedily (temperature 0) only")
    systems: list[str] = [CONVEYOR]
    for key in compare:
        if key not in COMPARE_CHOICES:
            raise ValueError(f"unknown --compare value {key!r}; choose from {sorted(COMPARE_CHOICES)}")
        systems += [s for s in COMPARE_CHOICES[key] if s not in systems]

    if llm is None:
        started = time.perf_counter()
        llm = LLM(model, device=device, dtype=dtype, config=config or ContinuousBatchingConfig())
        logger.info("conveyor: loaded in %.1f s", time.perf_counter() - started)
    tokenizer = llm.get_tokenizer()
    prompts = render_prompts(workload, llm.render_chat)
    prompt_lens = [len(p) for p in prompts]
    max_new = [r.max_new_tokens for r in workload.requests]
    ignore_eos = [r.ignore_eos for r in workload.requests]
    eos_ids = list(llm.engine.eos_token_ids)
    special = list(getattr(tokenizer, "all_special_ids", []) or [])
    warm = _warmup_prompt(llm.engine.vocab_size, special)
    cb_cfg = llm.engine.config

    report: dict[str, Any] = {
        "benchmark": "throughput",
        "workload": {"name": workload.name, "source": workload.source, "description": workload.description,
                     "num_requests": len(workload), "prompt_tokens": sum(prompt_lens),
                     "max_prompt_len": max(prompt_lens), "max_new_tokens_total": sum(max_new),
                     "max_new_tokens": sorted(set(max_new)), "ignore_eos": any(ignore_eos),
                     "temperature": 0.0},
        "model": {"path": str(llm.model_path), "device": str(llm.device), "dtype": str(llm.dtype).removeprefix("torch."),
                  "eos_token_ids": eos_ids},
        "environment": environment(),
        "conveyor_config": {k: v for k, v in vars(cb_cfg).items()},
        "systems": {},
        "ratios": {},
        "greedy_match": {},
    }

    def record(name: str, result: Any) -> None:
        entry = _summary(result.token_ids, prompt_lens, result.wall_s, result.errors)
        entry.update(result.extra)
        if include_token_ids:
            entry["token_ids"] = result.token_ids
        report["systems"][name] = entry
        logger.info("%s: %.2f s, %.1f output tok/s", name, result.wall_s, entry["output_tok_per_s"])

    conveyor = run_conveyor(llm, prompts, workload, progress=progress, warmup_prompt=warm)
    record(CONVEYOR, conveyor)

    if len(systems) > 1:
        from .hf_baselines import load_hf_model, run_generate_batch, run_static_generate

        started = time.perf_counter()
        hf, how = load_hf_model(model if model is not None else llm.model_path, llm.dtype, llm.device)
        report["model"]["hf_loaded_via"] = how
        report["model"]["hf_load_s"] = time.perf_counter() - started
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos_ids[0] if eos_ids else 0)

        def same(value: int | None, ours: int) -> int | None:
            return ours if value == -1 else value

        try:
            for name in systems[1:]:
                if name == HF_CB:
                    result = run_generate_batch(
                        hf, prompts, max_new, eos_ids, pad, ignore_eos,
                        max_batch_tokens=same(hf_max_batch_tokens, cb_cfg.max_batch_tokens),
                        max_requests_per_batch=same(hf_max_requests_per_batch, cb_cfg.max_requests_per_batch),
                        progress=progress, warmup_prompt=warm)
                else:
                    result = run_static_generate(hf, prompts, max_new, eos_ids, pad, ignore_eos,
                                                 batch_size=hf_batch_size, progress=progress, warmup_prompt=warm)
                record(name, result)
                base = report["systems"][name]["output_tok_per_s"]
                report["ratios"][name] = report["systems"][CONVEYOR]["output_tok_per_s"] / base if base else None
                report["greedy_match"][name] = compare_outputs(conveyor.token_ids, result.token_ids, result.errors)
        finally:
            del hf
    return report


# -- presentation ---------------------------------------------------------------------------------
def format_report(report: dict[str, Any]) -> str:
    w, m, env = report["workload"], report["model"], report["environment"]
    lines = [
        f"Workload {w['name']}: {w['num_requests']} requests, {w['prompt_tokens']} prompt tokens "
        f"(longest {w['max_prompt_len']}), max_new_tokens {_span(w['max_new_tokens'])}"
        + (", EOS ignored" if w["ignore_eos"] else ", greedy, stop at EOS"),
        f"Model {Path(m['path']).name} on {m['device']} ({m['dtype']}), torch {env['torch']} "
        f"({env['torch_threads']} threads), transformers {env['transformers']}",
        "",
    ]
    header = ("system", "wall s", "req/s", "out tok/s", "total tok/s", "out tokens", "conveyor is")
    rows = []
    for name, s in report["systems"].items():
        ratio = report["ratios"].get(name)
        rows.append((SYSTEM_LABELS.get(name, name), f"{s['wall_s']:.2f}", f"{s['requests_per_s']:.2f}",
                     f"{s['output_tok_per_s']:.1f}", f"{s['total_tok_per_s']:.1f}", str(s["output_tokens"]),
                     "-" if name == CONVEYOR else (f"{ratio:.2f}x" if ratio else "n/a")))
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
        notes.append(f"conveyor: page_size {c['page_size']}, {engine['total_blocks']} KV blocks, max_batch_tokens "
                     f"{c['max_batch_tokens']}, {c['scheduler_type']}; prefilled {engine['prefill_tokens']} tokens, "
                     f"prefix cache {engine['prefix_cache_hit_tokens']} of {engine['prefix_cache_query_tokens']} "
                     f"queried tokens hit ({'on' if c['allow_block_sharing'] else 'off'}); offloads "
                     f"{engine['offloads']} (swapped {engine['swap_outs']}, swapped in {engine['swap_ins']}, "
                     f"soft resets {engine['soft_resets']})")
    cb = report["systems"].get(HF_CB)
    if cb:
        notes.append(f"hf generate_batch: {cb['api']}, attn {cb['attn_implementation']}, page_size {cb['page_size']}, "
                     f"num_blocks {cb['num_blocks']}, max_batch_tokens {cb['max_batch_tokens']}, "
                     f"max_requests_per_batch {cb['max_requests_per_batch']}; wall excludes {cb['setup_s']:.2f} s of "
                     f"manager/cache setup (whole call {cb['call_s']:.2f} s)")
    st = report["systems"].get(HF_STATIC)
    if st:
        notes.append(f"hf generate: batches of {st['batch_size']}, left-padded, attn {st['attn_implementation']}")
    if "hf_loaded_via" in m:
        notes.append(f"hf model: {m['hf_loaded_via']}")
    if notes:
        lines += [""] + notes
    if report["greedy_match"]:
        lines += ["", "Greedy outputs vs conveyor (token ids, per request):"]
        for name, g in report["greedy_match"].items():
            label = SYSTEM_LABELS.get(name, name)
            lines.append(f"  {label}: {g['exact_matches']}/{g['num_requests']} identical"
                         + ("" if not g["mismatches"] else f", {len(g['mismatches'])} MISMATCHED:"))
            for mm in g["mismatches"]:
                detail = (f"first difference at output token {mm['first_diff']}" if mm["first_diff"] is not None
                          else "same tokens")
                err = f", error: {mm['error']}" if mm.get("error") else ""
                lines.append(f"    request {mm['index']}: {detail} (conveyor {mm['conveyor_len']} tokens, "
                             f"baseline {mm['baseline_len']}){err}")
    return "\n".join(lines)


def _span(values: list[int]) -> str:
    return str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}"


# -- command line ---------------------------------------------------------------------------------
def add_arguments(parser: Any) -> None:
    parser.add_argument("workload", nargs="?", help="workload JSON file (prompts or requests layout)")
    parser.add_argument("--model", default=None,
                        help="HF model directory or .gguf file (default: the built-in SmolLM2-135M-Instruct GGUF)")
    parser.add_argument("--compare", action="append", choices=sorted(COMPARE_CHOICES), default=[],
                        help="also run transformers baselines on the same weights: hf = generate_batch and "
                             "static generate; hf-cb / hf-generate = just one (repeatable)")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N requests")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="override every request's max_new_tokens")
    parser.add_argument("--out", default=None, help="write the full report (all figures) as JSON here")
    parser.add_argument("--plot", default=None, metavar="PNG",
                        help="draw output and total tok/s per system as a bar chart (needs matplotlib)")
    syn = parser.add_argument_group("synthetic workload (instead of a file; random token ids, EOS ignored)")
    syn.add_argument("--synthetic-input-len", type=int, default=None)
    syn.add_argument("--synthetic-output-len", type=int, default=None)
    syn.add_argument("--num-prompts", type=int, default=None)
    syn.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts")
    eng = parser.add_argument_group("engine")
    eng.add_argument("--threads", type=int, default=None,
                     help="torch intra-op threads for every system (default: torch's). On a machine shared with "
                          "other busy processes, fewer threads than cores avoids a many-fold slowdown")
    eng.add_argument("--device", default="auto")
    eng.add_argument("--dtype", default="auto", help="auto = fp32 on CPU, bf16 on CUDA")
    eng.add_argument("--max-batch-tokens", type=int, default=None,
                     help="Conveyor's per-pass token budget (default: ContinuousBatchingConfig's)")
    eng.add_argument("--max-requests-per-batch", type=int, default=None)
    eng.add_argument("--num-blocks", type=int, default=None, help="Conveyor's KV pool size in blocks")
    eng.add_argument("--page-size", type=int, default=None)
    eng.add_argument("--scheduler-type", choices=("fifo", "prefill_first"), default=None)
    eng.add_argument("--cpu-offload-space", type=float, default=None, metavar="GIB",
                     help="host swap space for offloaded requests' KV blocks (default 0: soft resets)")
    eng.add_argument("--no-block-sharing", action="store_true", help="allow_block_sharing=False: no prefix caching")
    hf = parser.add_argument_group("transformers baselines")
    hf.add_argument("--hf-batch-size", type=int, default=16, help="batch size of static generate (default 16)")
    hf.add_argument("--hf-max-batch-tokens", type=int, default=-1,
                    help="generate_batch's max_batch_tokens: -1 = same as Conveyor (default), "
                         "0 = transformers' default")
    hf.add_argument("--hf-max-requests-per-batch", type=int, default=-1,
                    help="generate_batch's max_requests_per_batch: -1 = same as Conveyor (default), "
                         "0 = transformers' default")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--no-token-ids", action="store_true", help="leave per-request token ids out of --out")


def run_from_args(args: Any) -> int:
    from .workloads import load_workload, synthetic_workload

    synthetic = (args.synthetic_input_len, args.synthetic_output_len, args.num_prompts)
    if args.workload is not None and any(v is not None for v in synthetic):
        raise SystemExit("error: give either a workload file or --synthetic-* options, not both")
    if args.workload is None and not all(v is not None for v in synthetic):
        raise SystemExit("error: give a workload file, or all of --synthetic-input-len, --synthetic-output-len "
                         "and --num-prompts")
    plot = getattr(args, "plot", None)
    if plot:  # fail before the (long) run, not after it
        from .plot import PlotDependencyError, require_matplotlib

        try:
            require_matplotlib()
        except PlotDependencyError as exc:
            raise SystemExit(f"error: {exc}") from None
    workload = None
    if args.workload is not None:
        try:
            workload = load_workload(args.workload).limit(args.limit).with_max_new_tokens(args.max_new_tokens)
        except (OSError, WorkloadError) as exc:
            raise SystemExit(f"error: {exc}") from None

    import torch  # after argument errors, which should not wait for torch

    if args.threads is not None:
        if args.threads < 1:
            raise SystemExit(f"error: --threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)

    from .. import LLM, ContinuousBatchingConfig

    overrides = {k: v for k, v in (("max_batch_tokens", args.max_batch_tokens),
                                   ("max_requests_per_batch", args.max_requests_per_batch),
                                   ("num_blocks", args.num_blocks), ("page_size", args.page_size),
                                   ("scheduler_type", args.scheduler_type),
                                   ("cpu_offload_space", args.cpu_offload_space)) if v is not None}
    if args.no_block_sharing:
        overrides["allow_block_sharing"] = False
    started = time.perf_counter()
    llm = LLM(args.model, device=args.device, dtype=args.dtype, config=ContinuousBatchingConfig(**overrides))
    print(f"Loaded {llm.model_path.name} in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    if workload is None:
        tokenizer = llm.get_tokenizer()
        workload = synthetic_workload(args.synthetic_input_len, args.synthetic_output_len, args.num_prompts,
                                      llm.engine.vocab_size, seed=args.seed,
                                      exclude_token_ids=getattr(tokenizer, "all_special_ids", []) or [])
        workload = workload.limit(args.limit).with_max_new_tokens(args.max_new_tokens)

    def hf_value(v: int) -> int | None:
        return None if v == 0 else v

    report = run_throughput(workload, llm=llm, model=args.model, compare=args.compare,
                            hf_batch_size=args.hf_batch_size,
                            hf_max_batch_tokens=hf_value(args.hf_max_batch_tokens),
                            hf_max_requests_per_batch=hf_value(args.hf_max_requests_per_batch),
                            progress=not args.no_progress, include_token_ids=not args.no_token_ids)
    print(format_report(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"\nWrote {args.out}")
    if plot:
        from .plot import plot_throughput

        plot_throughput(report, plot)
        print(f"Wrote {plot}")
    failed = any(s["num_errors"] for s in report["systems"].values())
    return 1 if failed else 0
