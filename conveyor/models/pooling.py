"""A checkpoint as a pooling model (vLLM's `--runner pooling`): which task it runs, how its files say to
pool, and its head (docs/design/pooling.md).

- The task: vLLM's `--runner` and `--convert` (and the older `--task`) over the config's architectures:
  `*ForSequenceClassification` classifies, a `*ForCausalLM` or a bare `*Model` embeds; the pooler
  config's `task` may ask for the token variant of either (`token_embed`, `token_classify`, every
  token's row through the same head), which `*ForTokenClassification` checkpoints run by default.
- How to pool: a sentence-transformers checkpoint says it in `modules.json` (its Pooling module's
  `config.json`: last token, mean or CLS; a Normalize module: L2-normalized), a GGUF file in
  `{arch}.pooling_type` (llama.cpp's converter writes it for embedding models).
- The classify head: the checkpoint's `score` (transformers' `*ForSequenceClassification`), or built
  from the LM head as vLLM does for rerankers that score with tokens' logits (`hf_overrides`:
  `classifier_from_token` with `method` "from_2_way_softmax", the row of the second token minus the
  first's, which `is_original_qwen3_reranker` sets for Qwen3-Reranker; or "no_post_processing", the
  tokens' rows as they are). The LM head itself is dropped: a pooling model never computes logits.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from ..errors import ConfigError
from ..layers.pooler import Pooler
from ..layers.quantization.linear import Weight, float_linear
from ..layers.quantization.tensors import QuantizedTensor
from ..pooling_params import POOLING_TASKS, TOKEN_TASKS, PoolerConfig
from .bert import BertModel
from .encoder import EncoderModel
from .gemma_encoder import Gemma3EncoderModel, is_bidirectional_gemma
from .modernbert import ModernBertModel
from .rope_bert import RopeBertModel

logger = logging.getLogger("conveyor")

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")
TASKS = {"generate": ("generate", "none"), "embed": ("pooling", "embed"), "embedding": ("pooling", "embed"),
         "classify": ("pooling", "classify"), "score": ("pooling", "classify")}  # vLLM's older --task
GGUF_POOLING_TYPES = {1: "MEAN", 2: "CLS", 3: "LAST"}  # llama.cpp's enum (0: none, 4: rank)
SEQ_CLS_METHODS = ("from_2_way_softmax", "no_post_processing")
# The encoder families by `model_type` (`models.encoder`): pooling models only, with heads of their own
ENCODERS: dict[str, type[EncoderModel]] = {t: cls for cls in (BertModel, ModernBertModel, RopeBertModel)
                                           for t in cls.model_types}


def encoder_class(config: PretrainedConfig) -> type[EncoderModel] | None:
    """The encoder a checkpoint is: by its `model_type`, or a Gemma 3 with bidirectional attention; None for a
    causal model."""
    return Gemma3EncoderModel if is_bidirectional_gemma(config) else ENCODERS.get(config.model_type)


def pooling_task(config: PretrainedConfig, runner: str = "auto", convert: str = "auto",
                 task: str | None = None) -> str | None:
    """"embed", "classify", or None (the model generates), as vLLM resolves `runner`, `convert` and `task`."""
    if runner not in RUNNERS:
        raise ConfigError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}")
    if convert not in CONVERTS:
        raise ConfigError(f"convert must be one of {', '.join(CONVERTS)}, got {convert!r}")
    if task is not None:
        if task not in TASKS:
            raise ConfigError(f"task {task!r} is not supported (supported: {', '.join(TASKS)})")
        implied_runner, implied_convert = TASKS[task]
        if runner not in ("auto", implied_runner) or convert not in ("auto", implied_convert):
            raise ConfigError(f"task={task!r} means runner={implied_runner!r}, convert={implied_convert!r}; it "
                              f"disagrees with runner={runner!r}, convert={convert!r}: give one of them")
        runner, convert = implied_runner, implied_convert
    architectures = list(getattr(config, "architectures", None) or [])
    classifier = any(a.endswith(("ForSequenceClassification", "ForTokenClassification")) for a in architectures)
    if runner == "auto":  # vLLM: a pooling architecture, or a pooling conversion asked for, runs the pooler
        bare = any(a.endswith(("Model", "EmbeddingModel")) for a in architectures)
        bare |= encoder_class(config) is not None  # (an encoder never generates: its masked-LM checkpoints embed)
        runner = "pooling" if classifier or bare or convert in POOLING_TASKS else "generate"
    if runner == "generate":
        if convert in POOLING_TASKS:
            raise ConfigError(f"convert={convert!r} makes a pooling model: it needs runner 'pooling' (or 'auto')")
        return None
    if convert in POOLING_TASKS:
        return convert
    if convert == "none" and not classifier:
        raise ConfigError("runner='pooling' with convert='none': this checkpoint is no pooling model of its own; "
                          "use convert 'embed' (or 'auto')")
    return "classify" if classifier else "embed"


def gguf_pooler_config(pooling_type: int) -> PoolerConfig:
    """How a GGUF file says to pool: its metadata's pooling type, llama.cpp's enum (a directory says it in its
    sentence-transformers files: `sentence_transformers.read_pipeline`)."""
    return PoolerConfig(pooling_type=GGUF_POOLING_TYPES.get(pooling_type))


def build_pooler(task: str, config: PretrainedConfig, state_dict: dict[str, Weight],
                 tokenizer: PreTrainedTokenizerBase | None, pooler_config: PoolerConfig, files: PoolerConfig,
                 device: torch.device, projector: nn.Module | None = None) -> Pooler:
    """The pooler of a checkpoint: the classify head taken out of `state_dict` (and the LM head dropped
    from it), on `device`. `task` "embed" or "classify" (`pooling_task`); `pooler_config` (the user's) over
    what the checkpoint's `files` say (embeddings: classifiers keep their activation) over vLLM's defaults:
    the last token, normalized; its `task` may ask for `task`'s token variant. `projector`: the checkpoint's
    sentence-transformers Dense layers, which embeddings (not the token tasks' rows) go through."""
    run = pooler_task(task, config, pooler_config)
    if run in TOKEN_TASKS:
        files = PoolerConfig(normalize=files.normalize)  # (a sequence pooling type means nothing per token)
    resolved = pooler_config.over(files if task == "embed" else PoolerConfig(files.pooling_type))
    encoder = encoder_class(config)
    default = encoder.default_pooling(config) if encoder is not None else "LAST"  # (vLLM's defaults)
    resolved = resolved.over(PoolerConfig("ALL" if run in TOKEN_TASKS else default, True))
    pooling_type = resolved.pooling_type or default
    if (run in TOKEN_TASKS) != (pooling_type == "ALL"):
        raise ConfigError(f"pooler_config pooling_type {pooling_type!r} does not go with the task {run!r}: the "
                          "token tasks pool ALL, embed and classify LAST, MEAN or CLS")
    classifier = classifier_head(config, state_dict, tokenizer, device) if task == "classify" else None
    for unused in ("lm_head.weight", "score.weight", "score.bias"):  # (a classifier converted to embed: its head)
        state_dict.pop(unused, None)
    projector = projector.to(device) if projector is not None and run == "embed" else None
    return Pooler(run, pooling_type, bool(resolved.normalize), classifier, projector)


def pooler_task(task: str, config: PretrainedConfig, pooler_config: PoolerConfig) -> str:
    """What the pooler runs for a model of `task`: the pooler config's task (`task` or its token variant), or
    an ALL pooling type's or a `*ForTokenClassification` checkpoint's token variant, else `task`."""
    token = f"token_{task}"
    if pooler_config.task is not None:
        if pooler_config.task not in (task, token):
            raise ConfigError(f"pooler_config task {pooler_config.task!r}: this model's task is {task!r}, so it "
                              f"runs {task!r} or {token!r} (--convert sets the model's task)")
        return pooler_config.task
    architectures = list(getattr(config, "architectures", None) or [])
    per_token = any(a.endswith("ForTokenClassification") for a in architectures) and task == "classify"
    return token if per_token or pooler_config.pooling_type == "ALL" else task


def classifier_head(config: PretrainedConfig, state_dict: dict[str, Weight], tokenizer: PreTrainedTokenizerBase | None,
                    device: torch.device) -> nn.Module:
    """The classify head, fp32: the checkpoint's `score` (an encoder's own, `EncoderModel.classifier`),
    or rows of its LM head (`method` and `classifier_from_token`, vLLM's conversion)."""
    encoder = encoder_class(config)
    if encoder is not None:
        head = encoder.classifier(config, state_dict)
        if head is None:
            raise ConfigError(f"a classify pooling model needs a classification head: this {config.model_type} "
                              "checkpoint has none (a *ForSequenceClassification checkpoint has `classifier`)")
        return head.to(device).eval().requires_grad_(False)
    if getattr(config, "is_original_qwen3_reranker", False):
        config.method = "from_2_way_softmax"  # vLLM's switch for the original Qwen3-Reranker checkpoints
    method = getattr(config, "method", None)
    if method is not None:
        weight = token_rows_head(config, state_dict, tokenizer, method)
        bias = None
    else:
        if "score.weight" not in state_dict:
            raise ConfigError("a classify pooling model needs a classification head: this checkpoint has no "
                              "score.weight (a *ForSequenceClassification checkpoint has one); a reranker that "
                              "scores with tokens' logits is set up with hf_overrides, e.g. "
                              '{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": '
                              '["no", "yes"], "is_original_qwen3_reranker": true}')
        weight, bias = state_dict.pop("score.weight"), state_dict.pop("score.bias", None)
    return float_linear(weight, bias).to(device).eval().requires_grad_(False)


def token_rows_head(config: PretrainedConfig, state_dict: dict[str, Weight], tokenizer: PreTrainedTokenizerBase | None,
                    method: str) -> torch.Tensor:
    """The head vLLM makes from the LM head's rows of `classifier_from_token`'s tokens."""
    tokens = list(getattr(config, "classifier_from_token", None) or [])
    if method not in SEQ_CLS_METHODS:
        raise ConfigError(f"hf_overrides method {method!r} is not supported (supported: {', '.join(SEQ_CLS_METHODS)})")
    if not tokens or (method == "from_2_way_softmax" and len(tokens) != 2):
        raise ConfigError(f"method {method!r} needs classifier_from_token (two tokens for from_2_way_softmax, "
                          f"e.g. [\"no\", \"yes\"]), got {tokens}")
    if tokenizer is None:
        raise ConfigError("classifier_from_token needs the model's tokenizer")
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokens]
    unknown = [t for t, i in zip(tokens, ids) if i is None or i == tokenizer.unk_token_id]
    if unknown:
        raise ConfigError(f"classifier_from_token: {unknown} are not tokens of the model's vocabulary")
    head = state_dict.get("lm_head.weight", state_dict.get("model.embed_tokens.weight"))
    if head is None:
        raise ConfigError("classifier_from_token needs the LM head (or the tied embedding) in the checkpoint")
    rows = rows_of(head, ids)
    return (rows[1] - rows[0]).unsqueeze(0) if method == "from_2_way_softmax" else rows


def rows_of(weight: Weight, ids: list[int]) -> torch.Tensor:
    """Rows `ids` of a matrix, fp32, without widening a quantized one whole."""
    if isinstance(weight, QuantizedTensor):
        return weight.index_rows(torch.tensor(ids)).dequantize(torch.float32)
    return weight[ids].float()


def matryoshka_dimensions(config: PretrainedConfig) -> list[int] | None:
    """The dimensions a Matryoshka-trained model's embeddings may be cut to ([] = any), None when it is not
    one (vLLM reads `matryoshka_dimensions` and `is_matryoshka` from the config, or `hf_overrides`)."""
    dims = getattr(config, "matryoshka_dimensions", None)
    if dims:
        return list(dims)
    return [] if getattr(config, "is_matryoshka", False) else None


def apply_hf_overrides(config: PretrainedConfig, overrides: dict[str, Any] | None) -> None:
    """vLLM's `hf_overrides`: each key set on the config (a dict value merged into a dict attribute)."""
    for key, value in (overrides or {}).items():
        current = getattr(config, key, None)
        if isinstance(value, dict) and isinstance(current, dict):
            value = current | value
        setattr(config, key, value)
    if overrides:
        logger.info("hf_overrides applied to the model config: %s", ", ".join(sorted(overrides)))
