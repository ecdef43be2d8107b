"""vLLM's `LoRARequest` (which adapter a request runs with) and the limits of multi-LoRA serving
(`enable_lora`, `max_loras`, `max_lora_rank`, `max_cpu_loras`: vLLM's engine arguments and flags).
docs/lora.md says how to use them; docs/design/lora.md how the engine runs them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

# vLLM's `--max-lora-rank` choices.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter for a request: `lora_name` names it (the server's `model`), `lora_int_id` (>= 1) is
    its id, unique per adapter, `lora_path` its directory (`adapter_config.json` and
    `adapter_model.safetensors`). Equal requests share the adapter's slot and its prefix-cached blocks."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def cache_key(self) -> bytes:
        """What the prefix cache keys this adapter's blocks by: a block computed under one adapter is never
        matched for another adapter or the base model."""
        return f"lora\0{self.lora_int_id}\0{self.lora_name}\0{self.lora_path}".encode()


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA limits: `max_loras` adapters in one batch (each holds a slot of stacked weights on the
    device), ranks up to `max_lora_rank`, and `max_cpu_loras` adapters kept loaded in host memory
    (default: `max_loras`)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ConfigError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank not in LORA_RANKS:
            raise ConfigError(f"max_lora_rank must be one of {LORA_RANKS}, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras or self.max_loras

    @classmethod
    def pop_kwargs(cls, kwargs: dict[str, Any]) -> LoRAConfig | None:
        """vLLM's LoRA engine arguments taken out of `kwargs`: the config if `enable_lora`, else None; a
        limit given without `enable_lora` is a `ConfigError`."""
        enable = bool(kwargs.pop("enable_lora", False))
        limits = {name: kwargs.pop(name) for name in ("max_loras", "max_lora_rank", "max_cpu_loras")
                  if kwargs.get(name) is not None}
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            kwargs.pop(name, None)
        if not enable:
            if limits:
                raise ConfigError(f"{', '.join(sorted(limits))} given without enable_lora=True")
            return None
        return cls(**limits)
