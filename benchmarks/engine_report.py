"""bench_engine.py's closing table (with the issue's targets) and plot."""

from __future__ import annotations

from pathlib import Path

from benchmarks.outputs import pyplot

# (what, target) checked in the table; ratios are to floors measured in the same run.
DECODE_TARGETS = {("greedy", 1): 1.20, ("greedy", 32): 1.15, ("greedy", 128): 1.15,
                  ("mixed", 32): 1.25, ("mixed", 128): 1.25}  # fmt: skip
PREFILL_RATIO_TARGET = 1.3  # 128 and 512 tokens: time / max(weight floor, FLOP floor)
PREFILL_RATE_TARGET = 0.75  # 2k and 8k: fraction of the measured matmul rate
THROUGHPUT_TARGET = 12_000.0  # output tok/s, 256-request workload, H100
GRAPH_BYTES_TARGET = 0.5e9  # decode graphs at max_num_seqs 256
MESSAGE_US_TARGET = 300.0  # 8k-token PrefillRequest encode + decode


def _ms(value: float | None) -> str:
    return f"{value * 1e3:8.2f}" if value is not None else f"{'-':>8}"


def _verdict(ok: bool | None) -> str:
    return "" if ok is None else ("PASS" if ok else "MISS")


def _experts(row: dict, experts: dict | None) -> str:
    """An MoE row's touched experts per layer (measured; uniform routing's) and the floor
    uniform routing would give."""
    touched = row.get("touched_experts")
    if not touched or not experts:
        return ""
    mean = sum(touched) / len(touched)
    uniform = f"uniform {row['touched_experts_uniform']:.1f}"
    if row.get("hbm_floor_uniform_s") is not None:
        uniform += f", floor {row['hbm_floor_uniform_s'] * 1e3:.2f} ms"
    return f"  experts {mean:.1f}/{experts['num_experts']} per layer ({uniform})"


