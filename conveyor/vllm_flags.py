"""vLLM's command-line flags that `conveyor serve` and `conveyor generate` do not take, each with what to
do instead, so that a vLLM deployment script fails with a sentence rather than argparse's
"unrecognized arguments"; and the few whose vLLM meaning is what Conveyor always does, taken and
ignored with a log line. The same for `LLM(...)`'s keyword arguments of those names (vLLM's `LLM`
takes every engine argument). vLLM's `--config FILE` (a YAML file of options) is read into the command
line (`expand_config_file`). (The flags Conveyor takes under vLLM's names are in `cli_args`.)"""

from __future__ import annotations

import json
from collections.abc import Container
from pathlib import Path
from typing import Any

TOKENIZER = "tokenizers load through transformers' AutoTokenizer (vLLM's mode auto); --tokenizer names another one"
MULTI_NODE = "one machine per conveyor serve: run one on each machine behind a router (docs/scale-out.md)"
PIPELINE = "pipeline parallelism is not supported: --tensor-parallel-size N splits the model over N devices, " \
           "--data-parallel-size N runs N replicas behind a router"
UNSUPPORTED: dict[str, str] = {
    "--pipeline-parallel-size": PIPELINE,
    "-pp": PIPELINE,
    "--distributed-executor-backend": "there is no distributed executor: --data-parallel-size N starts the replicas "
                                      "itself, and conveyor.scaleout.ray_serve runs them on Ray Serve",
    "--tokenizer-mode": TOKENIZER,
    "--tokenizer-revision": "--tokenizer takes a directory or a Hub id at its default revision",
    "--load-format": "the format follows the files: a directory of *.safetensors, or a .gguf file "
                     "(--gguf-file NAME or org/name:QUANT for a Hub repo)",
    "--cpu-offload-gb": "weights are not offloaded; --swap-space GIB (--cpu-offload-space) keeps preempted "
                        "requests' KV blocks in host memory",
    "--no-enable-chunked-prefill": "prefill is always chunked, --max-num-batched-tokens tokens a step: raise that "
                                   "to prefill longer prompts in one step",
    "--guided-decoding-backend": "structured outputs always run on llguidance: drop the flag",
    "--limit-mm-per-prompt": "Conveyor serves text-only models; multimodal inputs are not supported",
    "--allowed-local-media-path": "Conveyor serves text-only models; multimodal inputs are not supported",
    "--middleware": "middleware is not loaded from import paths: put it in a proxy in front, or wrap "
                    "conveyor.server.build_app(...) in your own ASGI app",
    "--compilation-config": "there is no torch.compile step; CUDA graphs of decode steps are on by default on CUDA "
                            "(--enforce-eager turns them off)",
    "--kv-transfer-config": "disaggregated prefill (KV transfer between instances) is not supported",
    "--enable-sleep-mode": "sleep mode is not supported: stop the server and start it again",
    "--enable-expert-parallel": "experts are not split over ranks: a mixture-of-experts model runs whole on one "
                                "rank (--tensor-parallel-size 1); --data-parallel-size N runs N replicas",
    "--api-server-count": "one HTTP front end per engine; --data-parallel-size N runs N replicas behind one front",
    **dict.fromkeys(("--headless", "--data-parallel-size-local", "--data-parallel-rank", "--data-parallel-start-rank",
                     "--data-parallel-rpc-port", "--nnodes", "--node-rank", "--master-addr", "--master-port"),
                    MULTI_NODE),
    "--model-impl": "Conveyor runs its own implementation of each supported architecture (docs/models.md)",
    "--disable-sliding-window": "sliding-window layers always attend within their window",
    "--logits-processors": "logits processors are not loaded from import paths: logit_bias, allowed_token_ids, "
                           "bad_words and structured outputs are request fields",
    "--tool-parser-plugin": "parsers are not loaded from files: --tool-call-parser names a built-in one",
    "--reasoning-parser-plugin": "parsers are not loaded from files: --reasoning-parser names a built-in one",
    "--skip-tokenizer-init": "prompts and outputs are always tokenized: send token ids as the prompt to skip that",
    "--logprobs-mode": "logprobs are always the model's raw log-probabilities (vLLM's default, raw_logprobs)",
    **dict.fromkeys(("--numa-bind", "--numa-bind-nodes", "--numa-bind-cpus"),
                    "bind the process with numactl or taskset; --threads N sets its threads"),
}
# vLLM flags whose effect is what Conveyor always does: taken, with a log line saying so.
ALREADY_SO: dict[str, str] = {
    "--trust-remote-code": "Conveyor runs its own implementation of each supported architecture, never a repo's code",
    "--enable-chunked-prefill": "prefill is always chunked",
    "--disable-log-requests": "requests are logged only with --enable-log-requests",
    "--disable-custom-all-reduce": "tensor parallelism all-reduces through torch.distributed, never a custom kernel",
    "--disable-frontend-multiprocessing": "the HTTP front end runs in the engine's process",
    "--enable-server-load-tracking": "GET /load always reports the requests in flight",
}
# Of those, the ones that take a value: the flag and its value are taken.
ALREADY_SO_WITH_VALUE: dict[str, str] = {
    "--stream-interval": "a stream sends each engine step's new tokens as one chunk",
    "--max-parallel-loading-workers": "weights are memory-mapped and read once",
    "--safetensors-load-strategy": "weights are memory-mapped and read once",
    "--ignore-patterns": "a Hub repo's download is only the files the loader reads",
}
ALREADY_SO |= ALREADY_SO_WITH_VALUE | {
    "--use-tqdm-on-load": "loading logs one line, with its time",
    "--disable-cascade-attn": "there is no cascade attention",
    "--disable-hybrid-kv-cache-manager": "the KV pool serves every attention type of a model from one set of chunks",
}
# `LLM(...)` arguments of the same kind; `conveyor serve` takes these flags for what they say.
KWARGS_ALREADY_SO: dict[str, str] = ALREADY_SO | {
    "--disable-log-stats": "LLM logs no periodic stats (conveyor serve does, unless --disable-log-stats)",
}


