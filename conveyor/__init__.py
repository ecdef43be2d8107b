"""Conveyor: an inference engine for language models built on continuous batching."""

import os

# oneDNN keeps a primitive per matmul shape, up to 1024 of them (~260 KB each). Continuous batching
# runs a new row count almost every step, so the default cache grew a server's memory for minutes
# (a soak: +8% outside the KV pool in 30 s; 64 entries: +3.7%, each re-creation ~0.1 ms against a
# step of milliseconds). PyTorch's ideep layer keeps its own cache of the same primitives, bounded
# by `LRU_CACHE_CAPACITY` (also 1024 by default): with only oneDNN's bounded, a built-in-model soak
# still saw malloc's bytes in use climb 16 MiB in 90 s; with both at 64 they stay flat, and chat64
# runs no slower (464 against 420-436 output tok/s). Both are read when first used: set them in the
# environment to override.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
os.environ.setdefault("LRU_CACHE_CAPACITY", "64")

from .cache.allocator import FullAttentionCacheAllocator
from .cache.hybrid_allocator import HybridCacheAllocator
from .cache.pool import CachePool
from .cache.sliding_allocator import SlidingAttentionCacheAllocator
from .config import ContinuousBatchingConfig
from .engine.engine import Engine
from .engine.stats import EngineStats
from .errors import InvalidRequestError
from .llm import LLM
from .lora_request import LoRARequest
from .manager import ContinuousBatchingManager
from .pooling_params import PoolerConfig, PoolingParams
from .reasoning.markers import ReasoningConfig
from .request import (
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestOutput,
    RequestState,
    ScoringRequestOutput,
)
from .sampling_params import BeamSearchParams, SamplingParams
from .sched.scheduler import FIFOScheduler, PrefillFirstScheduler

__all__ = ["LLM", "SamplingParams", "ContinuousBatchingConfig", "ContinuousBatchingManager", "Engine", "EngineStats",
           "InvalidRequestError", "CompletionOutput", "RequestOutput", "RequestState", "FIFOScheduler", "PrefillFirstScheduler",
           "CachePool", "FullAttentionCacheAllocator", "SlidingAttentionCacheAllocator", "HybridCacheAllocator",
           "PoolingParams", "PoolerConfig", "EmbeddingRequestOutput", "ClassificationRequestOutput",
           "ScoringRequestOutput", "LoRARequest", "BeamSearchParams", "Logprob", "ReasoningConfig"]
