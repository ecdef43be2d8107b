"""The dashboard: the engine's step ring, GET /dashboard/data, and the page itself in headless Chromium
(Debian's chromium + chromedriver, driven by Selenium; scripts/setup.sh --test installs them)."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from conveyor import LLM, ContinuousBatchingConfig, SamplingParams
from conveyor.config import ConfigError
from conveyor.engine.step_history import StepHistory
from conveyor.server import BackgroundServer

from tests.serving_helpers import long_tiny_llm, metric, save_long_tiny

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    return long_tiny_llm(save_long_tiny(tmp_path_factory.mktemp("dash_tiny")))


@pytest.fixture(scope="module")
def url(llm: LLM):
    with BackgroundServer(llm) as url:
        yield url


def test_step_history_off_by_default_and_counts_every_token(tmp_path: Path, llm: LLM) -> None:
    assert ContinuousBatchingConfig().step_history == 0
    with pytest.raises(ConfigError, match="step_history"):
        ContinuousBatchingConfig(step_history=-1)
    with pytest.raises(ValueError, match="step_history"):
        StepHistory(0)
    own = long_tiny_llm(llm.model_path, num_blocks=128, step_history=4)
    plain = long_tiny_llm(llm.model_path, num_blocks=128)
    assert plain.engine.step_history is None
    before = own.stats()
    own.generate([[5, 6, 7, 8, 9] * 60, [10, 11, 12]], SamplingParams(max_new_tokens=6, temperature=0,
                                                                        ignore_eos=True), use_tqdm=False)
    after = own.stats()
    total, records = own.engine.step_history.snapshot()
    assert len(records) == 4 and total > 4  # bounded: only the last 4 are kept
    assert [r.time for r in records] == sorted(r.time for r in records)
    assert all(r.duration > 0 and r.padding_tokens == 0 for r in records)
    # The last steps are decodes of both requests (prefill of 300 tokens took two passes of 256).
    assert records[-1].decode_rows in (1, 2) and records[-1].prefill_tokens == 0
    assert sum(r.sampled_tokens for r in records) <= after.generation_tokens - before.generation_tokens


def test_step_records_add_up_to_the_engine_counters(llm: LLM) -> None:
    own = long_tiny_llm(llm.model_path, num_blocks=128, step_history=1000)
    own.generate([[5] * 300, [7] * 40, [9] * 3], SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True),
                 use_tqdm=False)
    s = own.stats()
    total, records = own.engine.step_history.snapshot()
    assert total == len(records)
    assert sum(r.prefill_tokens for r in records) == s.prefill_tokens
    assert sum(r.sampled_tokens for r in records) == s.generation_tokens == 15
    # Every token sampled after the first of each request came from a decode row.
    assert sum(r.decode_rows for r in records) == 15 - 3


def test_dashboard_data_reads_the_engine(url: str, llm: LLM) -> None:
    with httpx.Client(base_url=url, timeout=60) as http:
        assert http.get("/dashboard").status_code == 200
        for _ in range(2):
            r = http.post("/v1/completions", json={"prompt": [5, 6, 7, 8] * 10, "max_tokens": 8, "temperature": 0,
                                                   "ignore_eos": True})
            assert r.status_code == 200, r.text
        d = http.get("/dashboard/data").json()
        resident_gauge = metric(http.get("/metrics").text, "conveyor:kv_cache_resident_bytes")
    s = llm.stats()
    assert d["requests"] == {"running": 0, "waiting": 0, "swapped": 0, "in_flight": 0,
                             "finished": s.finished_requests}
    assert d["kv"]["used"] + d["kv"]["cached"] + d["kv"]["free"] == d["kv"]["total"] == s.total_blocks
    assert d["kv"]["cached"] > 0  # the repeated prompt's blocks stay cached
    assert d["kv"]["groups"] == [{"type": "full_attention", "layer_groups": 1, "used": 0}]
    # CPU: the pages written so far (idle, so /metrics reads the same).
    assert 0 < d["kv"]["resident_bytes"] == resident_gauge <= d["kv"]["bytes"] == llm.engine.pool.nbytes
    assert d["prefix_cache"]["hit_tokens"] == s.prefix_cache_hit_tokens > 0  # the second request hit
    assert d["latency"]["ttft_ms"]["count"] >= 2 and d["latency"]["itl_ms"]["count"] >= 14
    assert d["latency"]["ttft_ms"]["p50"] <= d["latency"]["ttft_ms"]["p99"]
    steps = d["steps"]
    assert len(steps["index"]) == len(steps["decode_rows"]) > 0 and steps["index"][-1] == steps["index"][0] + len(
        steps["index"]) - 1
    assert sum(steps["sampled_tokens"][-7:]) >= 7 and d["recent"]["output_tok_s"] > 0


class Load:
    """Streams that keep `k` long requests running (a new one when one ends) until `stop()`, which
    disconnects them mid-stream."""

    def __init__(self, url: str, k: int) -> None:
        self.url, self.done = url, threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(k)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        body = {"prompt": [5 + i, 6, 7, 8], "max_tokens": 2000, "ignore_eos": True, "stream": True,
                "temperature": 0}
        with httpx.Client(base_url=self.url, timeout=120) as http:
            while not self.done.is_set():
                with http.stream("POST", "/v1/completions", json=body) as r:
                    for _ in r.iter_lines():
                        if self.done.is_set():
                            break

    def stop(self) -> None:
        self.done.set()
        for t in self.threads:
            t.join(30)


@pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None,
                    reason="needs Debian's chromium and chromium-driver (scripts/setup.sh --test installs them)")
def test_dashboard_page_in_headless_chromium(url: str, llm: LLM) -> None:
    webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (the test extra)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1500"):
        options.add_argument(arg)
    with httpx.Client(base_url=url, timeout=60) as http:  # finished requests, for the latency table
        for _ in range(3):
            assert http.post("/v1/completions", json={"prompt": "w5 w6 w7", "max_tokens": 8}).status_code == 200
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    load = Load(url, k=3)
    try:
        driver.get(f"{url}/dashboard")
        shown = gauge = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            shown = driver.find_element("id", "running").text
            gauge = metric(httpx.get(f"{url}/metrics").text, "conveyor:num_requests_running")
            if shown.isdigit() and int(shown) == gauge > 0:
                break
            time.sleep(0.2)
        assert shown.isdigit() and int(shown) == gauge > 0, f"page shows running {shown!r}, /metrics {gauge}"
        # Let the time-based charts get a few polls, then check that every chart drew its data.
        while driver.execute_script("return window.conveyorDashboard.polls") < 6:
            time.sleep(0.2)
        drawn = driver.execute_script("""
            const out = {};
            for (const [name, u] of Object.entries(window.conveyorDashboard.charts)) {
              const c = u.ctx.canvas, px = u.ctx.getImageData(0, 0, c.width, c.height).data;
              let inked = 0;
              for (let i = 3; i < px.length; i += 4) inked += px[i] > 0;
              out[name] = {points: u.data[0].length, peak: Math.max(...u.data.slice(1).flat().filter(v => v != null)),
                           inked: inked};
            }
            return out;""")
        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / "dashboard.png"
        driver.save_screenshot(str(shot))
        print(f"dashboard screenshot: {shot}")
    finally:
        load.stop()
        driver.quit()
    assert set(drawn) == {"batch", "step", "requests", "kv", "toks"}
    for name, chart in drawn.items():
        assert chart["points"] >= 2 and chart["peak"] > 0 and chart["inked"] > 1000, (name, chart)
    assert shot.stat().st_size > 10_000
    # The disconnected streams were cancelled: every block is back.
    deadline = time.monotonic() + 30
    while llm.stats().running_requests and time.monotonic() < deadline:
        time.sleep(0.1)
    s = llm.stats()
    assert s.running_requests == 0 and s.free_blocks == s.total_blocks
