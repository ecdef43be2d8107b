"""`python -m tools.gpu_check`: the bench half of the device check (`scripts/gpu_check.sh` runs the
CUDA tests first and hands their JUnit file over).

Workloads: one stream (one synthetic request), chat64 (the file travels in the package,
conveyor/bench/data/chat64.json) and a synthetic 512 x (512 prompt -> 256 output) run, each in every
mode (eager, CUDA graphs, graphs + async batching: `use_cuda_graph` / `use_async_batching` passed
through `ContinuousBatchingConfig`), then transformers' `generate_batch` on the same GPU and
weights. A run that raises is recorded as an error row and the check goes on; runs that would
start past `--budget-s` are listed as skipped, so the command always ends with its table.
Prints one summary table and writes the whole report as JSON (`--out DIR/gpu_check.json`).
"""

from __future__ import annotations

import gc
import json
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import conveyor.bench
from conveyor.bench.modes import add_mode_arguments, resolved_mode
from conveyor.bench.throughput_report import compare_outputs
from conveyor.bench.workloads import Workload, load_workload, render_prompts, synthetic_workload

CHAT64 = Path(conveyor.bench.__file__).parent / "data" / "chat64.json"
MODES: dict[str, dict[str, bool]] = {
    "eager": {"use_cuda_graph": False, "use_async_batching": False},
    "graphs": {"use_cuda_graph": True, "use_async_batching": False},
    "graphs+async": {"use_cuda_graph": True, "use_async_batching": True},
}
HF = "hf-generate_batch"
WORKLOADS = ("one-stream", "chat64", "synthetic")


@dataclass
class Row:
    """One system on one workload: throughput or the error that stopped it."""

    workload: str
    system: str
    wall_s: float | None = None
    output_tokens: int = 0
    output_tok_per_s: float | None = None
    total_tok_per_s: float | None = None
    requests: int = 0
    errors: int = 0
    error: str | None = None
    greedy_match_eager: float | None = None  # fraction of requests identical to eager's (bf16: informative)
    vs_eager: float | None = None
    vs_hf: float | None = None


