"""The engine's adapters (docs/design/lora.md): the adapters registered by name, the loaded ones cached
in host memory (`max_cpu_loras`, least recently used dropped first), which adapter holds which of the
model's `max_loras` slots, and each step's rows grouped by slot.

A request takes its adapter's slot when the engine accepts it (`admit`), loading the adapter into a slot
that no unfinished request uses when it holds none; if every slot is in use it waits, outside the
scheduler, until a request finishes and frees one (`release`). Registration and loading may happen on
any thread (the server's, `LLM.add_lora`); slots change only on the engine's thread.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from ..config import ContinuousBatchingConfig
from ..errors import ConfigError, InvalidRequestError
from ..layers.lora import LoRABatch
from ..lora_request import LoRAConfig, LoRARequest
from ..models.base import CausalLM
from ..models.lora import LoRAAdapter, LoRATargets, enable_lora, load_adapter
from ..request import Request
from ..sched.output import ScheduledChunk


class LoRAManager:
    def __init__(self, targets: LoRATargets, config: LoRAConfig, device: torch.device, max_tokens: int) -> None:
        self.targets, self.config = targets, config
        self.lock = threading.Lock()  # guards `registered` and `cache`
        self.registered: dict[str, LoRARequest] = {}  # by name: the server's adapters, `LLM.add_lora`'s
        self.cache: OrderedDict[LoRARequest, LoRAAdapter] = OrderedDict()
        self.slot_adapter: list[LoRARequest | None] = [None] * config.max_loras
        self.slot_users = [0] * config.max_loras  # unfinished requests per slot
        self.slot_of: dict[str, int] = {}  # request id -> its slot
        self.waiting: list[Request] = []  # accepted, waiting for a slot
        # Each row's slot (-1: base), written per step: preallocated, padded steps included.
        self.row_slots = torch.full((max_tokens,), -1, dtype=torch.long, device=device)

    # -- adapters, on any thread ------------------------------------------------------------
    def load(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter, from the host cache or read and checked from its directory (`ConfigError` saying why
        it does not fit the model)."""
        with self.lock:
            adapter = self.cache.get(request)
            if adapter is not None:
                self.cache.move_to_end(request)
                return adapter
        adapter = load_adapter(request, self.targets, self.config.max_lora_rank)
        with self.lock:
            self.cache[request] = adapter
            while len(self.cache) > self.config.cpu_loras:
                self.cache.popitem(last=False)
        return adapter

    def add(self, request: LoRARequest) -> bool:
        """Register (and load) an adapter under its name; False if one of that name is registered already."""
        with self.lock:
            if request.lora_name in self.registered:
                return False
            if any(r.lora_int_id == request.lora_int_id for r in self.registered.values()):
                raise InvalidRequestError(f"lora_int_id {request.lora_int_id} is in use by another adapter",
                                          param="lora_int_id")
        self.load(request)
        with self.lock:
            self.registered[request.lora_name] = request
        return True

    def remove(self, name: str) -> bool:
        """Unregister an adapter: new requests cannot name it; those already accepted finish with it."""
        with self.lock:
            request = self.registered.pop(name, None)
            if request is not None:
                self.cache.pop(request, None)
        return request is not None

    def get(self, name: str) -> LoRARequest | None:
        with self.lock:
            return self.registered.get(name)

    def list(self) -> list[LoRARequest]:
        with self.lock:
            return list(self.registered.values())

    # -- slots, on the engine thread ----------------------------------------------------------
    def admit(self, request: Request) -> bool:
        """Give the request its adapter's slot (loading it into a free one if needed); False: every slot is
        in use by other adapters' requests, the request waits (`release` admits it later)."""
        lora = request.lora_request
        if lora is None:
            return True
        if lora in self.slot_adapter:
            slot = self.slot_adapter.index(lora)
        else:
            free = [s for s in range(self.config.max_loras) if self.slot_users[s] == 0]
            if not free or self.waiting:  # (those waiting go first)
                self.waiting.append(request)
                return False
            slot = next((s for s in free if self.slot_adapter[s] is None), free[0])
            adapter = self.load(lora)
            for name, linear in self.targets.linears.items():
                linear.set_slot(slot, adapter.parts.get(name, []))
            self.slot_adapter[slot] = lora
        self.slot_users[slot] += 1
        self.slot_of[request.request_id] = slot
        return True

    def release(self, request: Request) -> list[Request]:
        """A finished request gives its slot back; the waiting requests that can now take one (in order)."""
        if request in self.waiting:
            self.waiting.remove(request)
        slot = self.slot_of.pop(request.request_id, None)
        if slot is None:
            return []
        self.slot_users[slot] -= 1
        ready: list[Request] = []
        waiting, self.waiting = self.waiting, []
        for i, other in enumerate(waiting):
            if not self.admit(other):
                self.waiting = waiting[i:]
                break
            ready.append(other)
        return ready

    def step_batch(self, chunks: list[ScheduledChunk], pad_at: int = 0, num_pad: int = 0) -> LoRABatch | None:
        """The step's rows grouped by slot, chunks in row order (`num_pad` padding rows at `pad_at` run
        with the base); None when no chunk has an adapter. O(chunks with adapters) writes."""
        slots = self.row_slots
        total = sum(c.num_tokens for c in chunks) + num_pad
        slots[:total].fill_(-1)
        start, any_adapter = 0, False
        for c in chunks:
            slot = self.slot_of.get(c.request.request_id)
            if slot is not None:
                at = start + (num_pad if start >= pad_at and num_pad else 0)
                slots[at:at + c.num_tokens].fill_(slot)
                any_adapter = True
            start += c.num_tokens
        return LoRABatch.from_row_slots(slots[:total], self.config.max_loras) if any_adapter else None


def make_lora_manager(model: CausalLM, lora: LoRAConfig, config: ContinuousBatchingConfig, device: torch.device,
                      pooling: bool) -> LoRAManager:
    """The model's block linears wrapped for `lora.max_loras` adapters, and their manager; `ConfigError` for
    what LoRA does not run with (pooling models, speculative decoding)."""
    if pooling:
        raise ConfigError("LoRA adapters apply to generating models: enable_lora does not go with runner='pooling'")
    if config.speculative_config is not None:
        raise ConfigError("LoRA adapters do not run with speculative decoding: drop speculative_config or enable_lora")
    targets = enable_lora(model, lora, model.dtype, device)
    return LoRAManager(targets, lora, device, config.max_batch_tokens + config.q_padding_interval_size)
