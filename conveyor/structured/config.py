"""vLLM's `structured_outputs_config` (`LLM(structured_outputs_config=...)`, `--structured-outputs-config`):
the engine-wide settings of output constraints. The backend is always llguidance; `enable_in_reasoning`
applies a request's constraint from its first token, inside the reasoning too, instead of after it (the
default where the engine knows the reasoning markers, as vLLM's: `reasoning_state`)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

BACKENDS = ("auto", "guidance", "llguidance")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    backend: str = "auto"
    enable_in_reasoning: bool = False
    reasoning_parser: str = ""  # vLLM's other place for --reasoning-parser
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"structured_outputs_config backend {self.backend!r}: structured outputs run on "
                             f"llguidance ({', '.join(BACKENDS)})")
        if self.disable_any_whitespace or self.disable_additional_properties:
            raise ValueError("structured_outputs_config: disable_any_whitespace and disable_additional_properties "
                             "are not supported (JSON schemas are followed as written)")
        if not isinstance(self.enable_in_reasoning, bool):
            raise ValueError(f"structured_outputs_config enable_in_reasoning must be a boolean, got "
                             f"{self.enable_in_reasoning!r}")

    @classmethod
    def of(cls, value: StructuredOutputsConfig | dict[str, Any] | None) -> StructuredOutputsConfig:
        """The config as given (a dict of its fields, as vLLM's JSON), or the default."""
        if value is None or isinstance(value, cls):
            return value or cls()
        unknown = set(value) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"structured_outputs_config takes {', '.join(f.name for f in fields(cls))}; got "
                             f"{sorted(unknown)}")
        return cls(**value)