def print_table(result: dict) -> None:
    ceil = result.get("ceilings")
    print(f"\n{result['model']} on {result['gpu']}, torch {result['torch']}")
    if ceil:
        fp8 = ceil.get("fp8_flops_per_s")
        print(
            f"ceilings: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
            f"bf16 matmul {ceil['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s"
            + (f", fp8 matmul {fp8 / 1e12:.0f} TFLOP/s" if fp8 else "")
        )
    engine = result.get("engine") or {}
    if "kv_dtype" in engine:
        scheme = engine["quantization_scheme"]
        weights = "unquantized" if scheme is None else f"fp8 {scheme['weights']}"
        print(
            f"weights {weights} ({engine['weight_bytes'] / 1e9:.2f} GB read per step), KV "
            f"{engine['kv_dtype']} ({engine['kv_bytes_per_token']} B/token, "
            f"{engine['kv_capacity_tokens']} tokens in {engine['num_kv_blocks']} blocks"
            + (f", {engine['kv_cache']})" if "kv_cache" in engine else ")")
        )
    experts = engine.get("experts")
    if experts:
        print(
            f"experts: {experts['num_experts']} routed, top {experts['top_k']}, in "
            f"{experts['moe_layers']} layers ({experts['expert_bytes'] / 1e6:.1f} MB each); "
            f"non-expert weights {experts['non_expert_bytes'] / 1e9:.2f} GB read per step"
        )
    rows = result.get("decode") or []
    if rows:
        print(
            "decode node loop          batch  running  context  ms/step  floor ms  replay ms  ratio"
        )
    for r in rows:
        loop = "overlapped " if r["overlap"] else "synchronous"
        target = DECODE_TARGETS.get((r["mix"], r["batch"])) if r["overlap"] else None
        ratio = r["ratio_to_floor"]
        check = f"x{ratio:.2f}" if ratio is not None else "-"
        if target is not None and ratio is not None:
            check += f" {_verdict(ratio <= target)} <= {target}"
        print(
            f"  {r['mix']:<6} {loop} {r['batch']:>6} {r['mean_running']:>8.1f} "
            f"{r['mean_context']:>8.0f} {_ms(r['step_s'])} {_ms(r['hbm_floor_s'])}  "
            f"{_ms(r['graph_replay_s'])}  {check}{_experts(r, experts)}"
        )
    for r in result.get("prefill") or []:
        line = f"prefill {r['tokens']:>5} tok {_ms(r['time_s'])} ms"
        if r.get("ratio_to_floor") is not None:
            line += (
                f"  weight floor {_ms(r['weight_floor_s'])}  FLOP floor {_ms(r['flop_floor_s'])}"
                f"  x{r['ratio_to_floor']:.2f}  {100 * r['fraction_of_matmul_rate']:.0f}% of "
                f"{r.get('matmul_ceiling', 'bf16')} matmul rate"
            )
            if r["tokens"] in (128, 512):
                ok = r["ratio_to_floor"] <= PREFILL_RATIO_TARGET
                line += f"  {_verdict(ok)} <= {PREFILL_RATIO_TARGET}x"
            elif r["tokens"] >= 2048:
                ok = r["fraction_of_matmul_rate"] >= PREFILL_RATE_TARGET
                line += f"  {_verdict(ok)} >= {PREFILL_RATE_TARGET:.0%}"
        print(line)
    for name, r in (result.get("throughput") or {}).items():
        check = ""
        if name == "ours_256" and ceil:
            check = (
                f"  {_verdict(r['tokens_per_s'] >= THROUGHPUT_TARGET)} >= {THROUGHPUT_TARGET:.0f}"
            )
        print(
            f"throughput {name:<26} {r['tokens_per_s']:9.0f} tok/s "
            f"({r['output_tokens']} tokens in {r['time_s']:.1f} s){check}"
        )
    engine = result.get("engine")
    if engine:
        graphs = engine["decode_graph_bytes"]
        check = _verdict(graphs <= GRAPH_BYTES_TARGET) if ceil else ""
        print(
            f"graph memory at max_num_seqs {engine['max_num_seqs']}: decode "
            f"{graphs / 1e9:.2f} GB {check} <= {GRAPH_BYTES_TARGET / 1e9} GB, prefill "
            f"{engine['prefill_graph_bytes'] / 1e9:.2f} GB (buckets {engine['prefill_graph_buckets']})"
        )
    m = result.get("messages")
    if m:
        print(
            f"8k-token PrefillRequest encode + decode {m['encode_decode_us']:.0f} us "
            f"{_verdict(m['encode_decode_us'] <= MESSAGE_US_TARGET)} <= {MESSAGE_US_TARGET:.0f} us"
        )


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    rows = [r for r in result.get("decode") or [] if r["ratio_to_floor"] is not None]
    if rows:
        labels = [
            f"{r['mix'][0]}{'' if r['overlap'] else 's'}{r['batch']}/{r['context']}" for r in rows
        ]
        axes[0].bar(labels, [r["ratio_to_floor"] for r in rows])
        axes[0].axhline(1.15, color="red", linestyle="--", label="greedy target 1.15")
        axes[0].set_ylabel("decode-node step / HBM floor")
        axes[0].set_xlabel("g/m = greedy/mixed, s = synchronous; batch")
        axes[0].legend()
    prefill = [r for r in result.get("prefill") or [] if r.get("ratio_to_floor") is not None]
    if prefill:
        axes[1].bar([str(r["tokens"]) for r in prefill], [r["ratio_to_floor"] for r in prefill])
        axes[1].axhline(1.3, color="red", linestyle="--", label="128/512 target 1.3")
        axes[1].set_ylabel("prefill / max(weight, FLOP floor)")
        axes[1].set_xlabel("prompt tokens")
        axes[1].legend()
    throughput = result.get("throughput") or {}
    if throughput:
        axes[2].bar(list(throughput), [v["tokens_per_s"] for v in throughput.values()])
        axes[2].set_ylabel("output tokens/s")
    fig.suptitle(f"{result['model']} on {result['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
