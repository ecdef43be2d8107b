"""What a server or another client reads of `LLM`'s engine: its model's config and limits, the KV pool, the
step history and the counters (`stats`, vLLM's `get_metrics`)."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from .engine.engine import Engine
from .engine.stats import EngineStats
from .engine.step_history import StepHistory
from .metrics import Metric, Metrics, snapshot


class EngineViewMethods:
    """Mixed into `LLM`: `engine` and `metrics` are `LLM`'s."""

    engine: Engine
    metrics: Metrics

    @property
    def model_config(self) -> PretrainedConfig:
        """The model's transformers config."""
        return self.engine.model.config

    @property
    def max_model_len(self) -> int:
        """The context length: prompt + generated tokens of one request."""
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.engine.eos_token_ids

    @property
    def priority_scheduling(self) -> bool:
        """Whether requests' `priority` counts (`scheduling_policy="priority"`); else only 0 is taken."""
        return self.engine.config.scheduler_type == "priority"

    @property
    def kv_capacity_tokens(self) -> int:
        """The longest sequence the whole KV pool holds."""
        return self.engine.capacity_tokens

    @property
    def step_history(self) -> StepHistory | None:
        """The engine's recent step records (the dashboard's), None when off."""
        return self.engine.step_history

    def enable_step_history(self, size: int) -> StepHistory:
        """Switch the engine's step records on (`size` steps) unless `config.step_history` already did."""
        return self.engine.enable_step_history(size)

    def cache_usage(self) -> dict[str, Any]:
        """The KV pool now (per attention type, prefix-cached blocks, bytes and resident bytes)."""
        return self.engine.cache_usage()

    def kv_cache_resident_bytes(self) -> int:
        """Bytes of the KV pool in physical memory (on CPU the pool is committed as it is first written)."""
        return self.engine.pool.resident_bytes()

    def stats(self) -> EngineStats:
        """Engine counters (tokens, preemptions, prefix cache) and cache/queue gauges now."""
        return self.engine.stats()

    def get_metrics(self) -> list[Metric]:
        """vLLM's: the `/metrics` families as its reader's `Counter`, `Gauge`, `Histogram` and `Vector`
        (`conveyor:` names); the latency histograms and finish counts are this object's calls'."""
        return snapshot(self.metrics.registry)
