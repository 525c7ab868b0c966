"""Cost of grammar masks on the decode step, in one run: the same decode batch with no
constrained row, then with half its rows under a JSON-schema grammar (xgrammar bitmasks filled
on the host, applied to the logits on the device; `common/engine/logits_processors.py`).

    python benchmarks/bench_structured.py                          # GPU: Qwen2.5-7B shape, dummy weights
    python benchmarks/bench_structured.py --model benchmarks/configs/llama-3.1-8b-instruct
    python benchmarks/bench_structured.py --tiny --device cpu --batch-sizes 2 4 --steps 3   # smoke

Weights are random (`--load-format dummy`); the grammar needs a tokenizer: the model
directory's if it has one, else the embedded SmolLM2's (49k tokens; the model's larger vocab
is padded, so masks are filled over the SmolLM2 vocabulary). The grammar is an array of at
least 100000 strings, so no constrained row can finish while it is timed and most steps are
inside a string (the widest masks). Prints one table last: median and p90 of the whole decode
step (`LLMEngine.step`: schedule, model, masks, sampling, update) and of the mask work alone.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from common.engine.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.protocol.sampling_params import SamplingParams
from common.text.tokenizer import TOKENIZER_FILES

ROOT = Path(__file__).resolve().parent.parent
GRAMMAR = {
    "type": "json_schema",
    "schema": json.dumps({"type": "array", "items": {"type": "string"}, "minItems": 100000}),
}
TINY = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=49152,
    max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=True,
)  # fmt: skip


def model_dir(args: argparse.Namespace, work: Path) -> Path:
    """A directory with the config and a tokenizer (copied in when the model has none)."""
    from common.model.source import resolve_model

    target = work / "model"
    target.mkdir()
    if args.tiny:
        (target / "config.json").write_text(json.dumps(TINY))
    else:
        shutil.copy(Path(args.model) / "config.json", target / "config.json")
    source = Path(args.model) if not args.tiny else None
    if source is None or not any((source / f).exists() for f in TOKENIZER_FILES):
        source = resolve_model(None).directory  # the embedded SmolLM2's tokenizer
    for file in source.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(file, target / file.name)
    return target


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_batch(engine: LLMEngine, args, batch: int, constrained: int) -> dict[str, float]:
    # Rows prefilled in the first chunks decode while later ones still prefill (mixed and
    # overlapped steps), so the budget leaves room for one token per prefill step too.
    total = args.warmup + args.steps + batch
    generator = torch.Generator().manual_seed(batch)
    vocab = engine.runtime.vocab_size
    ids = []
    for i in range(batch):
        prompt = torch.randint(100, vocab, (args.prompt_len,), generator=generator).tolist()
        params = SamplingParams(
            temperature=0, max_tokens=total, ignore_eos=True,
            structured=GRAMMAR if i < constrained else None,
        )  # fmt: skip
        rid = f"b{batch}-c{constrained}-{i}"
        engine.add_request(rid, prompt, params)
        ids.append(rid)
    while any(not s.output_token_ids for s in engine.sequences.values()):
        engine.step()  # prefill (chunked) until every row has its first token
    processors = engine.worker.runner.logits_processors
    mask_times: list[float] = []
    apply = processors.apply

    def timed(logits, seqs):
        start = time.perf_counter()
        out = apply(logits, seqs)
        mask_times.append(time.perf_counter() - start)
        return out

    processors.apply = timed
    step_times = []
    try:
        for k in range(args.warmup + args.steps):
            sync(args.device)
            start = time.perf_counter()
            events = engine.step()
            sync(args.device)
            if k < args.warmup:
                # Overlapped, the first steps still resolve steps launched before the last
                # prompts had their first token, so they advance fewer rows.
                continue
            step_times.append(time.perf_counter() - start)
            assert len(events) == batch, f"decode step advanced {len(events)} of {batch} rows"
    finally:
        processors.apply = apply
        for rid in ids:
            engine.abort(rid)
    masks = mask_times[args.warmup :]
    return {
        "batch": batch,
        "constrained": constrained,
        "step_ms_median": 1e3 * statistics.median(step_times),
        "step_ms_p90": 1e3 * sorted(step_times)[int(0.9 * (len(step_times) - 1))],
        "mask_ms_median": 1e3 * statistics.median(masks),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=str(ROOT / "benchmarks/configs/qwen2.5-7b-instruct"))
    ap.add_argument("--tiny", action="store_true", help="a tiny random Llama (CPU smoke run)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as work:
        config = EngineConfig.from_options(
            model=str(model_dir(args, Path(work))), load_format="dummy", device=args.device,
            dtype=args.dtype, max_num_seqs=max(args.batch_sizes),
            max_num_batched_tokens=max(2048, args.prompt_len),
            max_model_len=args.prompt_len + args.warmup + args.steps + max(args.batch_sizes) + 16,
        )  # fmt: skip
        engine = LLMEngine(config)
        rows = []
        for batch in args.batch_sizes:
            for constrained in (0, batch // 2):
                rows.append(run_batch(engine, args, batch, constrained))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=2))
    print(f"grammar masks on the decode step ({engine.runtime.device}, {engine.runtime.dtype})")
    print("batch  constrained  step ms p50  step ms p90  masks ms p50  step vs unconstrained")
    plain = {}
    for row in rows:
        if row["constrained"] == 0:
            plain[row["batch"]] = row["step_ms_median"]
        ratio = row["step_ms_median"] / plain[row["batch"]]
        print(
            f"{row['batch']:>5}  {row['constrained']:>11}  {row['step_ms_median']:>11.2f}  "
            f"{row['step_ms_p90']:>11.2f}  {row['mask_ms_median']:>12.3f}  {ratio:>20.3f}x"
        )


if __name__ == "__main__":
    main()
