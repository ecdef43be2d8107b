"""`python -m conveyor.bench SUBCOMMAND ...` (and, once mounted, `conveyor bench ...`).

Subcommands: `throughput` (offline throughput, optionally against transformers). Planned: serve,
simulate, roofline. The project CLI can mount the suite with `add_subcommands(subparsers)` or
simply call `main(argv)`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence


def build_parser(prog: str = "python -m conveyor.bench") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Conveyor benchmark suite")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    add_subcommands(parser.add_subparsers(dest="command", metavar="COMMAND", required=True))
    return parser


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    """Register every benchmark subcommand; each sets `func(args) -> exit code`."""
    from . import throughput

    p = subparsers.add_parser(
        "throughput", help="offline throughput of LLM.generate on a workload (optionally vs transformers)",
        description="Offline throughput: Conveyor's LLM.generate on all prompts at once (only the generate call "
                    "is timed, after a small warm-up); --compare hf also runs transformers' generate_batch and "
                    "static generate on the same weights and compares greedy outputs.")
    throughput.add_arguments(p)
    p.set_defaults(func=throughput.run_from_args)


def main(argv: Sequence[str] | None = None, prog: str = "python -m conveyor.bench") -> int:
    """Run a benchmark subcommand; returns the exit code. `prog` names the command in usage messages."""
    args = build_parser(prog).parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return args.func(args)
