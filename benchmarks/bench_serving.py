"""Load an OpenAI-compatible server with N concurrent streaming clients and report output
tokens/s, TTFT and inter-token latency, plus the server's per-phase timing record.

    python benchmarks/bench_serving.py --url http://127.0.0.1:8000 --concurrency 1 16 \
        --requests-per-client 4 --prompt-tokens 128 --max-tokens 64

Prompts are token ids (random, fixed seed), `ignore_eos` so every request yields max_tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import httpx


async def one_request(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    prompt: list[int],
    max_tokens: int,
    extra_body: dict | None = None,
) -> dict:
    """One streamed completion. `ttft` is the arrival of the first chunk with choices, so a
    model without a tokenizer (whose chunks carry no text) needs `{"logprobs": 0}` in
    `extra_body` to get a chunk per token; otherwise its first chunk is the last one."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra_body or {}),
    }
    start = time.perf_counter()
    arrivals, timing, usage = [], None, None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"server error: {chunk['error']}")
            if chunk.get("choices"):
                arrivals.append(time.perf_counter())
            timing = chunk.get("timing") or timing
            usage = chunk.get("usage") or usage
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return {
        "ttft": arrivals[0] - start,
        "e2e": time.perf_counter() - start,
        "gaps": gaps,
        "tokens": usage["completion_tokens"],
        "timing": timing,
    }


async def run_level(
    url: str,
    model: str,
    concurrency: int,
    per_client: int,
    prompt_tokens: int,
    max_tokens: int,
    seed: int,
    extra_body: dict | None = None,
) -> dict:
    rng = random.Random(seed + concurrency)
    async with httpx.AsyncClient(timeout=600) as client:

        async def worker(c: int) -> list[dict]:
            out = []
            for _ in range(per_client):
                prompt = [rng.randrange(100, 30000) for _ in range(prompt_tokens)]
                out.append(await one_request(client, url, model, prompt, max_tokens, extra_body))
            return out

        await one_request(client, url, model, [100] * prompt_tokens, 4, extra_body)  # warm-up
        start = time.perf_counter()
        results = [
            r for rs in await asyncio.gather(*(worker(c) for c in range(concurrency))) for r in rs
        ]
        wall = time.perf_counter() - start
    gaps = sorted(g for r in results for g in r["gaps"])
    tokens = sum(r["tokens"] for r in results)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tokens_per_s": tokens / wall,
        "ttft_median_s": statistics.median(r["ttft"] for r in results),
        "itl_median_s": statistics.median(gaps) if gaps else None,
        "itl_p99_s": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else None,
        "example_timing": results[0]["timing"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="default: the server's first model")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    model = args.model or httpx.get(args.url + "/v1/models").json()["data"][0]["id"]
    rows = [
        asyncio.run(
            run_level(
                args.url,
                model,
                c,
                args.requests_per_client,
                args.prompt_tokens,
                args.max_tokens,
                args.seed,
            )
        )
        for c in args.concurrency
    ]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    print(json.dumps(rows[0]["example_timing"], indent=1))
    print(
        f"{'clients':>7} {'requests':>8} {'out tok/s':>10} {'TTFT p50 ms':>12} {'ITL p50 ms':>11} {'ITL p99 ms':>11}"
    )
    for r in rows:
        print(
            f"{r['concurrency']:>7} {r['requests']:>8} {r['output_tokens_per_s']:>10.1f} {r['ttft_median_s'] * 1e3:>12.1f} "
            f"{(r['itl_median_s'] or 0) * 1e3:>11.1f} {(r['itl_p99_s'] or 0) * 1e3:>11.1f}"
        )


if __name__ == "__main__":
    main()
