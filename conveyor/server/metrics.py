"""The server's `/metrics`: `conveyor.metrics.Metrics` under the served model's name, with the recent
latency samples the dashboard's percentiles read (`dashboard_data.LatencyWindow`)."""

from __future__ import annotations

from collections.abc import Callable

from .. import EngineStats
from ..metrics import Metrics
from ..request import RequestOutput
from .dashboard_data import LatencyWindow


class ServerMetrics(Metrics):
    def __init__(self, stats: Callable[[], EngineStats], model_name: str,
                 kv_resident_bytes: Callable[[], int] | None = None) -> None:
        super().__init__(stats, model_name, kv_resident_bytes)
        self.latencies = LatencyWindow()  # recent samples, for the dashboard's percentiles

    def observe_finished(self, out: RequestOutput) -> None:
        super().observe_finished(out)
        if out.metrics is not None:
            self.latencies.observe(out.metrics.time_to_first_token, out.metrics.token_times)
