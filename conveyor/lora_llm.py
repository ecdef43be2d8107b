"""`LLM`'s LoRA entry points, vLLM's names: `add_lora`, `remove_lora`, `list_loras` (the adapters a server
serves by name, docs/lora.md), and what `generate` does with its `lora_request` argument."""

from __future__ import annotations

from collections.abc import Sequence

from .engine.engine import Engine
from .engine.lora_manager import LoRAManager
from .errors import ConfigError
from .lora_request import LoRARequest


def per_prompt(lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
               count: int) -> list[LoRARequest | None]:
    """`generate`'s lora_request, one for all prompts or one each, as a list of `count`."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    adapters = list(lora_request)
    if len(adapters) != count:
        raise ValueError(f"got {len(adapters)} lora_requests for {count} prompts")
    return adapters


class LoRAMethods:
    """Mixed into `LLM`: the engine is `LLM`'s."""

    engine: Engine

    @property
    def lora_enabled(self) -> bool:
        return self.engine.lora is not None

    def _lora(self) -> LoRAManager:
        if self.engine.lora is None:
            raise ConfigError("LoRA is off: load the model with enable_lora=True (--enable-lora)")
        return self.engine.lora

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and register an adapter under its `lora_name` (checked against the model: `ConfigError`
        naming the limit); False if an adapter of that name is registered already."""
        return self._lora().add(lora_request)

    def remove_lora(self, lora_name: str) -> bool:
        """Unregister an adapter: requests can no longer name it, those running finish with it. False if
        no adapter has that name."""
        return self._lora().remove(lora_name)

    def list_loras(self) -> list[LoRARequest]:
        """The registered adapters, in the order they were added."""
        return self._lora().list() if self.engine.lora is not None else []

    def get_lora(self, lora_name: str) -> LoRARequest | None:
        """The registered adapter of that name, or None."""
        return self.engine.lora.get(lora_name) if self.engine.lora is not None else None
