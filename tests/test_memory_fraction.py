"""`--gpu-memory-fraction`: a share of the GPU's total memory per process, whatever other
processes use, so nodes sharing a GPU each get theirs; the launcher splits the default among
the nodes it puts on one GPU, refuses shares that sum past 1, and prints each node's memory.
The arithmetic runs on CPU; the last test starts three nodes on one GPU where there is one."""

from __future__ import annotations

import urllib.request

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.kv_cache import GpuMemory, gpu_kv_budget
from common.node.config import parse_node_args
from pdserve.flags import build_parser
from pdserve.launcher import node_summary
from pdserve.plan import NodeProcess, configs_from_args, plan

GB = 10**9


def fraction_of(argv: list[str]) -> float | None:
    return (
        float(argv[argv.index("--gpu-memory-fraction") + 1])
        if "--gpu-memory-fraction" in argv
        else None
    )


def test_a_share_of_total_memory_does_not_shrink_by_what_other_processes_use():
    alone = GpuMemory(total=100 * GB, free=90 * GB, own=12 * GB, held=10 * GB)
    # The same process beside another that holds 50 GB: the same KV pool.
    beside = GpuMemory(total=100 * GB, free=40 * GB, own=12 * GB, held=10 * GB)
    assert gpu_kv_budget(alone, 0.4, 2 * GB) == gpu_kv_budget(beside, 0.4, 2 * GB) == 26 * GB


def test_two_and_three_nodes_on_one_gpu_each_get_their_share_in_any_start_order():
    total, own, held = 100 * GB, 10 * GB, 8 * GB
    for fractions in ((0.4, 0.4), (0.3, 0.3, 0.3), (0.6, 0.3)):
        used = 0  # what the nodes sized earlier hold: their whole share
        for fraction in fractions:
            memory = GpuMemory(total, total - used - held, own, held)
            assert gpu_kv_budget(memory, fraction, GB) == int(total * fraction) - own - GB
            used += int(total * fraction)


def test_a_share_below_weights_and_activations_is_refused_naming_the_fraction_and_sizes():
    memory = GpuMemory(total=80 * GB, free=60 * GB, own=15 * GB, held=15 * GB)
    with pytest.raises(ValueError) as error:
        gpu_kv_budget(memory, 0.2, GB)
    text = str(error.value)
    assert "--gpu-memory-fraction 0.2 allows 16.00 GB of this GPU's 80.00 GB" in text
    assert "16.00 GB this process needs" in text and "raise the fraction" in text


def test_shares_summing_past_the_gpu_are_refused_naming_the_others_use():
    # Another process holds 70 GB: a further 0.4 share cannot be free.
    memory = GpuMemory(total=100 * GB, free=22 * GB, own=10 * GB, held=8 * GB)
    with pytest.raises(ValueError, match="other processes use 70.00 GB.*sum to at most 1"):
        gpu_kv_budget(memory, 0.4, GB)


def test_the_old_flag_name_sets_the_same_fraction_everywhere():
    serve = configs_from_args(
        build_parser().parse_args(["serve", "--kv-memory-fraction", "0.5",
                                   "--decode-kv-memory-fraction", "0.3"])
    )  # fmt: skip
    assert serve.engines["prefill"].cache.gpu_memory_fraction == 0.5
    assert serve.engines["decode"].cache.gpu_memory_fraction == 0.3
    _, node = parse_node_args("node", ["--kv-memory-fraction", "0.4"])
    assert node.cache.gpu_memory_fraction == 0.4
    assert EngineConfig.from_options(kv_memory_fraction=0.2).cache.gpu_memory_fraction == 0.2


def layout(*argv: str, gpus: int = 1):
    configs = configs_from_args(
        build_parser().parse_args(["serve", "--zmq-base-port", "7000", *argv])
    )
    return plan(configs, "/m", "m", gpus)


