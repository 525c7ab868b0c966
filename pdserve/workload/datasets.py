"""Workloads: the requests a benchmark sends, built deterministically from a seed.

A workload is a list of `RequestSpec`s: a prompt (token ids or text) and the number of tokens
to generate. Token-id prompts work against any server that takes `prompt` as a list of ids
(ours, vLLM, SGLang), dummy weights included; text prompts are needed for the chat endpoint.

Named datasets (`--dataset`):
  random         input and output lengths drawn from `--input-len` / `--output-len`
  long-prompt    prefill-heavy: 2048-8192 prompt tokens, 128-512 output tokens
  chat           short prompts and answers with a heavy (lognormal) tail
  shared-prefix  groups of requests that share a long system prompt, then a question of their own
and `--dataset-path FILE.jsonl` for a user's own trace (one JSON object a line).

Length specs: `N` (always N), `A:B` (uniform integer in [A, B]) or `lognormal:MEDIAN:SIGMA:LO:HI`
(a lognormal with that median and log-space sigma, rounded and clipped to [LO, HI]).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DATASETS = ("random", "long-prompt", "chat", "shared-prefix")

# Default lengths per dataset (input, output); `--input-len` / `--output-len` override them.
DEFAULT_LENGTHS = {
    "random": ("1024", "128"),
    "long-prompt": ("2048:8192", "128:512"),
    "chat": ("lognormal:256:0.9:16:4096", "lognormal:128:0.9:8:1024"),
    # shared-prefix: the input length is the per-request question after the shared prefix
    "shared-prefix": ("64:256", "64:256"),
}

# Common English words, each one token in the usual BPE vocabularies: text prompts of about
# the asked length without a tokenizer on the client side (usage reports the real count).
WORDS = (
    "the of and to in is was for on that with as by at from his it an were are which this be "
    "has had one not but have they their its first after new two been other who when time "
    "year into more all also may she he city out can would about over world people state up "
    "school part three most later only some life work under team where film since then what "
    "there used many these between you early well during war being made both her while game "
    "before such back him our each river county than no age family long music group second "
    "area so known through national four government like around including became same great "
    "university because several film day season home day end name among water line order"
).split()


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload. Exactly one of `prompt_token_ids` and `prompt` is set."""

    output_len: int
    prompt_token_ids: tuple[int, ...] | None = None
    prompt: str | None = None
    group: int | None = None  # shared-prefix: which system prompt it shares

    def __post_init__(self) -> None:
        if (self.prompt_token_ids is None) == (self.prompt is None):
            raise ValueError("a request needs exactly one of prompt_token_ids and prompt")
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len}")

    @property
    def prompt_len(self) -> int:
        """Prompt tokens when known (token ids); words of a text prompt otherwise."""
        if self.prompt_token_ids is not None:
            return len(self.prompt_token_ids)
        return len(self.prompt.split()) if self.prompt else 0


def parse_length(spec: str) -> Callable[[random.Random], int]:
    """A sampler of lengths from a length spec (see the module docstring)."""
    parts = spec.split(":")
    try:
        if len(parts) == 1:
            fixed = int(parts[0])
            if fixed < 1:
                raise ValueError
            return lambda rng: fixed
        if len(parts) == 2:
            lo, hi = int(parts[0]), int(parts[1])
            if not 1 <= lo <= hi:
                raise ValueError
            return lambda rng: rng.randint(lo, hi)
        if len(parts) == 5 and parts[0] == "lognormal":
            median, sigma = float(parts[1]), float(parts[2])
            lo, hi = int(parts[3]), int(parts[4])
            if median <= 0 or sigma < 0 or not 1 <= lo <= hi:
                raise ValueError
            mu = math.log(median)
            return lambda rng: min(hi, max(lo, round(rng.lognormvariate(mu, sigma))))
    except ValueError:
        pass
    raise ValueError(
        f"bad length spec {spec!r}: use N, A:B (1 <= A <= B) or lognormal:MEDIAN:SIGMA:LO:HI"
    )


