"""`LLM`'s pooling entry points, vLLM's: `embed`, `classify`, `score` and `encode` on a model loaded with
`runner="pooling"` (docs/python-api.md), and what a server reads of a pooling model (its task, the
pair prompts scoring makes, cosine similarity). Requests go through the manager as generations do.
A model loaded for a token task (`pooler_config={"task": "token_embed"}` or "token_classify") answers
`encode` alone, with one row a token.

Scoring, as vLLM: a classifier scores each (text_1, text_2) pair as one prompt, the two texts joined by
the tokenizer's pair template (or simply concatenated for a converted LLM reranker, `use_pad_token`
false); an embedding model scores a pair by the cosine similarity of the two texts' embeddings.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from .config import ContinuousBatchingConfig
from .engine.engine import Engine
from .manager import ContinuousBatchingManager
from .models.sentence_transformers import max_length
from .pooling_params import PoolingParams
from .request import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    Prompt,
    Request,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
    prompt_list,
)

ScoreData = str | Sequence[str]

# A pooling model's token budget a step when no config is given: its steps are all prompt tokens, which run
# faster in larger matmuls (and no decoding row waits behind them).
POOLING_MAX_BATCH_TOKENS = 2048


def pooling_engine_config(config: ContinuousBatchingConfig, model: nn.Module, path: Path,
                          tokenizer: PreTrainedTokenizerBase, sized: bool) -> ContinuousBatchingConfig:
    """A pooling model's engine config: unless `sized` (the user gave a config or the step's tokens), steps of
    `POOLING_MAX_BATCH_TOKENS`, and for an encoder (`models.encoder`, whose prompts go whole into one pass) at
    least its context; the context is the sentence-transformers `max_seq_length` where the checkpoint has one
    and `max_model_len` is not given (vLLM's rule). An encoder learns the tokenizer's separator here."""
    limit = max_length(path)
    if config.max_model_len is None and limit is not None and limit < model.max_model_len:
        config = replace(config, max_model_len=limit)
    if not getattr(model, "encoder_only", False):
        return config if sized else replace(config, max_batch_tokens=POOLING_MAX_BATCH_TOKENS)
    if tokenizer.sep_token_id is not None:
        model.sep_token_id = tokenizer.sep_token_id  # where a pair's second text starts
    if sized:
        return config
    longest = config.context_length(model.max_model_len)
    return replace(config, max_batch_tokens=max(POOLING_MAX_BATCH_TOKENS, longest))


class PoolingMethods:
    """Mixed into `LLM`: the engine, its manager, tokenizer and `_collect` are `LLM`'s."""

    engine: Engine
    manager: ContinuousBatchingManager
    tokenizer: PreTrainedTokenizerBase
    _collect: Callable[..., list[RequestOutput]]

    @property
    def pooling_task(self) -> str | None:
        """"embed", "classify", "token_embed" or "token_classify" for a pooling model (`runner="pooling"`), None
        for a generating one."""
        return None if self.engine.pooler is None else self.engine.pooler.task

    def make_pooling_request(self, request_id: str, prompt: Prompt, params: PoolingParams) -> Request:
        """A validated pooling request for `manager.submit`; raises `InvalidRequestError` naming the limit."""
        return self.engine.make_pooling_request(request_id, prompt, params)

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling_params: PoolingParams | None = None, *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (text, token ids or vLLM's prompt dicts), in input order."""
        self._need_task("embed", "embed")
        outs = self._pool(prompts, pooling_params, truncate_prompt_tokens, use_tqdm)
        return [EmbeddingRequestOutput(o.request_id, EmbeddingOutput(o.pooled or []), o.prompt_token_ids) for o in outs]

    def classify(self, prompts: Prompt | Sequence[Prompt], pooling_params: PoolingParams | None = None, *,
                 truncate_prompt_tokens: int | None = None, use_tqdm: bool = True) -> list[ClassificationRequestOutput]:
        """The classifier's scores per prompt (after its sigmoid or softmax unless `use_activation=False`)."""
        self._need_task("classify", "classify")
        outs = self._pool(prompts, pooling_params, truncate_prompt_tokens, use_tqdm)
        return [ClassificationRequestOutput(o.request_id, ClassificationOutput(o.pooled or []), o.prompt_token_ids)
                for o in outs]

    def encode(self, prompts: Prompt | Sequence[Prompt], pooling_params: PoolingParams | None = None, *,
               pooling_task: str | None = None, truncate_prompt_tokens: int | None = None,
               use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """vLLM's generic pooling call: what the model's task gives, each output's `outputs.data` a tensor
        (`[tokens, values]` for the token tasks). `pooling_task`, if given, must be the model's task (the token
        tasks are chosen when the model is loaded, as in vLLM: `pooler_config={"task": "token_embed"}`)."""
        task = self.pooling_task
        if pooling_task is not None and task is not None and pooling_task != task:
            switch = (f"; load it with pooler_config={{'task': {pooling_task!r}}} for that"
                      if pooling_task.removeprefix("token_") == task.removeprefix("token_") else "")
            raise ValueError(f"pooling_task {pooling_task!r}: this pooling model's task is {task!r}{switch}")
        self._need_task(task or "embed", "encode")
        outs = self._pool(prompts, pooling_params, truncate_prompt_tokens, use_tqdm)
        return [PoolingRequestOutput(o.request_id, PoolingOutput(torch.tensor(o.pooled or [])), o.prompt_token_ids)
                for o in outs]

    def score(self, data_1: ScoreData, data_2: ScoreData, *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True, pooling_params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
        """The score of each pair: one text against each of the others, or two lists pairwise (vLLM's
        rule). A classifier scores the pair as one prompt (its one label's score); an embedding model gives
        the two embeddings' cosine similarity."""
        first, second = score_pairs(data_1, data_2)
        if self.pooling_task == "embed":
            outs = self.embed(first + second, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                              use_tqdm=use_tqdm)
            half = len(first)
            return [ScoringRequestOutput(a.request_id, ScoringOutput(cosine(a.outputs.embedding, b.outputs.embedding)),
                                         a.prompt_token_ids + b.prompt_token_ids)
                    for a, b in zip(outs[:half], outs[half:])]
        self.check_scores()
        prompts = [self.score_prompt(a, b) for a, b in zip(first, second)]
        outs = self._pool(prompts, pooling_params, truncate_prompt_tokens, use_tqdm)
        return [ScoringRequestOutput(o.request_id, ScoringOutput((o.pooled or [math.nan])[0]), o.prompt_token_ids)
                for o in outs]

    @property
    def class_labels(self) -> list[str]:
        """A classifier's label names by class index: its config's `id2label`, `LABEL_i` where that has none."""
        self._need_task("classify", "class_labels", "token_classify")
        names = getattr(self.engine.model.config, "id2label", None) or {}
        count = self.engine.pooler.num_labels or 0  # type: ignore[union-attr]
        return [str(names.get(i, names.get(str(i), f"LABEL_{i}"))) for i in range(count)]

    def check_scores(self) -> None:
        """A model that scores pairs: an embedding model, or a classifier with one label."""
        self._need_task("classify", "score")
        labels = self.engine.pooler.num_labels  # type: ignore[union-attr]
        if labels != 1:
            raise ValueError(f"scoring needs a classifier with one label (a relevance score); this one has {labels}: "
                             "use LLM.classify")

    def score_prompt(self, text_1: str, text_2: str) -> list[int]:
        """The token ids of one pair for a classifier: the tokenizer's pair template, or the texts joined
        for an LLM reranker set up with `classifier_from_token` (vLLM's `use_pad_token`)."""
        config = self.engine.model.config
        use_pad_token = getattr(config, "use_pad_token", getattr(config, "method", None) is None)
        if use_pad_token:
            return list(self.tokenizer(text_1, text_pair=text_2)["input_ids"])
        return list(self.tokenizer(text_1 + text_2)["input_ids"])

    def _need_task(self, task: str, method: str, *others: str) -> None:
        if self.engine.pooler is None:
            raise ValueError(f"LLM.{method} needs a pooling model: LLM(model, runner='pooling') (this one generates)")
        have = self.engine.pooler.task
        if have not in (task, *others) and not (method == "score" and have == "embed"):
            hint = " (the token tasks answer LLM.encode)" if have.startswith("token_") else ""
            raise ValueError(f"LLM.{method} needs {'an' if task == 'embed' else 'a'} {task} model; this pooling "
                             f"model's task is {have!r}{hint}")

    def _pool(self, prompts: Prompt | Sequence[Prompt], pooling_params: PoolingParams | None,
              truncate_prompt_tokens: int | None, use_tqdm: bool) -> list[RequestOutput]:
        """Run pooling requests, all validated before any is queued; outputs in input order."""
        prompts = prompt_list(prompts)
        params = pooling_params or PoolingParams()
        if truncate_prompt_tokens is not None:
            params = PoolingParams(params.dimensions, params.normalize, params.use_activation, truncate_prompt_tokens)
        requests = [self.make_pooling_request(self.manager.new_request_id(), p, params) for p in prompts]
        outs = self.manager.run_batch(requests, lambda ids: self._collect(ids, use_tqdm, pooling=True))
        failed = next((o for o in outs if o.pooled is None), None)
        if failed is not None:
            raise RuntimeError(f"pooling request {failed.request_id} failed: {failed.error or failed.finish_reason}")
        return outs


def score_pairs(data_1: ScoreData, data_2: ScoreData) -> tuple[list[str], list[str]]:
    """The pairs to score: one text against each of the others, or two lists of equal length pairwise."""
    first = [data_1] if isinstance(data_1, str) else list(data_1)
    second = [data_2] if isinstance(data_2, str) else list(data_2)
    if not first or not second:
        raise ValueError("nothing to score: both sides need at least one text")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValueError(f"text_1 must have 1 text or as many as text_2: got {len(first)} and {len(second)}")
    return first, second


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """Cosine similarity in plain Python (callers' threads run no torch ops: one OpenMP team per process)."""
    dot = math.fsum(x * y for x, y in zip(a, b))
    norm = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return dot / norm if norm else 0.0
