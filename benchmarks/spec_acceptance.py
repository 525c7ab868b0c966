"""N-gram speculation with real weights: tokens per target forward of the embedded model
(SmolLM2-135M-Instruct, CPU, greedy) on tasks whose answer reuses the prompt, and on free chat.

Tasks, built from text already on the machine (the Debian license texts, the Python standard
library's docstrings and source):
- `spelling`: correct a paragraph into which a few misspellings were put deterministically;
- `extract`: copy the sentences of a paragraph that mention a given word;
- `code`: continue the first lines of a standard-library function;
- `chat`: questions with no text to reuse.

Each prompt runs alone (batch 1), once with speculation off and once on; the outputs must be
identical token for token. Reported per task: the mean accepted length (1 + accepted / drafts,
from each request's `SpecStats`), the acceptance rate, output tokens per decode forward (steps
with no draft included) and the wall-clock speedup.

    python benchmarks/spec_acceptance.py [--prompts 10] [--max-tokens 256] [-k 4] \
        [--ngram-min 1] [--ngram-max 4] [--threads 1] [--out spec_acceptance.json]
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import platform
import random
import re
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path
from typing import Any

import torch

from common import LLM, RequestOutput, SamplingParams

LICENSES = Path("/usr/share/common-licenses")
LICENSE_TEXTS = ("Apache-2.0", "GPL-3", "MPL-2.0", "LGPL-2.1", "GFDL-1.3", "Artistic")
# Standard-library modules whose docstrings are prose paragraphs.
DOC_MODULES = ("json", "argparse", "logging", "pickle", "subprocess", "difflib", "shutil")
# Standard-library functions long enough that their first lines do not give the rest away.
CODE_FUNCTIONS = (
    "textwrap.TextWrapper._wrap_chunks",
    "difflib.SequenceMatcher.find_longest_match",
    "shutil._copytree",
    "json.decoder.py_scanstring",
    "argparse.HelpFormatter._format_usage",
    "heapq.merge",
    "fractions.Fraction.limit_denominator",
    "ipaddress._BaseNetwork.subnets",
    "string.Template.substitute",
    "tokenize.detect_encoding",
)
QUESTIONS = (
    "Why is the sky blue?",
    "What are three good habits for staying healthy?",
    "How does a refrigerator keep food cold?",
    "What is the difference between weather and climate?",
    "Give me some tips for learning to play the guitar.",
    "Why do leaves change color in the autumn?",
    "What should I pack for a weekend camping trip?",
    "How do bees make honey?",
    "What makes a good friend?",
    "Explain how a rainbow forms.",
)
WORD = re.compile(r"[A-Za-z]+")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(\"])")


@dataclass(frozen=True)
class Prompt:
    task: str
    source: str  # where the text came from
    messages: list[dict[str, str]]


def paragraphs(text: str, min_words: int, max_words: int) -> list[str]:
    """Blank-line separated paragraphs of prose, re-flowed to one line, within the word range;
    headings, lists and indented blocks are left out."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        flat = " ".join(block.split())
        words = len(flat.split())
        if min_words <= words <= max_words and flat[0].isupper() and flat[-1] in ".:;":
            out.append(flat)
    return out


def prose(min_words: int, max_words: int) -> list[tuple[str, str]]:
    """(source, paragraph) pairs from the license texts, then the module docstrings."""
    found: list[tuple[str, str]] = []
    for name in LICENSE_TEXTS:
        path = LICENSES / name
        if path.exists():
            found += [(str(path), p) for p in paragraphs(path.read_text(), min_words, max_words)]
    for name in DOC_MODULES:
        doc = import_module(name).__doc__ or ""
        found += [(f"{name}.__doc__", p) for p in paragraphs(doc, min_words, max_words)]
    return found


def pick(items: list, count: int, seed: int) -> list:
    if len(items) < count:
        raise ValueError(f"only {len(items)} candidate texts for {count} prompts")
    return random.Random(seed).sample(items, count)


