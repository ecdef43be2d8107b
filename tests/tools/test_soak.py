"""The soak's short form: `conveyor serve` (a subprocess: its own RSS) under a mixed load with
disconnects and cancels for about half a minute; `python -m tools.soak --minutes N` is the long run.
The memory limit applies to the RSS outside the KV pool (see tools/soak.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from conveyor.bench.launch import launched_server
from tools.soak import Soak, print_report

from tests.serving_helpers import save_long_tiny


@pytest.mark.slow
def test_soak_short(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = save_long_tiny(tmp_path / "tiny", context=512)
    with launched_server(model=str(model), dtype="float32", timeout_s=180,
                         extra_args=["--num-blocks", "512", "--max-queue", "64", "--max-batch-tokens", "256"]) as info:
        soak = Soak(info["base_url"], seconds=45, concurrency=6, pid=info["pid"], seed=1, max_tokens=24, api_key=None)
        # Caches keyed by batch shape fill for the first tens of seconds (a 150-s run of this load: outside
        # the pool +16 MiB in 25-50 s, +8 in 50-100 s, +5 in 100-145 s): growth is measured over the
        # second half.
        soak.report.warmup_fraction = 0.5
        report = asyncio.run(soak.run())
    print_report(report)
    print(capsys.readouterr().out)  # shown with -s
    d = report.as_dict()
    assert report.requests >= 60 and {"plain", "stream", "chat", "n", "stop", "long", "over-limit", "disconnect",
                                       "cancel"} <= set(report.kinds), d
    assert report.statuses["abandoned"] > 0 and report.statuses["200"] > 0 and report.statuses["400"] > 0, d
    assert report.server_errors == 0 and report.incomplete == 0 and not report.unexpected, d
    assert report.health_checks > 20 and report.health_failures == 0, d
    assert report.idle, d  # nothing in flight, every KV block free or cached
    # The pool's own pages become resident as traffic first writes its chunks (CPU: `torch.empty`), so
    # they are reported apart; they can never pass the pool's size.
    window = report.window()
    assert window is not None and 0 < window["pool"][0] <= window["pool"][1] <= report.pool_mib, d
    # The soak's target: the RSS outside the KV pool grows < 5% after warm-up (tools/soak.py exits 1 past
    # it); oneDNN's primitive cache, bounded to 64 shapes (conveyor/__init__.py), was most of the growth.
    assert report.rss_growth < 0.05, d


@pytest.mark.parametrize("module", ["soak", "fuzz"])
def test_launch_options_of_the_soak_and_fuzz_commands(module: str) -> None:
    """Their parsers have no --speculative-config (bench serve's): --launch must still build its options."""
    import argparse
    import importlib

    from conveyor.bench.launch import launch_options

    parser = argparse.ArgumentParser()
    importlib.import_module(f"tools.{module}").add_arguments(parser)
    options = launch_options(parser.parse_args(["--launch", "--dtype", "float32", "--launch-args", "--num-blocks 64"]))
    assert options is not None and options["dtype"] == "float32" and options["extra_args"] == ["--num-blocks", "64"]
