"""`python -m tools.roofline {ceiling,step,pair} ...`: the roofline tool's command line."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from . import pair, report

COMMANDS = [
    ("ceiling", report, {},
     "matmul rates and the dense-decode ceiling of the model (contiguous K/V, no paging)",
     "Times the model's linear layers on each of its weight shapes at M = batch rows (GFLOP/s and the linear-only "
     "tok/s ceiling), then one decode step of the same model over contiguous K/V (batch sequences of context "
     "tokens, one SDPA per layer, no paging or scheduling): the dense ceiling."),
    ("step", report, {"step": True},
     "Conveyor's real decode step, split into forward / LM head + sampling / prepare / rest, against the "
     "dense ceiling",
     "Runs the ceiling's measurements, then prefills batch random prompts of context tokens in Conveyor's "
     "engine and times Engine.step() split into model forward, LM head + sampling, input preparation and the "
     "rest; prints the step's ratio to the dense ceiling of the same run, and its weight-streaming rate "
     "(weight bytes per step over forward + LM head time) against the machine's measured read bandwidth."),
    ("pair", pair, {},
     "two models' decode steps interleaved step by step: each one's median and the ratio B / A",
     "Loads both models, prefills batch random prompts of context tokens in each, then alternates their "
     "engine steps (A, B, A, B, ...) so every pair sees the same machine; prints each model's median decode "
     "step and the median of the per-pair ratios B / A (e.g. a mixture-of-experts model against a dense "
     "model with the same active parameters)."),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tools.roofline",
                                     description="How close a decode step is to what the hardware and the model "
                                                 "allow (tools/roofline/__init__.py)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module, extra, help_text, description in COMMANDS:
        p = sub.add_parser(name, help=help_text, description=description)
        module.add_arguments(p, **extra)
        p.set_defaults(func=module.run_from_args)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one of the roofline commands; returns the exit code."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return args.func(args)