class UnsupportedFlagError(ValueError):
    """A vLLM flag Conveyor does not take; the message says what to use instead."""


def expand_config_file(argv: list[str], known: Container[str] = ()) -> list[str]:
    """`argv` (`serve ...`) with vLLM's `--config FILE` replaced by the options the YAML file holds
    (`port: 8000`, `served-model-name: [a, b]`, `enable-prefix-caching: false`; underscores or dashes; a
    mapping value as JSON; false as `--no-...` where `known` has that option, else left out), placed
    after the subcommand and its MODEL, if it comes first, so that the command line's own options win,
    as in vLLM. ValueError naming the file when it is not a mapping of option names."""
    if argv[:1] != ["serve"] or not any(a == "--config" or a.startswith("--config=") for a in argv):
        return argv
    rest, files = list(argv), []
    while True:
        at = next((i for i, a in enumerate(rest) if a == "--config" or a.startswith("--config=")), None)
        if at is None:
            break
        if rest[at] == "--config":
            if at + 1 >= len(rest):
                raise ValueError("--config needs a file: --config FILE.yaml")
            files.append(rest[at + 1])
            del rest[at:at + 2]
        else:
            files.append(rest.pop(at).split("=", 1)[1])
    options = [option for name in files for option in config_file_options(Path(name), known)]
    at = 2 if len(rest) > 1 and not rest[1].startswith("-") else 1  # not between a list option and MODEL
    return rest[:at] + options + rest[at:]


def config_file_options(path: Path, known: Container[str] = ()) -> list[str]:
    """The command-line options of one vLLM config file (`expand_config_file`)."""
    import yaml

    try:
        values = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ValueError(f"--config {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"--config {path} is not valid YAML: {exc}") from None
    if not isinstance(values, dict):
        raise ValueError(f"--config {path} must map option names to values, e.g. 'port: 8000'")
    options: list[str] = []
    for key, value in values.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            options.append(flag)
        elif value is False:
            negated = "--no-" + flag[2:]
            options += [negated] if negated in known else []  # else off is the flag's default
        elif value is None:
            continue
        elif isinstance(value, list):
            options += [flag, *map(str, value)]
        elif isinstance(value, dict):
            options += [flag, json.dumps(value)]
        else:
            options += [flag, str(value)]
    return options


def check_vllm_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """(argv without the `ALREADY_SO` flags (and the values of those that take one), a note for each of
    those); `UnsupportedFlagError` for the first `UNSUPPORTED` flag, naming what to use. Arguments after
    `--` are left alone."""
    kept: list[str] = []
    notes: list[str] = []
    skip = False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg == "--":
            return kept + argv[i:], notes
        flag = arg.split("=", 1)[0]
        if flag in UNSUPPORTED:
            raise UnsupportedFlagError(f"{flag} (vLLM's) is not supported: {UNSUPPORTED[flag]}")
        if flag in ALREADY_SO_WITH_VALUE:
            notes.append(f"{arg if '=' in arg else ' '.join(argv[i:i + 2])}: no effect, {ALREADY_SO[flag]}")
            skip = "=" not in arg  # its value is the next argument
            continue
        if flag in ALREADY_SO and "=" not in arg:
            notes.append(f"{flag}: no effect, {ALREADY_SO[flag]}")
            continue
        kept.append(arg)
    return kept, notes


def check_vllm_kwargs(kwargs: dict[str, Any]) -> list[str]:
    """A note for each keyword argument whose vLLM meaning is what Conveyor always does (`KWARGS_ALREADY_SO`);
    `UnsupportedFlagError` for a vLLM argument Conveyor does not take, naming what to use; `TypeError`,
    as Python's own, for any other name."""
    notes: list[str] = []
    for name, value in kwargs.items():
        flag = "--" + name.replace("_", "-")
        negated = f"--no-{flag[2:]}"
        if flag in UNSUPPORTED or (value is False and negated in UNSUPPORTED):
            raise UnsupportedFlagError(f"{name}={value!r} (vLLM's) is not supported: "
                                       f"{UNSUPPORTED.get(flag) or UNSUPPORTED[negated]}")
        if flag not in KWARGS_ALREADY_SO:
            raise TypeError(f"LLM() got an unexpected keyword argument {name!r}")
        notes.append(f"{name}={value!r}: no effect, {KWARGS_ALREADY_SO[flag]}")
    return notes
