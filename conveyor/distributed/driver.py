"""Rank 0 of a tensor-parallel model: it loads its own shard while the other ranks load theirs, and
tells them of every call its model makes (`RankDriver`, the model's `mirror`), so the engine above
runs unchanged: it schedules, prepares each step, and samples from the logits gathered to rank 0.

A step costs, besides the model's own collectives (an all-reduce after every attention and MLP
block and one for the embedding; the logits gather), one pickled command with the step's inputs
and attention metadata, and for the LM head the broadcast of the rows it reads.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch

from ..config import ContinuousBatchingConfig
from ..errors import DistributedError
from ..layers.attention import AttentionMetadata
from ..layers.precision import Precision
from ..models.base import CausalLM
from ..models.loader import Checkpoint, read_config, resolve_model_path
from ..models.sharding import describe_plan, load_shard, plan_shards
from .group import RankGroup
from .launch import Launched, tensor_parallel_group
from .worker import Forward, Load, Logits, PoolShape, Unload, serve_rank, to_device

logger = logging.getLogger("conveyor")

_MODEL_IDS = itertools.count()


def pool_shape(kv_caches: Sequence[torch.Tensor], page_size: int) -> PoolShape:
    """What the other ranks mirror of rank 0's pool: its chunk count and which tensor each layer uses."""
    distinct: dict[int, int] = {}
    for t in kv_caches:
        distinct.setdefault(id(t), len(distinct))
    return PoolShape(kv_caches[0].data_ptr(), kv_caches[0].shape[1] // page_size, page_size,
                     [distinct[id(t)] for t in kv_caches], kv_caches[0].shape[-1], kv_caches[0].dtype)


class RankDriver:
    """`models.base.Mirror` for rank 0: each forward and LM-head call is sent to the other ranks first,
    under the group's lock for the whole call (its collectives included)."""

    def __init__(self, group: RankGroup, model_id: int) -> None:
        self.group = group
        self.model_id = model_id

    @contextlib.contextmanager
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Sequence[torch.Tensor],
                metas: Sequence[AttentionMetadata]) -> Iterator[None]:
        cpu = torch.device("cpu")
        sent = list(metas) if input_ids.device.type == "cpu" else to_device(list(metas), cpu)
        with self.group.lock:
            self.group.send(Forward(self.model_id, input_ids.cpu(), positions.cpu(),
                                    pool_shape(kv_caches, metas[0].page_size), sent))
            yield

    @contextlib.contextmanager
    def logits(self, hidden: torch.Tensor) -> Iterator[None]:
        with self.group.lock:
            self.group.send(Logits(self.model_id, tuple(hidden.shape), hidden.dtype))
            self.group.broadcast_tensor(hidden.contiguous())
            yield

    def release(self) -> None:
        """Drop this model on the other ranks (when the group still works)."""
        if self.group.failure is None and not self.group.closed:
            with contextlib.suppress(DistributedError), self.group.lock:
                self.group.send(Unload(self.model_id))


@dataclass
class ShardedModel:
    """Rank 0's shard of a tensor-parallel model, with what `LLM` needs of its checkpoint."""

    model: CausalLM
    checkpoint: Checkpoint  # config, tokenizer and path (no tensors)
    quantization: str
    launched: Launched
    driver: RankDriver
    listeners: list[Callable[[str], None]] = field(default_factory=list)  # this model's, on the group

    def engine_config(self, config: ContinuousBatchingConfig) -> ContinuousBatchingConfig:
        """On CPU the ranks of this machine share its memory: each KV pool sized from its share."""
        group = self.launched.group
        if group.device.type != "cpu" or config.num_blocks is not None:
            return config
        return replace(config, max_memory_percent=(config.max_memory_percent or 0.5) / self.launched.local_ranks)

    def on_failure(self, callback: Callable[[DistributedError], None]) -> None:
        """Call `callback` (from the watchdog's thread) when the group fails, e.g. a rank dies while idle."""
        def listener(reason: str) -> None:
            callback(DistributedError(reason))

        self.listeners.append(listener)
        self.launched.group.listeners.append(listener)

    def close(self) -> None:
        """Release this model's shards on the other ranks; the group stays for the next model."""
        for listener in self.listeners:
            self.launched.group.listeners.remove(listener)
        self.listeners.clear()
        self.driver.release()


def load_tensor_parallel(model: str | os.PathLike | None, precision: Precision, device: torch.device,
                         world_size: int, attention_backend: str) -> ShardedModel:
    """Plan the split (a `ConfigError` before anything starts if it cannot be split), start or reuse the
    group, and load every rank's shard at once. Under torchrun, ranks other than 0 serve rank 0 from
    here until it stops, then the process exits (`SystemExit(0)`, or 1 if the group failed)."""
    plans = plan_shards(read_config(model), world_size)
    launched = tensor_parallel_group(world_size, device)
    group = launched.group
    if group.rank != 0:
        raise SystemExit(serve_rank(group))
    path = str(resolve_model_path(model))
    model_id = next(_MODEL_IDS)
    with group.lock:
        group.send(Load(model_id, path, precision, plans, attention_backend))
        error: Exception | None = None
        try:
            net, checkpoint, quantization = load_shard(path, precision, group.device, plans[0], group)
        except Exception as exc:  # the others still report before this is raised
            error = exc
        results = group.gather_objects(None) or []
    driver = RankDriver(group, model_id)
    failed = [f"rank {r}: {message}" for r, message in enumerate(results) if message is not None]
    if error is not None or failed:
        driver.release()
        if error is not None:
            raise error
        raise RuntimeError("tensor-parallel ranks could not load their shards: " + "; ".join(failed))
    net.mirror = driver
    logger.info("tensor parallel: %d ranks (%s); %s", world_size, launched.how, describe_plan(plans))
    return ShardedModel(net, checkpoint, quantization, launched, driver)
