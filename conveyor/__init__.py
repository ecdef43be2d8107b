"""Conveyor: an inference engine for language models built on continuous batching."""

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
