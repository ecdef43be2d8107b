"""Tests of `python -m tools.simulate` (static vs continuous batching, the replay through Conveyor's real
scheduler, the plan over replicas and tensor parallelism) and of its timeline PNGs (matplotlib is part of
the test extra)."""

from __future__ import annotations

import json
import math
import sys

import matplotlib  # noqa: F401  (a test dependency: plots must be covered, never skipped)
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tools.simulate.batching import (
    DEFAULT_LENGTHS,
    DEFAULT_SLOTS,
    continuous_batching,
    replay_scheduler,
    simulate,
    static_batching,
)
from tools.simulate.cli import main
from tools.simulate.timeline_plot import plot_timeline

from tests.utils import assert_png


# -- the documented figures -----------------------------------------------------------------------
def test_static_batching_matches_the_documented_figures():
    t = static_batching(DEFAULT_LENGTHS, DEFAULT_SLOTS)
    assert list(DEFAULT_LENGTHS) == [5, 50, 8, 12, 40, 3, 30, 7] and DEFAULT_SLOTS == 4
    assert t.steps == 90 == 50 + 40
    assert (t.busy_slot_steps, t.slot_steps) == (155, 360)
    assert t.busy_fraction == 155 / 360 and f"{t.busy_fraction:.0%}" == "43%"
    # groups in order: requests 0-3 from step 0, requests 4-7 from step 50
    assert [(s.request, s.slot, s.start) for s in t.segments] == [
        (0, 0, 0), (1, 1, 0), (2, 2, 0), (3, 3, 0), (4, 0, 50), (5, 1, 50), (6, 2, 50), (7, 3, 50)]


def test_continuous_batching_matches_the_documented_figures():
    t = continuous_batching(DEFAULT_LENGTHS, DEFAULT_SLOTS)
    assert t.steps == 50
    assert (t.busy_slot_steps, t.slot_steps) == (155, 200)
    assert t.busy_fraction == 155 / 200 and f"{t.busy_fraction:.0%}" == "78%"
    # a freed slot is taken at the very next step: r4 follows r0 (step 5), r5 follows r2 (step 8), ...
    starts = {s.request: (s.slot, s.start) for s in t.segments}
    assert starts == {0: (0, 0), 1: (1, 0), 2: (2, 0), 3: (3, 0), 4: (0, 5), 5: (2, 8), 6: (2, 11), 7: (3, 12)}


def test_scheduler_replay_gives_the_continuous_figures():
    t = replay_scheduler(DEFAULT_LENGTHS, DEFAULT_SLOTS)
    assert t.steps == 50 and (t.busy_slot_steps, t.slot_steps) == (155, 200)
    assert f"{t.busy_fraction:.0%}" == "78%"
    assert t.extra["max_requests_in_a_step"] == 4
    ideal = continuous_batching(DEFAULT_LENGTHS, DEFAULT_SLOTS)
    key = lambda s: s.request  # noqa: E731
    assert sorted(t.segments, key=key) == sorted(ideal.segments, key=key)


def test_simulate_report():
    report = simulate()
    systems = report["systems"]
    assert [(s["steps"], s["busy_slot_steps"], s["slot_steps"]) for s in systems.values()] == [
        (90, 155, 360), (50, 155, 200), (50, 155, 200)]
    assert list(systems) == ["static", "continuous", "conveyor"]
    assert report["total_tokens"] == 155 and report["static_over_continuous_steps"] == 90 / 50
    json.dumps(report)


# -- generalisation -------------------------------------------------------------------------------
@pytest.mark.parametrize("lengths, slots", [([7] * 8, 4), ([3] * 5, 2), ([1], 1), ([9, 9, 9], 3)])
def test_equal_lengths_give_equal_steps(lengths, slots):
    static, continuous = static_batching(lengths, slots), continuous_batching(lengths, slots)
    assert static.steps == continuous.steps == lengths[0] * math.ceil(len(lengths) / slots)


@pytest.mark.parametrize("slots", [8, 9, 100])
def test_enough_slots_for_everyone_takes_the_longest_request(slots):
    for fn in (static_batching, continuous_batching, replay_scheduler):
        t = fn(DEFAULT_LENGTHS, slots)
        assert t.steps == max(DEFAULT_LENGTHS) and t.busy_slot_steps == 155


def test_one_slot_runs_requests_back_to_back():
    for fn in (static_batching, continuous_batching, replay_scheduler):
        assert fn(DEFAULT_LENGTHS, 1).steps == sum(DEFAULT_LENGTHS)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 20), min_size=1, max_size=12), st.integers(1, 6),
       st.sampled_from(["fifo", "prefill_first"]))
def test_invariants_and_scheduler_matches_ideal_continuous(lengths, slots, scheduler_type):
    static, ideal = static_batching(lengths, slots), continuous_batching(lengths, slots)
    real = replay_scheduler(lengths, slots, scheduler_type=scheduler_type)
    lower = max(max(lengths), math.ceil(sum(lengths) / slots))
    assert lower <= ideal.steps <= static.steps
    assert real.steps == ideal.steps and real.busy_slot_steps == sum(lengths)
    for t in (static, ideal, real):
        assert 0 < t.busy_fraction <= 1
        assert sorted(s.request for s in t.segments) == list(range(len(lengths)))
        # no slot ever holds two requests at once
        for slot in range(slots):
            spans = sorted((s.start, s.end) for s in t.segments if s.slot == slot)
            assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
        assert max(s.end for s in t.segments) == t.steps