@dataclass(frozen=True)
class WorkloadConfig:
    dataset: str = "random"
    num_prompts: int = 100
    seed: int = 0
    input_len: str | None = None  # None: the dataset's default
    output_len: str | None = None
    text: bool = False  # text prompts instead of token ids (needed for the chat endpoint)
    token_id_range: tuple[int, int] = (1000, 30000)  # valid ids in every common vocabulary
    num_groups: int = 8  # shared-prefix
    prefix_len: int = 2048  # shared-prefix
    dataset_path: str | None = None

    def __post_init__(self) -> None:
        if self.dataset_path is None and self.dataset not in DATASETS:
            raise ValueError(f"unknown dataset {self.dataset!r}; known: {', '.join(DATASETS)}")
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        lo, hi = self.token_id_range
        if not 0 <= lo < hi:
            raise ValueError(f"token_id_range must be LO:HI with 0 <= LO < HI, got {lo}:{hi}")
        if self.num_groups < 1 or self.prefix_len < 1:
            raise ValueError(
                f"num_groups and prefix_len must be >= 1, got {self.num_groups}, {self.prefix_len}"
            )


def build_workload(config: WorkloadConfig) -> list[RequestSpec]:
    if config.dataset_path is not None:
        specs = read_jsonl(Path(config.dataset_path))
        return [specs[i % len(specs)] for i in range(config.num_prompts)]
    rng = random.Random(config.seed)
    default_in, default_out = DEFAULT_LENGTHS[config.dataset]
    input_len = parse_length(config.input_len or default_in)
    output_len = parse_length(config.output_len or default_out)
    prompt = _prompt_maker(config, rng)
    if config.dataset != "shared-prefix":
        return [_spec(prompt(input_len(rng)), output_len(rng)) for _ in range(config.num_prompts)]
    prefixes = [prompt(config.prefix_len) for _ in range(config.num_groups)]
    out = []
    for _ in range(config.num_prompts):
        group = rng.randrange(config.num_groups)
        out.append(_spec(prefixes[group] + prompt(input_len(rng)), output_len(rng), group))
    return out


def _prompt_maker(config: WorkloadConfig, rng: random.Random) -> Callable[[int], tuple | str]:
    if config.text:
        return lambda n: "".join(" " + rng.choice(WORDS) for _ in range(n))
    lo, hi = config.token_id_range
    return lambda n: tuple(rng.randrange(lo, hi) for _ in range(n))


def _spec(prompt: tuple | str, output_len: int, group: int | None = None) -> RequestSpec:
    if isinstance(prompt, str):
        return RequestSpec(output_len, prompt=prompt.lstrip(), group=group)
    return RequestSpec(output_len, prompt_token_ids=prompt, group=group)


def read_jsonl(path: Path) -> list[RequestSpec]:
    """A trace: one `{"prompt": str | "prompt_token_ids": [int], "output_len": int}` a line."""
    specs = []
    with path.open() as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not JSON ({exc.msg})") from None
            specs.append(_spec_from_row(row, where))
    if not specs:
        raise ValueError(f"{path}: no requests")
    return specs


def _spec_from_row(row: object, where: str) -> RequestSpec:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    out = row.get("output_len")
    if not isinstance(out, int) or isinstance(out, bool) or out < 1:
        raise ValueError(f"{where}: 'output_len' must be an integer >= 1, got {out!r}")
    ids, text = row.get("prompt_token_ids"), row.get("prompt")
    if (ids is None) == (text is None):
        raise ValueError(f"{where}: give exactly one of 'prompt' and 'prompt_token_ids'")
    if ids is not None:
        if not isinstance(ids, list) or not ids or not all(_is_token(t) for t in ids):
            raise ValueError(f"{where}: 'prompt_token_ids' must be a non-empty list of ids >= 0")
        return RequestSpec(out, prompt_token_ids=tuple(ids))
    if not isinstance(text, str) or not text:
        raise ValueError(f"{where}: 'prompt' must be a non-empty string")
    return RequestSpec(out, prompt=text)


def _is_token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
