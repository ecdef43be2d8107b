"""A tensor-parallel rank other than 0: it holds its shard of each model rank 0 loads and makes every
call rank 0's model makes, told by one command per call (nano-vllm's design: rank 0 schedules,
prepares each step and samples; the other ranks only run the model). The commands:

- `Load`: build this rank's shard (`models.sharding.load_shard`) and report the result to rank 0;
- `Forward`: one forward pass over the step's inputs and attention metadata (rank 0's, as its
  runner prepared them); the KV pool is this rank's own, with its KV heads, mirroring the chunk
  count of the pool rank 0 runs on (`PoolShape`);
- `Logits`: the LM head over hidden rows rank 0 broadcasts next (its rows go to rank 0's gather);
- `Unload`, `Stop`.

A command that fails here leaves the ranks out of step, so the rank exits and rank 0's next
collective fails (`DistributedError`: the engine's death path); only a failed `Load` is reported
and survived.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..cache.pool import CachePool
from ..errors import DistributedError
from ..kernels.host_memory import keep_freed_memory, release_freed_memory
from ..layers.attention import AttentionBackend, AttentionMetadata, make_attention_backend
from ..layers.precision import Precision
from ..models.base import CausalLM
from ..models.sharding import ShardPlan, load_shard
from .group import LOAD_TIMEOUT_S, RankGroup, watch_parent

logger = logging.getLogger("conveyor")


@dataclass
class Load:
    model_id: int
    path: str
    precision: Precision
    plans: list[ShardPlan]
    attention_backend: str


@dataclass
class PoolShape:
    """Rank 0's KV pool as a step uses it: `key` tells pools apart (a new key, a new pool here),
    `layer_tensor[i]` is which of the pool's tensors layer `i` uses; `row` and `dtype`: its rows' width
    and storage (kv_cache_dtype's, `cache/kv_format.py`)."""

    key: int
    num_chunks: int
    page_size: int
    layer_tensor: list[int]
    row: int
    dtype: torch.dtype


@dataclass
class Forward:
    model_id: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    pool: PoolShape
    metas: list[AttentionMetadata]  # per layer, as the runner passes them


@dataclass
class Logits:
    """The LM head over `shape` hidden rows of `dtype`, which rank 0 broadcasts right after."""

    model_id: int
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class Unload:
    model_id: int


@dataclass
class Stop:
    pass


def to_device(obj: Any, device: torch.device, seen: dict[int, Any] | None = None) -> Any:
    """`obj` with every tensor in it (dataclasses, lists, tuples) on `device`; shared objects stay
    shared (a step's per-layer metadata list holds one object per layer group)."""
    seen = {} if seen is None else seen
    if id(obj) in seen:
        return seen[id(obj)]
    if isinstance(obj, torch.Tensor):
        out: Any = obj.to(device)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = dataclasses.replace(obj, **{f.name: to_device(getattr(obj, f.name), device, seen)
                                          for f in dataclasses.fields(obj) if f.init})
    elif isinstance(obj, (list, tuple)):
        out = type(obj)(to_device(o, device, seen) for o in obj)
    else:
        out = obj
    seen[id(obj)] = out
    return out


class RankWorker:
    """Serves rank 0's commands until `Stop` (or until the group fails)."""

    def __init__(self, group: RankGroup) -> None:
        self.group = group
        self.device = group.device
        self.models: dict[int, tuple[CausalLM, AttentionBackend]] = {}
        self.pools: dict[int, tuple[int, list[torch.Tensor]]] = {}  # model id -> (pool key, its tensors)

    def serve(self) -> None:
        with torch.inference_mode():
            while True:
                command = self.group.receive()
                if isinstance(command, Stop):
                    return
                if isinstance(command, Load):
                    self.load(command)
                elif isinstance(command, Forward):
                    self.forward(command)
                elif isinstance(command, Logits):
                    self.logits(command)
                elif isinstance(command, Unload):
                    self.models.pop(command.model_id, None)
                    self.pools.pop(command.model_id, None)
                else:
                    raise TypeError(f"unknown command {type(command).__name__}")

    def load(self, command: Load) -> None:
        error = None
        try:
            with torch.inference_mode(False):
                net, _, _ = load_shard(command.path, command.precision, self.device, command.plans[self.group.rank],
                                       self.group, tokenizer=False)
            attention = make_attention_backend(self.device, net.dtype, command.attention_backend)
            self.models[command.model_id] = (net, attention)
            if self.device.type == "cpu":  # as rank 0's LLM does: the load's garbage returned, steps' memory kept
                release_freed_memory()
                keep_freed_memory()
        except Exception as exc:  # reported to rank 0, which raises it; this rank serves on
            logger.exception("rank %d could not load its shard of %s", self.group.rank, command.path)
            error = f"{type(exc).__name__}: {exc}"
        self.group.gather_objects(error)

    def forward(self, command: Forward) -> None:
        net, attention = self.models[command.model_id]
        kv = self.pool(command.model_id, command.pool, net)
        metas = command.metas if self.device.type == "cpu" else to_device(command.metas, self.device)
        net(command.input_ids.to(self.device), command.positions.to(self.device),
            [kv[i] for i in command.pool.layer_tensor], metas, attention)

    def logits(self, command: Logits) -> None:
        net, _ = self.models[command.model_id]
        hidden = self.group.broadcast_tensor(torch.empty(command.shape, dtype=command.dtype, device=self.device))
        net.compute_logits(hidden)

    def pool(self, model_id: int, shape: PoolShape, net: CausalLM) -> list[torch.Tensor]:
        """This rank's KV tensors for rank 0's pool `shape`: its own KV heads, the same chunks."""
        held = self.pools.get(model_id)
        if held is None or held[0] != shape.key:
            self.pools.pop(model_id, None)  # the old pool's memory first
            pool = CachePool(shape.num_chunks, shape.page_size, max(shape.layer_tensor) + 1, net.num_kv_heads,
                             shape.row, shape.dtype, self.device)
            held = self.pools[model_id] = (shape.key, pool.kv)
        return held[1]


def serve_rank(group: RankGroup) -> int:
    """Run this rank's command loop; 0 after `Stop`, 1 when the group failed (the reason is logged)."""
    try:
        RankWorker(group).serve()
    except DistributedError as exc:
        logger.error("rank %d stops: rank 0 is gone or the group failed (%s)", group.rank, exc)
        return 1
    except Exception:
        logger.exception("rank %d failed; the group cannot go on", group.rank)
        return 1
    return 0


def run_spawned_rank(rank: int, world_size: int, port: int, device: str, threads: int | None,
                     parent_pid: int) -> None:
    """Entry point of a rank that rank 0 spawned on this machine (torch.multiprocessing)."""
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s rank {rank}: %(message)s", stream=sys.stderr)
    watch_parent(parent_pid)
    if threads is not None:
        torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=LOAD_TIMEOUT_S))
    store.set(f"conveyor/spawned/{rank}", str(os.getpid()))
    group = RankGroup.join(rank, world_size, torch.device(device), store)
    code = serve_rank(group)
    if code == 0:
        group.destroy()
    os._exit(code)