def misspell(text: str, count: int, rng: random.Random) -> str:
    """`count` words of five letters or more, each changed by one edit: two inner letters
    swapped, a letter dropped or a letter doubled."""
    words = [m for m in WORD.finditer(text) if len(m.group()) >= 5]
    chosen = sorted(rng.sample(words, min(count, len(words))), key=lambda m: m.start())
    out, last = [], 0
    for m in chosen:
        w, i = m.group(), rng.randrange(1, len(m.group()) - 2)
        edit = rng.randrange(3)
        if edit == 0 and w[i] != w[i + 1]:  # swapping equal letters would change nothing
            wrong = w[:i] + w[i + 1] + w[i] + w[i + 2 :]
        elif edit == 1:
            wrong = w[:i] + w[i + 1 :]
        else:
            wrong = w[:i] + w[i] + w[i:]
        out += [text[last : m.start()], wrong]
        last = m.end()
    return "".join(out + [text[last:]])


def spelling_prompts(count: int, seed: int = 0) -> list[Prompt]:
    rng = random.Random(seed)
    prompts = []
    for source, text in pick(prose(40, 110), count, seed):
        wrong = misspell(text, 4, rng)
        ask = (
            "Correct the spelling mistakes in the text below. Reply with the corrected text "
            f"only.\n\nText:\n{wrong}"
        )
        prompts.append(Prompt("spelling", source, [{"role": "user", "content": ask}]))
    return prompts


def sentences_with_word(text: str) -> tuple[list[str], str] | None:
    """The paragraph's sentences and a word (5+ letters) found in two or three of them but not
    all; None when the paragraph has no such word."""
    sentences = SENTENCE_END.split(text)
    if len(sentences) < 3:
        return None
    counts: dict[str, int] = {}
    for s in sentences:
        for w in {w.lower() for w in WORD.findall(s) if len(w) >= 5}:
            counts[w] = counts.get(w, 0) + 1
    words = sorted(w for w, n in counts.items() if 2 <= n <= min(3, len(sentences) - 1))
    return (sentences, words[0]) if words else None


def extract_prompts(count: int, seed: int = 0) -> list[Prompt]:
    candidates = []
    for source, text in prose(50, 160):
        found = sentences_with_word(text)
        if found is not None:
            candidates.append((source, text, found[1]))
    prompts = []
    for source, text, word in pick(candidates, count, seed):
        ask = (
            f'Copy the sentences of the text below that mention the word "{word}". Reply with '
            f"those sentences only, exactly as written.\n\nText:\n{text}"
        )
        prompts.append(Prompt("extract", source, [{"role": "user", "content": ask}]))
    return prompts


def function_source(dotted: str) -> str:
    """The function's source, dedented, without its docstring (so the first lines are code)."""
    module_name, _, attr = dotted.partition(".")
    obj: Any = import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    source = textwrap.dedent(inspect.getsource(obj))
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    first = body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        lines = source.splitlines()
        del lines[first.lineno - 1 : first.end_lineno]
        source = "\n".join(lines)
    return source


def code_prompts(count: int, lines: int = 24) -> list[Prompt]:
    if count > len(CODE_FUNCTIONS):
        raise ValueError(f"only {len(CODE_FUNCTIONS)} code functions for {count} prompts")
    prompts = []
    for dotted in CODE_FUNCTIONS[:count]:
        head = "\n".join(function_source(dotted).splitlines()[:lines])
        ask = f"Continue the following Python code.\n\n```python\n{head}\n```"
        prompts.append(Prompt("code", f"{dotted} (stdlib)", [{"role": "user", "content": ask}]))
    return prompts


def chat_prompts(count: int) -> list[Prompt]:
    if count > len(QUESTIONS):
        raise ValueError(f"only {len(QUESTIONS)} questions for {count} prompts")
    return [Prompt("chat", "question", [{"role": "user", "content": q}]) for q in QUESTIONS[:count]]


TASKS: dict[str, Callable[[int], list[Prompt]]] = {
    "spelling": spelling_prompts,
    "extract": extract_prompts,
    "code": code_prompts,
    "chat": chat_prompts,
}
REUSE_TASKS = ("spelling", "extract", "code")


def run_one(llm: LLM, prompt: Prompt, params: SamplingParams) -> tuple[RequestOutput, float]:
    """The output of one prompt run alone, and its wall-clock seconds."""
    start = time.perf_counter()
    out = llm.chat(prompt.messages, params)[0]
    return out, time.perf_counter() - start


