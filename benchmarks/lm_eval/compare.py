"""lm-evaluation-harness on the embedded model, both tasks of this folder, three ways: pdserve PD
and pdserve colocated through lm-eval's `local-completions` model, and lm-eval's own `hf`
backend on the same weights in fp32; also `local-chat-completions` on the generate_until task.
Prints the scores and, against hf, the largest per-sample loglikelihood gap and the number of
generations that differ; `--out` writes all of it, every sample included, as JSON. `--fp8` adds
PD and colocated runs with FP8 weights and KV cache. tests/test_lm_eval.py runs the same
functions on a PD stack. Needs lm-eval: pip install -e '.[lmeval]'.

    python benchmarks/lm_eval/compare.py [--fp8] [--out docs/bench/lm_eval_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

TASK_DIR = Path(__file__).resolve().parent
ROOT = TASK_DIR.parent.parent
MODEL = "SmolLM2-135M-Instruct"
MC, GEN = "pdserve_capitals_mc", "pdserve_capitals_gen"
MC_SCORE, GEN_SCORE = "acc,none", "exact_match,strip"
# hf batches its own forwards; pdserve takes one prompt per completion request, so lm-eval's
# API models keep their default batch size of 1.
HF_BATCH_SIZE = 8


def offline_env(datasets_cache: Path) -> dict[str, str]:
    """lm-eval on the local tasks with no network. Set before `import lm_eval`: datasets reads
    its environment on import."""
    return {
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(datasets_cache),
    }


def task_manager() -> Any:
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASK_DIR), include_defaults=False)


def completions_args(base_url: str, tokenizer_dir: Path) -> dict[str, Any]:
    """`local-completions` as the README gives it: lm-eval tokenizes with the model's own
    tokenizer (its default, tiktoken, does not know this model) and sends token ids."""
    return {
        "model": MODEL,
        "base_url": base_url + "/v1/completions",
        "tokenizer_backend": "huggingface",
        "tokenizer": str(tokenizer_dir),
        "max_retries": 1,
    }


def chat_args(base_url: str) -> dict[str, Any]:
    return {"model": MODEL, "base_url": base_url + "/v1/chat/completions", "max_retries": 1}


def hf_args(model_dir: Path) -> dict[str, Any]:
    return {"pretrained": str(model_dir), "dtype": "float32", "device": "cpu"}


def evaluate(
    model: str, model_args: dict[str, Any], tasks: list[str], manager: Any, **kw: Any
) -> dict[str, Any]:
    """`lm_eval.simple_evaluate` with every sample logged. The tasks' data path is relative to
    the repository root, so the working directory must be it."""
    import lm_eval

    if Path.cwd() != ROOT:
        raise ValueError(f"run from the repository root {ROOT}, not {Path.cwd()}")
    out = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=tasks,
        task_manager=manager,
        log_samples=True,
        **kw,
    )
    assert out is not None  # None only on non-zero ranks of a distributed run
    return out


def _rows(out: dict[str, Any], task: str) -> list[dict[str, Any]]:
    return sorted(out["samples"][task], key=lambda s: s["doc_id"])


def loglikelihoods(out: dict[str, Any]) -> list[list[float]]:
    """Per row of the multiple-choice task, lm-eval's loglikelihood of each choice."""
    return [[float(ll) for ll, _greedy in row["filtered_resps"]] for row in _rows(out, MC)]


def generations(out: dict[str, Any]) -> list[str]:
    """Per row of the generate_until task, the answer after the task's filters."""
    return [row["filtered_resps"][0] for row in _rows(out, GEN)]


