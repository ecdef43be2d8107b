"""A sentence-transformers checkpoint's own pipeline (`modules.json`): the model, then its Pooling module (the
first token, the mean or the last token), Dense projections (LaBSE's tanh layer, EmbeddingGemma's two linear
layers) and Normalize, as sentence-transformers runs them; and the context it was made for
(`sentence_bert_config.json`'s `max_seq_length`, which vLLM serves as the context). A module this engine does
not run (another pooling mode, a LayerNorm, a custom module) is an error naming it, not a different vector.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import nn

from ..errors import ConfigError
from ..pooling_params import PoolerConfig

POOLING_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}
OTHER_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
ACTIVATIONS = {"Identity": nn.Identity, "Tanh": nn.Tanh, "ReLU": nn.ReLU, "GELU": nn.GELU, "Sigmoid": nn.Sigmoid}


@dataclass
class SentencePipeline:
    """What the files say: the pooling type and whether to normalize (None: not said), the Dense layers (fp32)."""

    pooling_type: str | None = None
    normalize: bool | None = None
    projector: nn.Sequential | None = None

    @property
    def pooler_config(self) -> PoolerConfig:
        return PoolerConfig(pooling_type=self.pooling_type, normalize=self.normalize)


def read_pipeline(path: Path) -> SentencePipeline:
    """The pipeline of a checkpoint directory (an empty one without `modules.json`); ConfigError for files it
    cannot read or modules it does not run."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return SentencePipeline()
    pipeline, dense = SentencePipeline(normalize=False), []
    try:
        for module in json.loads(modules_file.read_text()):
            kind, where = module.get("type", "").rsplit(".", 1)[-1], path / module.get("path", "")
            if kind == "Pooling":
                pipeline.pooling_type = pooling_mode(json.loads((where / "config.json").read_text()), where)
            elif kind == "Normalize":
                pipeline.normalize = True
            elif kind == "Dense":
                dense.extend(dense_layer(where))
            elif kind != "Transformer":
                raise ConfigError(f"{path}: the sentence-transformers module {module.get('type')!r} is not supported "
                                  "(supported: Transformer, Pooling, Dense, Normalize)")
    except ConfigError:
        raise
    except (OSError, ValueError, AttributeError, TypeError, KeyError) as exc:
        raise ConfigError(f"cannot read the sentence-transformers files of {path}: {exc}") from exc
    pipeline.projector = nn.Sequential(*dense).eval().requires_grad_(False) if dense else None
    return pipeline


def pooling_mode(settings: dict[str, Any], where: Path) -> str | None:
    """The Pooling module's one mode we run; ConfigError for the others."""
    other = [key for key in OTHER_MODES if settings.get(key)]
    if other:
        raise ConfigError(f"{where}: pooling mode {other[0].removeprefix('pooling_mode_')!r} is not supported "
                          "(supported: cls_token, mean_tokens, lasttoken)")
    return next((mode for key, mode in POOLING_MODES.items() if settings.get(key)), None)


def dense_layer(where: Path) -> list[nn.Module]:
    """A Dense module: its linear layer (fp32, from `model.safetensors` or `pytorch_model.bin`) and activation."""
    config = json.loads((where / "config.json").read_text())
    activation = config.get("activation_function", "torch.nn.modules.linear.Identity").rsplit(".", 1)[-1]
    if activation not in ACTIVATIONS:
        raise ConfigError(f"{where}: Dense activation {activation!r} is not supported (supported: "
                          f"{', '.join(ACTIVATIONS)})")
    if (where / "model.safetensors").is_file():
        state = safetensors.torch.load_file(where / "model.safetensors")
    else:
        state = torch.load(where / "pytorch_model.bin", map_location="cpu", weights_only=True)
    linear = nn.Linear(config["in_features"], config["out_features"], bias=config.get("bias", True))
    linear.load_state_dict({k.removeprefix("linear."): v.float() for k, v in state.items()})
    return [linear, ACTIVATIONS[activation]()]


def max_length(path: Path) -> int | None:
    """The longest input the checkpoint was made for (`max_seq_length` in `sentence_bert_config.json`), None
    where it has no such file."""
    file = path / "sentence_bert_config.json" if path.is_dir() else None
    if file is None or not file.is_file():
        return None
    try:
        value = json.loads(file.read_text()).get("max_seq_length")
    except (OSError, ValueError, AttributeError) as exc:
        raise ConfigError(f"cannot read {file}: {exc}") from exc
    return value if isinstance(value, int) and value > 0 else None