def compare(plain: LLM, speculating: LLM, prompt: Prompt, params: SamplingParams) -> dict:
    """One prompt with speculation off, then on: the row the JSON keeps."""
    off, seconds_off = run_one(plain, prompt, params)
    on, seconds_on = run_one(speculating, prompt, params)
    stats = on.spec_decode
    if stats is None:
        raise ValueError("the second LLM does not speculate: it reports no spec_decode counts")
    return {
        "source": prompt.source,
        "prompt_tokens": len(on.prompt_token_ids),
        "output_tokens": len(on.token_ids),
        "identical": on.token_ids == off.token_ids,
        "num_drafts": stats["num_drafts"],
        "num_draft_tokens": stats["num_draft_tokens"],
        "num_accepted_tokens": stats["num_accepted_tokens"],
        "seconds_off": round(seconds_off, 2),
        "seconds_on": round(seconds_on, 2),
        "text": on.text,
    }


def summarize(rows: list[dict]) -> dict:
    drafts = sum(r["num_drafts"] for r in rows)
    drafted = sum(r["num_draft_tokens"] for r in rows)
    accepted = sum(r["num_accepted_tokens"] for r in rows)
    tokens = sum(r["output_tokens"] for r in rows)
    # The first token comes from the prefill; each decode forward emits 1 + its accepted drafts.
    forwards = sum(max(1, r["output_tokens"] - 1 - r["num_accepted_tokens"]) for r in rows)
    plain = sum(r["seconds_off"] for r in rows)
    spec = sum(r["seconds_on"] for r in rows)
    return {
        "prompts": len(rows),
        "output_tokens": tokens,
        "num_drafts": drafts,
        "num_draft_tokens": drafted,
        "num_accepted_tokens": accepted,
        "mean_accepted_length": round(1 + accepted / drafts, 3) if drafts else 1.0,
        "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
        "tokens_per_decode_forward": round((tokens - len(rows)) / forwards, 3),
        "identical": all(r["identical"] for r in rows),
        "seconds_off": round(plain, 1),
        "seconds_on": round(spec, 1),
        "cpu_speedup": round(plain / spec, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--prompts", type=int, default=10, help="prompts per task")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--ngram-min", type=int, default=1)
    parser.add_argument("--ngram-max", type=int, default=4)
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch threads (on cores shared with other work, one thread is several times "
        "faster than two)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("spec_acceptance.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    spec = {
        "speculative_method": "ngram",
        "num_speculative_tokens": args.num_speculative_tokens,
        "speculative_ngram_min": args.ngram_min,
        "speculative_ngram_max": args.ngram_max,
    }
    # Prefix caching off: a prompt's second run must not start from the first run's KV.
    plain = LLM(device="cpu", enable_prefix_caching=False)
    speculating = LLM(device="cpu", enable_prefix_caching=False, **spec)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    result: dict[str, Any] = {
        "model": "embedded SmolLM2-135M-Instruct",
        "settings": {**spec, "max_tokens": args.max_tokens, "temperature": 0, "batch": 1},
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "tasks": {},
    }
    for task in args.tasks:
        rows = []
        for prompt in TASKS[task](args.prompts):
            row = compare(plain, speculating, prompt, params)
            rows.append(row)
            print(f"{task:<9}{row['output_tokens']:>5} tokens  identical={row['identical']}  "
                  f"accepted {row['num_accepted_tokens']}/{row['num_draft_tokens']} in "
                  f"{row['num_drafts']} drafts  {row['seconds_off']}s -> {row['seconds_on']}s",
                  flush=True)  # fmt: skip
        result["tasks"][task] = {"summary": summarize(rows), "prompts": rows}
    print(f"\n{'task':<10}{'prompts':>8}{'tokens':>8}{'accepted len':>14}{'rate':>7}"
          f"{'tok/fwd':>9}{'identical':>11}{'speedup':>9}")  # fmt: skip
    for task, entry in result["tasks"].items():
        s = entry["summary"]
        print(f"{task:<10}{s['prompts']:>8}{s['output_tokens']:>8}"
              f"{s['mean_accepted_length']:>14.2f}{s['acceptance_rate']:>7.2f}"
              f"{s['tokens_per_decode_forward']:>9.2f}{'yes' if s['identical'] else 'NO':>11}"
              f"{s['cpu_speedup']:>9.2f}")  # fmt: skip
    reuse = [result["tasks"][t]["summary"] for t in REUSE_TASKS if t in result["tasks"]]
    if reuse:
        met = all(s["mean_accepted_length"] >= 2.0 and s["identical"] for s in reuse)
        print(f"target (>= 2.0 tokens per target forward on the reuse tasks, identical output): "
              f"{'met' if met else 'MISSED'}")  # fmt: skip
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
