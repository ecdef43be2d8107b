"""Conveyor: an inference engine for language models built on continuous batching."""

import os

# oneDNN keeps a primitive per matmul shape, up to 1024 of them (~260 KB each). Continuous batching
# runs a new row count almost every step, so the default cache grew a server's memory for minutes
# (a soak: +8% outside the KV pool in 30 s; 64 entries: +3.7%, each re-creation ~0.1 ms against a
# step of milliseconds). Read when oneDNN first runs: set it in the environment to override.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")

from .config import ContinuousBatchingConfig
from .engine import Engine, EngineStats, InvalidRequestError
from .llm import LLM
from .manager import ContinuousBatchingManager
from .request import RequestOutput, RequestState
from .sampling_params import SamplingParams
from .scheduler import FIFOScheduler, PrefillFirstScheduler
from .cache_pool import CachePool
from .allocator import FullAttentionCacheAllocator, HybridCacheAllocator, SlidingAttentionCacheAllocator

__all__ = ["LLM", "SamplingParams", "ContinuousBatchingConfig", "ContinuousBatchingManager", "Engine", "EngineStats",
           "InvalidRequestError", "RequestOutput", "RequestState", "FIFOScheduler", "PrefillFirstScheduler",
           "CachePool", "FullAttentionCacheAllocator", "SlidingAttentionCacheAllocator", "HybridCacheAllocator"]
