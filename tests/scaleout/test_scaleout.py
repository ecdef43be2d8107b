"""The data-parallel pieces that need no process: placement, addresses, router choice, the options each
replica gets, the fleet's /metrics, the bench's per-replica prefix-cache table, and the settings
`conveyor serve --data-parallel-size` refuses before it starts anything."""

from __future__ import annotations

import pytest

from conveyor.bench.serve_cache import parse_counters, run_delta
from conveyor.bench.serve_load import prefix_repetition_workload
from conveyor.cli import main
from conveyor.scaleout import routers
from conveyor.scaleout.fleet_metrics import merge, render
from conveyor.scaleout.launch import forwarded_options, front_config
from conveyor.scaleout.net import replica_url
from conveyor.scaleout.placement import plan_placement

from tests.serving_helpers import serve_parser


def test_replicas_get_disjoint_cores_and_never_more_threads_than_cores():
    two = plan_placement(2, cpus=[4, 5, 6, 7])
    assert [(p.cpus, p.threads) for p in two] == [((4, 5), 2), ((6, 7), 2)]
    assert two[1].env()["OMP_NUM_THREADS"] == "2" and "CUDA_VISIBLE_DEVICES" not in two[1].env()
    assert [p.cpus for p in plan_placement(2, 1, cpus=[0, 1, 2])] == [(0,), (1,)]
    with pytest.raises(ValueError, match=r"2 replicas x 2 thread\(s\) need 4 cores, and this process may use 3"):
        plan_placement(2, 2, cpus=[0, 1, 2])
    with pytest.raises(ValueError, match="3 replicas need 3 cores"):
        plan_placement(3, cpus=[0, 1])
    with pytest.raises(ValueError, match="--threads must be >= 1"):
        plan_placement(1, 0, cpus=[0, 1])


def test_replicas_get_a_gpu_each():
    gpus = plan_placement(2, gpus=2, cpus=[0, 1, 2, 3])
    assert [p.env()["CUDA_VISIBLE_DEVICES"] for p in gpus] == ["0", "1"] and gpus[0].threads == 2
    with pytest.raises(ValueError, match="3 local replicas need 3 GPUs, one a process; 2 visible"):
        plan_placement(3, gpus=2)


def test_tensor_parallel_replicas_take_a_core_or_gpu_per_rank():
    two = plan_placement(2, ranks=2, cpus=[0, 1, 2, 3])
    assert [(p.cpus, p.threads) for p in two] == [((0, 1), 1), ((2, 3), 1)]
    with pytest.raises(ValueError, match=r"2 replicas x 2 tensor-parallel ranks need 4 cores.*--tensor-parallel-size"):
        plan_placement(2, ranks=2, cpus=[0, 1])
    gpus = plan_placement(2, gpus=4, ranks=2)
    assert [p.env()["CUDA_VISIBLE_DEVICES"] for p in gpus] == ["0,1", "2,3"]
    with pytest.raises(ValueError, match="need 4 GPUs"):
        plan_placement(2, gpus=3, ranks=2)


@pytest.mark.parametrize("address, expected", [("http://10.0.0.2:8000", "http://10.0.0.2:8000"),
                                               ("10.0.0.2:8000/", "http://10.0.0.2:8000"),
                                               ("https://node-b:443", "https://node-b:443")])
def test_replica_addresses_are_normalised(address: str, expected: str):
    assert replica_url(address) == expected


@pytest.mark.parametrize("address, message", [("http://node-b", "not a replica URL"),
                                              ("ftp://node-b:21", "not a replica URL"),
                                              ("http://node-b:99999", "out of range"),
                                              ("http://node-b:8000/v1", "without a path")])
def test_bad_replica_addresses_are_named(address: str, message: str):
    with pytest.raises(ValueError, match=message):
        replica_url(address)


def test_router_and_policy_are_checked(monkeypatch: pytest.MonkeyPatch):
    with pytest.raises(ValueError, match="unknown router 'nginx': choose one of vllm-router, sglang-router"):
        routers.check_router("nginx", "cache_aware")
    with pytest.raises(ValueError, match="unknown router policy 'sticky'"):
        routers.check_router("vllm-router", "sticky")
    monkeypatch.setattr(routers.RouterSpec, "executable", lambda self: None)
    with pytest.raises(ValueError, match=r"'sglang-router' is not installed: pip install \"conveyor\[router\]\""):
        routers.check_router("sglang-router", "round_robin")