def test_nodes_the_launcher_puts_on_one_gpu_share_the_default_and_keep_a_given_fraction():
    shared = layout()  # a prefill and a decode node on GPU 0
    assert [fraction_of(n.argv) for n in shared.nodes] == [0.425, 0.425]
    assert [n.gpu_memory_fraction for n in shared.nodes] == [0.425, 0.425]
    three = layout("--num-decode", "2", "--prefill-gpus", "0", "--decode-gpus", "0")
    assert [fraction_of(n.argv) for n in three.nodes] == [0.283] * 3
    given = layout("--prefill-gpu-memory-fraction", "0.3", "--decode-gpu-memory-fraction", "0.6")
    assert [fraction_of(n.argv) for n in given.nodes] == [0.3, 0.6]
    alone = layout(gpus=2)  # one node per GPU: the default, so no flag
    assert [fraction_of(n.argv) for n in alone.nodes] == [None, None]
    assert [n.gpu_memory_fraction for n in alone.nodes] == [0.85, 0.85]
    fixed = layout("--num-kv-blocks", "64")  # a pool not sized by a share
    assert [n.gpu_memory_fraction for n in fixed.nodes] == [None, None]
    cpu = layout(gpus=0)
    assert [n.gpu_memory_fraction for n in cpu.nodes] == [None, None]


def test_fractions_summing_past_one_on_a_gpu_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match="GPU 0 would hold prefill-0 0.5, decode-0 0.6: their"):
        layout("--prefill-gpu-memory-fraction", "0.5", "--decode-gpu-memory-fraction", "0.6")
    with pytest.raises(ValueError, match="sum to 1.2, more than the whole GPU"):
        layout("--num-decode", "3", "--decode-gpus", "0", "--gpu-memory-fraction", "0.3")


def test_the_launcher_summary_shows_weights_graphs_kv_and_the_gpu_share():
    kv_format = {"kv_dtype": "bfloat16", "num_layers": 28, "planes": 2, "num_kv_heads": 4,
                 "head_dim": 128, "speculative": "none"}  # fmt: skip
    info = {"num_kv_blocks": 999, "block_size": 16, "max_model_len": 32768, "pid": 7,
            "device": "cuda:0", "dtype": "bfloat16", "weight_bytes": 15_230_000_000,
            "cuda_graph_bytes": 300_000_000, "prefill_graph_bytes": 110_000_000,
            "kv_format": kv_format}  # fmt: skip
    node = NodeProcess("decode-0", "decode", "tcp://d", [], 1, gpu_memory_fraction=0.425)
    line = node_summary(node, {"info": info})
    kv = 1000 * 16 * 28 * 2 * 4 * 128 * 2  # blocks with the padding one x block bytes
    assert f"weights 15.23 GB, graphs 0.41 GB, KV {kv / 1e9:.2f} GB (GPU share 0.425);" in line
    assert line.endswith("; speculative none")
    info["tp"] = 2  # each figure is one rank's: half the KV heads
    assert f"KV {kv / 2e9:.2f} GB" in node_summary(node, {"info": info})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_prefill_and_two_decode_nodes_on_one_gpu_start_by_fractions_and_serve(tmp_path):
    """Qwen2.5-7B's config with dummy weights (no tokenizer: token-id prompts), so the three
    nodes hold real weights (15 GB each) inside their 0.283 shares."""
    import json

    from benchmarks.stack import ROOT, same_python_env
    from tests.pd_stack import PDStack

    env = same_python_env(tmp_path / "venv")
    model = ROOT / "benchmarks/configs/qwen2.5-7b-instruct"
    stack = PDStack("--model", str(model), "--load-format", "dummy", "--num-decode", "2",
                    "--prefill-gpus", "0", "--decode-gpus", "0",
                    log_path=tmp_path / "stack.log", env=env)  # fmt: skip
    try:
        for _ in range(2):  # round robin: both decode nodes
            body = json.dumps({"prompt": list(range(1000, 1100)), "max_tokens": 8}).encode()
            request = urllib.request.Request(
                stack.url + "/v1/completions", body, {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=120) as response:
                assert response.status == 200
        log = (tmp_path / "stack.log").read_text()
        assert log.count("(GPU share 0.283)") == 3, log[-3000:]
    finally:
        assert stack.stop() == []