@pytest.mark.parametrize("lengths, slots", [([], 4), ([3, 0], 2), ([3], 0)])
def test_bad_inputs_are_refused(lengths, slots):
    with pytest.raises(ValueError):
        static_batching(lengths, slots)


# -- command line ---------------------------------------------------------------------------------
def test_cli_simulate_prints_and_writes_json_and_png(tmp_path, capsys):
    out, png = tmp_path / "sim.json", tmp_path / "plots" / "sim.png"
    assert main(["--out", str(out), "--plot", str(png)]) == 0
    printed = capsys.readouterr().out
    assert "90" in printed and "43%" in printed and "50" in printed and "78%" in printed
    report = json.loads(out.read_text())
    assert report["benchmark"] == "simulate" and report["lengths"] == list(DEFAULT_LENGTHS)
    assert {k: (v["steps"], round(v["busy_fraction"], 4)) for k, v in report["systems"].items()} == {
        "static": (90, round(155 / 360, 4)), "continuous": (50, 0.775), "conveyor": (50, 0.775)}
    assert_png(png)


def test_cli_simulate_custom_lengths(tmp_path):
    out = tmp_path / "sim.json"
    assert main(["--lengths", "4,4,4", "--slots", "2", "--no-scheduler", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert list(report["systems"]) == ["static", "continuous"]
    assert report["systems"]["static"]["steps"] == report["systems"]["continuous"]["steps"] == 8


@pytest.mark.parametrize("argv", [["--lengths", "5,x"], ["--lengths", "5,0"], ["--slots", "0"]])
def test_cli_simulate_rejects_bad_arguments(argv):
    with pytest.raises(SystemExit):
        main(argv)


def test_missing_matplotlib_gives_an_install_hint(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(ImportError, match="pip install"):
        plot_timeline([static_batching([1], 1)], tmp_path / "x.png")
    with pytest.raises(SystemExit, match="pip install"):
        main(["--no-scheduler", "--plot", str(tmp_path / "x.png")])
    assert not (tmp_path / "x.png").exists()


# -- timeline plots -------------------------------------------------------------------------------
def test_plot_timeline_from_objects_and_json(tmp_path):
    report = json.loads(json.dumps(simulate(scheduler=False)))
    assert_png(plot_timeline(list(report["systems"].values()), tmp_path / "a.png"))
    many = [static_batching(list(range(1, 25)), 5), continuous_batching(list(range(1, 25)), 5)]
    assert_png(plot_timeline(many, tmp_path / "b.png", title="24 requests"))


# -- the scaling plan (replicas x tensor parallelism) ------------------------------------------------
def test_allreduce_fit_recovers_a_line():
    from tools.simulate.allreduce import fit

    points = [(b, 50e-6 + b / 4e9) for b in (1_000, 10_000, 100_000, 1_000_000)]
    line = fit(points, "synthetic")
    assert line.latency_us == pytest.approx(50, rel=1e-6) and line.gbps == pytest.approx(4, rel=1e-6)
    assert line.seconds(2e9) == pytest.approx(50e-6 + 0.5)


def test_allreduce_is_measured_between_two_ranks():
    from tools.simulate.allreduce import measure

    line = measure(64, "float32", repeats=3, rows=(1, 16))
    assert [b for b, _ in line.points] == [64 * 4, 16 * 64 * 4] and all(s > 0 for _, s in line.points)
    assert line.latency_us >= 0 and line.gbps > 0 and "gloo" in line.source


def test_cost_model_and_replica_steps():
    from tools.simulate.allreduce import AllReduceFit
    from tools.simulate.scaling import CostModel, plan, replica_rows

    rows = replica_rows(DEFAULT_LENGTHS, DEFAULT_SLOTS)
    assert len(rows) == 50 and sum(rows) == sum(DEFAULT_LENGTHS) and max(rows) == 4  # continuous batching's figures
    model = CostModel(hidden_size=100, num_layers=2, vocab_size=1000, act_bytes=2, step_ms=10.0, row_ms=1.0,
                      allreduce=AllReduceFit(latency_us=100.0, gbps=1.0))
    assert model.step_s(4, 1) == pytest.approx(0.013)  # no communication at TP=1
    allreduce = 100e-6 + 4 * 100 * 2 / 1e9  # two ranks: the measured line itself
    gather = 100e-6 + 4 * 500 * 4 / 1e9
    assert model.step_s(4, 2) == pytest.approx(0.013 / 2 + 5 * allreduce + gather)
    table = {(r.replicas, r.tp): r for r in plan(DEFAULT_LENGTHS, DEFAULT_SLOTS, [1, 2], [1, 2], model)}
    assert table[2, 1].makespan_s < table[1, 1].makespan_s and table[2, 2].ranks == 4
    assert table[1, 2].comm_share_full == pytest.approx(model.comm_s(4, 2) / model.step_s(4, 2))


def test_cli_simulate_plans_replicas_and_tensor_parallelism(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["--no-scheduler", "--replicas", "1,2", "--tensor-parallel-sizes", "1,2",
                 "--allreduce-latency-us", "40", "--allreduce-gbps", "10", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Scaling plan" in text and "40 us + bytes / 10.00 GB/s (given)" in text and "2 x 2" in text
    plan = json.loads(out.read_text())["plan"]
    assert [(r["replicas"], r["tp"]) for r in plan["rows"]] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert plan["model"]["hidden_size"] == 576 and plan["allreduce"]["source"] == "given"
