"""The PNG plots of conveyor.bench.plot (matplotlib is part of the test extra): throughput, latency
percentiles, rate sweeps, and the install hint without matplotlib."""

from __future__ import annotations

import sys

import matplotlib  # noqa: F401  (a test dependency: plots must be covered, never skipped)
import pytest

from conveyor.bench.commands import build_parser
from conveyor.bench.plot import (
    PlotDependencyError,
    plot_latency_percentiles,
    plot_rate_sweep,
    plot_throughput,
    require_matplotlib,
    summarize,
)

from tests.utils import assert_png


def test_throughput_accepts_plot_option():
    args = build_parser().parse_args(["throughput", "w.json", "--plot", "t.png"])
    assert args.plot == "t.png"


def test_missing_matplotlib_gives_an_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(PlotDependencyError, match=r"pip install matplotlib.*conveyor\[bench\]"):
        require_matplotlib()


THROUGHPUT_REPORT = {
    "benchmark": "throughput",
    "workload": {"name": "chat-tiny"},
    "model": {"path": "/models/SmolLM2-135M-Instruct.gguf", "device": "cpu"},
    "systems": {"conveyor": {"output_tok_per_s": 412.5, "total_tok_per_s": 1630.2},
                "hf_generate_batch": {"output_tok_per_s": 150.1, "total_tok_per_s": 590.4},
                "hf_generate": {"output_tok_per_s": 98.0, "total_tok_per_s": 380.0}},
    "ratios": {"hf_generate_batch": 412.5 / 150.1, "hf_generate": 412.5 / 98.0},
}


def test_plot_throughput(tmp_path):
    assert_png(plot_throughput(THROUGHPUT_REPORT, tmp_path / "t.png"))
    no_ratios = {"systems": {"conveyor": {"output_tok_per_s": 10.0, "total_tok_per_s": 20.0}}}
    assert_png(plot_throughput(no_ratios, tmp_path / "t1.png"))
    with pytest.raises(ValueError):
        plot_throughput({"systems": {}}, tmp_path / "t2.png")


def test_plot_latency_percentiles(tmp_path):
    metrics = {"ttft_s": {"mean": 0.21, "median": 0.18, "p99": 0.92},
               "tpot_s": {"mean": 0.031, "median": 0.029, "p99": 0.06},
               "e2e_latency_s": [1.0, 2.0, 3.0, 10.0]}
    assert_png(plot_latency_percentiles(metrics, tmp_path / "lat.png"))
    assert summarize([1.0, 2.0, 3.0, 10.0]) == pytest.approx({"mean": 4.0, "median": 2.5, "p90": 7.9, "p99": 9.79})


def test_plot_rate_sweep(tmp_path):
    results = [{"system": s, "request_rate": r, "output_tok_per_s": tput * f, "ttft_p99_s": ttft / f}
               for s, f in (("conveyor", 1.0), ("hf", 0.5))
               for r, tput, ttft in ((1, 100.0, 0.1), (4, 350.0, 0.2), (16, 600.0, 1.5), (None, 650.0, 4.0))]
    assert_png(plot_rate_sweep(results, tmp_path / "sweep.png"))
    assert_png(plot_rate_sweep([{"request_rate": 2.0, "output_tok_per_s": 5.0, "ttft_p99_s": 0.5}],
                               tmp_path / "one.png"))