def summary(out: dict[str, Any], reference: dict[str, Any] | None) -> dict[str, Any]:
    """Scores and samples of one run; with `reference` (the hf run), the gaps to it."""
    results = out["results"]
    row: dict[str, Any] = {}
    if MC in results:
        row |= {"mc_acc": results[MC][MC_SCORE], "mc_loglikelihoods": loglikelihoods(out)}
    if GEN in results:
        row |= {"gen_exact_match": float(results[GEN][GEN_SCORE]), "generations": generations(out)}
    if reference is not None and MC in results:
        pairs = zip(loglikelihoods(out), loglikelihoods(reference), strict=True)
        row["max_loglikelihood_gap"] = max(
            abs(a - b) for ours, theirs in pairs for a, b in zip(ours, theirs, strict=True)
        )
    if reference is not None and GEN in results:
        pairs = zip(generations(out), generations(reference), strict=True)
        row["generations_differing"] = sum(a != b for a, b in pairs)
    return row


def _pdserve_runs(mode: str, stack_args: list[str], model_dir: Path, manager: Any, tmp: Path):
    from benchmarks.stack import PDStack, same_python_env

    log = tmp / f"{mode}.log"
    stack = PDStack(*stack_args, log_path=log, env=same_python_env(tmp / "venv"))
    try:
        completions = evaluate(
            "local-completions", completions_args(stack.url, model_dir), [MC, GEN], manager
        )
        chat = None
        if mode == "pd":
            chat = evaluate(
                "local-chat-completions",
                chat_args(stack.url),
                [GEN],
                manager,
                apply_chat_template=True,
            )
    finally:
        left = stack.stop()
    if left:
        raise RuntimeError(f"{mode} stack left processes {left}; log: {log}")
    return completions, chat


# FP8 as a user asks for it from a high-precision checkpoint: weights quantized at load (per
# channel, dynamic per-token activations) and an e4m3 KV cache; on CPU the dequantizing paths.
FP8_ARGS = ["--quantization", "fp8", "--kv-cache-dtype", "fp8"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="JSON with scores and every sample")
    ap.add_argument(
        "--fp8", action="store_true", help="also PD and colocated with FP8 weights and KV cache"
    )
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))  # run as a script: the repository's packages
    os.chdir(ROOT)
    with tempfile.TemporaryDirectory(prefix="lm_eval_compare_") as name:
        tmp = Path(name)
        os.environ.update(offline_env(tmp / "datasets"))
        import lm_eval
        import torch

        from common.model.source import resolve_model

        model_dir = resolve_model(None).directory
        manager = task_manager()
        hf = evaluate("hf", hf_args(model_dir), [MC, GEN], manager, batch_size=HF_BATCH_SIZE)
        pd, chat = _pdserve_runs("pd", [], model_dir, manager, tmp)
        colocated, _ = _pdserve_runs("colocated", ["--colocated"], model_dir, manager, tmp)
        fp8 = {}
        if args.fp8:
            fp8["PD"], _ = _pdserve_runs("pd-fp8", FP8_ARGS, model_dir, manager, tmp)
            colocated_fp8 = ["--colocated", *FP8_ARGS]
            fp8["colocated"], _ = _pdserve_runs(
                "colocated-fp8", colocated_fp8, model_dir, manager, tmp
            )
    rows = {
        "pdserve PD, local-completions": summary(pd, hf),
        "pdserve colocated, local-completions": summary(colocated, hf),
        **{f"pdserve {mode}, FP8 W8A8 + FP8 KV": summary(out, hf) for mode, out in fp8.items()},
        "lm-eval hf, fp32": summary(hf, None),
        "pdserve PD, local-chat-completions": summary(chat, None),
    }
    print("| run | mc acc | gen exact match | max loglikelihood gap to hf | generations != hf |")
    print("|---|---|---|---|---|")
    for label, row in rows.items():
        cells = [
            row.get("mc_acc"),
            row.get("gen_exact_match"),
            row.get("max_loglikelihood_gap"),
            row.get("generations_differing"),
        ]
        print(f"| {label} | " + " | ".join("-" if c is None else f"{c:.3g}" for c in cells) + " |")
    if args.out is not None:
        meta = {"lm_eval": lm_eval.__version__, "torch": torch.__version__, "model": MODEL}
        args.out.write_text(json.dumps({"versions": meta, "runs": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