def test_router_command_names_the_workers_policy_and_metrics_port(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(routers.RouterSpec, "executable", lambda self: f"/bin/{self.script}")
    cmd = routers.ROUTERS["sglang-router"].command("127.0.0.1", 7, ["http://a:1", "http://b:2"], "round_robin", 9)
    assert cmd[:2] == ["/bin/sglang-router", "launch"]
    assert cmd[cmd.index("--worker-urls") + 1:cmd.index("--worker-urls") + 3] == ["http://a:1", "http://b:2"]
    assert cmd[cmd.index("--policy") + 1] == "round_robin" and cmd[cmd.index("--prometheus-port") + 1] == "9"


def test_replicas_get_the_engine_options_as_given_and_their_own_address():
    argv = ["--model", "m.gguf", "--num-blocks", "64", "--dtype", "float32", "--no-block-sharing",
            "--no-use-cuda-graph", "--served-model-name", "a", "b", "--speculative-config", '{"method": "ngram"}',
            "--host", "0.0.0.0", "--port", "9", "--data-parallel-size", "2", "--threads", "1", "--api-key", "k",
            "--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem"]
    args = serve_parser().parse_args(argv)
    forwarded = forwarded_options(args)
    assert "--host" not in forwarded and "--port" not in forwarded and "--data-parallel-size" not in forwarded
    assert not [a for a in forwarded if a.startswith("--ssl")]  # the front terminates TLS
    again = serve_parser().parse_args(forwarded)
    for name in ("model", "num_blocks", "dtype", "no_block_sharing", "use_cuda_graph", "served_model_name",
                 "speculative_config", "api_key"):
        assert getattr(again, name) == getattr(args, name), name
    assert again.data_parallel_size == 1 and again.port == 8000


PAGE = """# HELP conveyor:prefix_cache_hits_total Prefix cache hits, in tokens.
# TYPE conveyor:prefix_cache_hits_total counter
conveyor:prefix_cache_hits_total{model_name="m"} HITS
# HELP conveyor:prefix_cache_queries_total Prefix cache queries, in tokens.
# TYPE conveyor:prefix_cache_queries_total counter
conveyor:prefix_cache_queries_total{model_name="m"} 100.0
conveyor:prefix_cache_queries_created{model_name="m"} 1.7e+09
# HELP conveyor:kv_cache_usage_perc KV cache usage.
# TYPE conveyor:kv_cache_usage_perc gauge
conveyor:kv_cache_usage_perc{model_name="m"} USAGE
# HELP conveyor:request_success_total Finished requests.
# TYPE conveyor:request_success_total counter
conveyor:request_success_total{finish_reason="stop",model_name="m"} 3.0
conveyor:request_success_total{finish_reason="length",model_name="m"} REQ
"""


def page(hits: float, usage: float, requests: float = 1.0) -> str:
    return PAGE.replace("HITS", str(hits)).replace("USAGE", str(usage)).replace("REQ", str(requests))


def test_fleet_metrics_label_each_engine_and_sum_them():
    families = {f.name: f for f in merge({"0": page(10, 0.2), "1": page(30, 0.6)})}
    hits = {s.labels["engine"]: s.value for s in families["conveyor:prefix_cache_hits"].samples}
    assert hits == {"0": 10, "1": 30, "all": 40}
    usage = {s.labels["engine"]: s.value for s in families["conveyor:kv_cache_usage_perc"].samples}
    assert usage["all"] == pytest.approx(0.4)  # a fraction is averaged, not summed
    created = [s for f in families.values() for s in f.samples if s.name.endswith("_created")]
    assert sorted(s.labels["engine"] for s in created) == ["0", "1"]  # timestamps are not summed
    text = render({"0": page(10, 0.2)}, [{"index": 0, "url": "http://r0", "state": "up", "restarts": 2},
                                         {"index": 1, "url": "http://r1", "state": "down", "restarts": 0}],
                  "vllm_router_active_workers 2\n").decode()
    assert 'conveyor:replica_up{engine="1",url="http://r1"} 0.0' in text
    assert 'conveyor:replica_restarts_total{engine="0",url="http://r0"} 2.0' in text
    assert text.endswith("vllm_router_active_workers 2\n")


def test_bench_reads_prefix_cache_hits_per_replica_over_a_run():
    fleet = render({"0": page(10, 0.2), "1": page(30, 0.6)}, []).decode()
    before = parse_counters(fleet)
    assert before == {"0": {"queries": 100, "hits": 10, "requests": 4}, "1": {"queries": 100, "hits": 30, "requests": 4}}
    after = parse_counters(render({"0": page(70, 0.2, 9), "1": page(35, 0.6)}, []).decode())
    delta = run_delta(before, after)
    assert delta["engines"]["0"] == {"requests": 8, "query_tokens": 0, "hit_tokens": 60, "hit_rate": None}
    assert delta["total"]["hit_tokens"] == 65
    assert parse_counters(page(5, 0.1)) == {"0": {"queries": 100, "hits": 5, "requests": 4}}  # one server
    assert run_delta(None, before) is None


def test_prefix_repetition_workload_shares_prefixes():
    w = prefix_repetition_workload(20, 4, 5, 8, 16, seed=1)
    prefixes = {" ".join(r.prompt.split()[:20]) for r in w.requests}
    assert len(w) == 16 and len(prefixes) == 4 and all(len(r.prompt.split()) == 25 for r in w.requests)


@pytest.mark.parametrize("argv, message", [
    (["--data-parallel-size", "3", "--threads", "1"], "3 replicas x 1 thread(s) need 3 cores"),
    (["--data-parallel-size", "2", "--router", "nginx"], "unknown router 'nginx'"),
    (["--data-parallel-size", "2", "--data-parallel-address", "node-b"], "is not a replica URL"),
    (["--data-parallel-size", "1", "--data-parallel-address", "http://a:1", "http://b:2"], "give at least 2"),
    (["--data-parallel-size", "0"], "--data-parallel-size must be >= 1"),
    (["--data-parallel-size", "2", "--tensor-parallel-size", "2"], "2 replicas x 2 tensor-parallel ranks need"),
])
def test_bad_data_parallel_settings_fail_before_anything_starts(argv: list[str], message: str,
                                                                 capsys: pytest.CaptureFixture[str],
                                                                 monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr("conveyor.scaleout.placement.usable_cpus", lambda: [0, 1])
    monkeypatch.setattr(routers.RouterSpec, "executable", lambda self: f"/bin/{self.script}")  # installed or not
    monkeypatch.setattr("conveyor.scaleout.launch.Supervisor.start", lambda *a, **k: pytest.fail("started"))
    assert main(["serve", "--model", "unused", *argv]) == 2
    assert message in capsys.readouterr().err


def test_fault_report_sorts_requests_by_how_they_ended():
    from conveyor.bench.serve_client import RequestResult
    from conveyor.bench.serve_faults import classify

    cut = 'error in the stream: {"message": "...", "code": "replica_failed"}'
    results = [RequestResult(0, success=True, status=200, token_chunks=9),
               RequestResult(1, error=cut, status=200, token_chunks=4),
               RequestResult(2, error="HTTP 503: shutting down", status=503),
               RequestResult(3, error="timed out after 5 s (--request-timeout)"),
               RequestResult(4, error="the stream carried no tokens and no [DONE]", status=200)]
    assert classify(results) == {"answered": 1, "cut after output": 1, "5xx": 1, "hung (timed out)": 1,
                                 "other failure": 1}


def test_the_front_logs_as_a_single_server_does() -> None:
    """The front of replicas takes the log options a single server takes: JSON lines, no access log, or an
    access log without the probes' lines."""
    quiet = front_config(None, serve_parser().parse_args(["--log-format", "json", "--disable-access-log-for-endpoints",
                                                          "/health, /metrics"]), None)
    assert quiet.access_log and quiet.log_config["handlers"]["access"]["filters"] == ["skip_paths"]
    assert quiet.log_config["filters"]["skip_paths"]["paths"] == ("/health", "/metrics")
    assert all(f["()"].endswith("JSONFormatter") for f in quiet.log_config["formatters"].values())
    assert not front_config(None, serve_parser().parse_args(["--disable-uvicorn-access-log"]), None).access_log