def _subset(text: str, choices: object, flag: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or any(n not in choices for n in names):  # type: ignore[operator]
        raise ValueError(f"{flag} must be a comma-separated subset of {list(choices)}, got {text!r}")  # type: ignore[call-overload]
    return names


def parse_modes(text: str) -> list[str]:
    return _subset(text, MODES, "--modes")


def parse_workloads(text: str) -> list[str]:
    return _subset(text, WORKLOADS, "--workloads")


def mode_config(base: dict[str, Any], mode: str) -> Any:
    """The engine config of `mode`: the common settings plus its graph / async flags."""
    from conveyor import ContinuousBatchingConfig

    return ContinuousBatchingConfig(**base, **MODES[mode])


def junit_summary(path: str | Path | None) -> dict[str, Any] | None:
    """Counts of a pytest JUnit XML file (None: no file given; `error` if it cannot be read)."""
    if path is None:
        return None
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as exc:
        return {"error": f"cannot read {path}: {exc}"}
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    counts["failed"] = [f"{case.get('classname')}::{case.get('name')}" for s in suites for case in s.iter("testcase")
                        if case.find("failure") is not None or case.find("error") is not None][:20]
    return counts


def add_ratios(rows: list[Row]) -> None:
    """Each row's output tok/s over eager's and over transformers' on the same workload."""
    by = {(r.workload, r.system): r for r in rows if r.output_tok_per_s}
    for row in rows:
        if not row.output_tok_per_s:
            continue
        for attr, system in (("vs_eager", "eager"), ("vs_hf", HF)):
            ref = by.get((row.workload, system))
            if ref is not None and ref is not row:
                setattr(row, attr, row.output_tok_per_s / ref.output_tok_per_s)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(report: dict[str, Any]) -> str:
    """The summary: header lines (device, model, tests), one line per row, then what was skipped."""
    env, model, tests = report["environment"], report["model"], report.get("tests")
    lines = [f"gpu-check on {env.get('cuda_device') or 'CPU'} (torch {env.get('torch')}, transformers "
             f"{env.get('transformers')}); model {model.get('name')} ({model.get('weights')}), {model.get('dtype')}"]
    if tests is not None:
        if "error" in tests:
            lines.append(f"cuda tests: {tests['error']}")
        else:
            lines.append(f"cuda tests: {tests['passed']} passed, {tests['failures'] + tests['errors']} failed, "
                         f"{tests['skipped']} skipped" + (f"; failed: {', '.join(tests['failed'])}"
                                                          if tests["failed"] else ""))
    header = f"{'workload':<11} {'system':<18} {'wall s':>8} {'out tok':>8} {'out tok/s':>10} {'total tok/s':>11} " \
             f"{'vs eager':>8} {'vs hf':>7} {'=eager':>6}  note"
    lines += [header, "-" * len(header)]
    for r in (Row(**row) for row in report["rows"]):
        note = r.error or (f"{r.errors} request errors" if r.errors else "")
        lines.append(f"{r.workload:<11} {r.system:<18} {_fmt(r.wall_s, '8.2f')} {r.output_tokens:>8} "
                     f"{_fmt(r.output_tok_per_s, '10.1f')} {_fmt(r.total_tok_per_s, '11.1f')} "
                     f"{_fmt(r.vs_eager, '7.2f')}x {_fmt(r.vs_hf, '6.2f')}x {_fmt(r.greedy_match_eager, '6.2f')}  "
                     f"{note[:80]}")
    for skipped in report["skipped"]:
        lines.append(f"skipped: {skipped}")
    return "\n".join(lines)


def make_workloads(names: list[str], args: Any, vocab_size: int, special: list[int]) -> dict[str, Workload]:
    out: dict[str, Workload] = {}
    for name in names:
        if name == "one-stream":
            out[name] = synthetic_workload(args.stream_input_len, args.stream_output_len, 1, vocab_size, seed=1,
                                           exclude_token_ids=special)
        elif name == "chat64":
            out[name] = load_workload(args.chat_workload)
        else:
            out[name] = synthetic_workload(args.input_len, args.output_len, args.num_prompts, vocab_size, seed=0,
                                           exclude_token_ids=special)
    return out


def _row_from(workload: str, system: str, result: Any, prompt_lens: list[int]) -> Row:
    out = sum(len(t) for t in result.token_ids)
    wall = max(result.wall_s, 1e-9)
    errors = [e for e in result.errors if e]
    return Row(workload, system, wall_s=result.wall_s, output_tokens=out, output_tok_per_s=out / wall,
               total_tok_per_s=(out + sum(prompt_lens)) / wall, requests=len(result.token_ids), errors=len(errors),
               error=errors[0] if errors else None)


def _release(device: Any) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_check(args: Any, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every mode on every workload, then transformers; the report as a JSON-able dict."""
    from conveyor import LLM
    from conveyor.bench.hf_baselines import load_hf_model, run_generate_batch
    from conveyor.bench.throughput import environment, run_conveyor, warmup_prompt

    started = time.monotonic()
    over = lambda: time.monotonic() - started > args.budget_s  # noqa: E731
    base = {"max_batch_tokens": args.max_batch_tokens, "max_requests_per_batch": args.max_requests_per_batch}
    rows: list[Row] = []
    skipped: list[str] = []
    tokens: dict[tuple[str, str], list[list[int]]] = {}
    report: dict[str, Any] = {"benchmark": "gpu-check", "environment": environment(), "tests": junit_summary(
        args.tests_junit), "config": base | {"budget_s": args.budget_s}, "model": {}, "rows": [], "skipped": skipped}
    workloads: dict[str, Workload] = {}
    prompts: dict[str, list[list[int]]] = {}

    def measure(name: str, system: str, run: Callable[[], Any]) -> None:
        """One workload on one system: its row (or an error row), its token ids, a log line."""
        if over():
            skipped.append(f"{name} / {system}: past the time budget")
            return
        try:
            result = run()
        except Exception as exc:
            rows.append(Row(name, system, error=f"{type(exc).__name__}: {exc}"))
            return
        rows.append(_row_from(name, system, result, [len(p) for p in prompts[name]]))
        tokens[(name, system)] = result.token_ids
        log(f"{name} / {system}: {rows[-1].output_tok_per_s:.1f} output tok/s")

    for mode in args.modes:
        if over():
            skipped += [f"{w} / {mode}: past the time budget" for w in args.workloads]
            continue
        try:
            llm = LLM(args.model, device=args.device, dtype=args.dtype, quantization=args.quantization,
                      config=mode_config(base, mode))
        except Exception as exc:  # a mode that cannot start is a row per workload, not the end of the check
            rows += [Row(w, mode, error=f"start: {type(exc).__name__}: {exc}") for w in args.workloads]
            log(f"{mode}: could not start: {exc}")
            continue
        if not workloads:
            tokenizer = llm.get_tokenizer()
            special = list(getattr(tokenizer, "all_special_ids", []) or [])
            workloads = make_workloads(args.workloads, args, llm.vocab_size, special)
            eos = list(llm.eos_token_ids)
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
            report["model"] = {"name": llm.model_path.name, "path": str(llm.model_path), "device": str(llm.device),
                               "weights": args.weights_note, "eos_token_ids": eos, "pad_token_id": pad,
                               **resolved_mode(llm)}
            report["warmup_prompt"] = warmup_prompt(llm.vocab_size, special)
        for name, workload in workloads.items():
            def ours(name: str = name, workload: Workload = workload, llm: LLM = llm) -> Any:
                prompts.setdefault(name, render_prompts(workload, llm.render_chat))
                return run_conveyor(llm, prompts[name], workload, progress=False,
                                    warmup_prompt=report["warmup_prompt"])
            measure(name, mode, ours)
        device = llm.device
        del llm
        _release(device)
    if args.hf and prompts and not over():
        try:
            model = report["model"]  # its path: a Hub id's cached files
            hf, how = load_hf_model(model["path"], _dtype_of(model["dtype"]), _device_of(model))
            report["model"]["hf_loaded_via"] = how
        except Exception as exc:
            hf = None
            rows += [Row(w, HF, error=f"load: {type(exc).__name__}: {exc}") for w in prompts]
        for name in list(prompts) if hf is not None else ():
            def theirs(name: str = name) -> Any:
                requests = workloads[name].requests
                return run_generate_batch(
                    hf, prompts[name], [r.max_new_tokens for r in requests], report["model"]["eos_token_ids"],
                    report["model"]["pad_token_id"], [r.ignore_eos for r in requests],
                    max_batch_tokens=args.max_batch_tokens, max_requests_per_batch=args.max_requests_per_batch,
                    progress=False, warmup_prompt=report["warmup_prompt"])
            measure(name, HF, theirs)
        del hf
    elif args.hf:
        skipped.append(f"{HF}: past the time budget or nothing ran")
    for row in rows:
        eager = tokens.get((row.workload, "eager"))
        if eager is not None and (row.workload, row.system) in tokens and row.system != "eager":
            row.greedy_match_eager = compare_outputs(eager, tokens[(row.workload, row.system)])["identical_fraction"]
    add_ratios(rows)
    report["rows"] = [vars(r) for r in rows]
    report["wall_s"] = time.monotonic() - started
    return report


def _dtype_of(name: str) -> Any:
    import torch

    return getattr(torch, name)


def _device_of(model: dict[str, Any]) -> Any:
    import torch

    return torch.device(model["device"])


def random_model_from(config_dir: Path, out_dir: Path, seed: int = 0) -> Path:
    """An HF directory with the config and tokenizer of `config_dir` and seeded random weights: the
    stand-in when the built-in model's weights did not travel (same shapes, so the same speed)."""
    import shutil

    import torch
    import transformers

    out_dir.mkdir(parents=True, exist_ok=True)
    for file in config_dir.iterdir():
        if file.is_file() and file.name != "config.json":
            shutil.copy(file, out_dir / file.name)
    torch.manual_seed(seed)
    config = transformers.AutoConfig.from_pretrained(config_dir)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(out_dir)
    return out_dir


def resolve_model(args: Any) -> None:
    """Fill `args.model` and `args.weights_note`: the model asked for, else the built-in one, else a
    random-weight stand-in built from `--fallback-config`."""
    from conveyor.models.loader import default_model_path

    if args.model is not None:
        args.weights_note = "as given"
        return
    try:
        default_model_path()
        args.weights_note = "built-in GGUF"
    except FileNotFoundError:
        if args.fallback_config is None:
            raise SystemExit("error: the built-in model is not installed; give --model or --fallback-config") from None
        args.model = str(random_model_from(Path(args.fallback_config), Path(args.fallback_dir)))
        args.weights_note = f"random weights in {Path(args.fallback_config).name}'s shape (built-in GGUF absent)"


def add_arguments(parser: Any) -> None:
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: the built-in model)")
    parser.add_argument("--fallback-config", default=None, metavar="DIR",
                        help="config.json + tokenizer files of a random-weight stand-in, used when the built-in "
                             "model is not installed")
    parser.add_argument("--fallback-dir", default="/tmp/conveyor-gpu-check-model", help="where the stand-in goes")
    parser.add_argument("--device", default="auto")
    add_mode_arguments(parser)
    parser.add_argument("--modes", type=parse_modes, default=list(MODES), help=f"subset of {','.join(MODES)}")
    parser.add_argument("--workloads", type=parse_workloads, default=list(WORKLOADS),
                        help=f"subset of {','.join(WORKLOADS)}")
    parser.add_argument("--chat-workload", default=str(CHAT64), help="the chat64 workload file")
    parser.add_argument("--num-prompts", type=int, default=512)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--stream-input-len", type=int, default=128)
    parser.add_argument("--stream-output-len", type=int, default=256)
    parser.add_argument("--max-batch-tokens", type=int, default=2048)
    parser.add_argument("--max-requests-per-batch", type=int, default=256)
    parser.add_argument("--no-hf", dest="hf", action="store_false", help="skip transformers' generate_batch")
    parser.add_argument("--budget-s", type=float, default=240.0,
                        help="start no run after this many seconds (those left are listed as skipped)")
    parser.add_argument("--tests-junit", default=None, help="pytest JUnit XML of the CUDA tests, for the table")
    parser.add_argument("--out", default=None, metavar="DIR", help="write gpu_check.json here")


def run_from_args(args: Any) -> int:
    for name in ("num_prompts", "input_len", "output_len", "stream_input_len", "stream_output_len",
                 "max_batch_tokens", "max_requests_per_batch"):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if "chat64" in args.workloads and not Path(args.chat_workload).is_file():
        raise SystemExit(f"error: --chat-workload {args.chat_workload} does not exist")
    resolve_model(args)
    report = run_check(args, log=lambda line: print(line, file=sys.stderr, flush=True))
    table = format_table(report)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")
        (out / "gpu_check.txt").write_text(table + "\n")
        print(f"Wrote {out / 'gpu_check.json'}")
    tests = report["tests"] or {}
    failed = any(r["error"] or r["errors"] for r in report["rows"]) or tests.get("failures") or tests.get("errors") \
        or "error" in tests
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    """`python -m tools.gpu_check ...` (scripts/gpu_check.sh runs it); returns the exit code. It imports no
    serving benchmark: the device machine has no server packages."""
    import argparse
    import logging

    parser = argparse.ArgumentParser(
        prog="python -m tools.gpu_check",
        description="Runs every workload (one stream, chat64, 512 x (512 -> 256)) in every mode (use_cuda_graph / "
                    "use_async_batching passed through), then transformers' generate_batch on the same device and "
                    "weights; prints one table (with the CUDA tests' JUnit summary when --tests-junit is given) and "
                    "writes --out DIR/gpu_check.json. Driven by scripts/gpu_check.sh; --device cpu with a tiny model "
                    "and small sizes is a dry run.")
    add_arguments(parser)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
