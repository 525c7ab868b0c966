"""The FP8 KV pool: `--kv-cache-dtype fp8` allocates float8_e4m3fn with per-layer scales (from
the checkpoint, else 1.0), holds twice the blocks of a bf16 pool in the same bytes, and `auto`
is the pool of before (no scale arguments reach the attention)."""

from __future__ import annotations

import pytest
import torch

from common.engine.config import CacheConfig, EngineConfig, ModelConfig
from common.engine.kv_cache import KVCache, block_bytes, kv_cache_dtype, num_blocks_for_budget
from common.engine.worker import Worker
from common.model.spec import ModelSpec, RopeSpec
from common.node.config import parse_node_args
from pdserve.flags import build_parser
from pdserve.launcher import node_summary
from pdserve.plan import NodeProcess, configs_from_args
from tests.fp8_kv import K_SCALES, V_SCALES, needs_fp8_attention, save_tiny_model_with_kv_scales

SPEC = ModelSpec(
    architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128,
    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
    rope=RopeSpec(theta=10000.0), max_position_embeddings=256, tie_word_embeddings=False,
    qkv_bias=False, qk_norm=False, sliding_window=None, eos_token_ids=(2,),
)  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model_with_kv_scales(tmp_path_factory.mktemp("kv-scales-qwen2"))


def engine(model_dir: str, dtype: str = "float32", **cache) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=model_dir, device="cpu", dtype=dtype),
        cache=CacheConfig(**cache),
        enforce_eager=True,
    )


def test_an_fp8_pool_holds_twice_the_blocks_of_a_bf16_pool_in_the_same_bytes():
    fp8 = kv_cache_dtype("fp8", torch.bfloat16)
    assert fp8 == torch.float8_e4m3fn and kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert 2 * block_bytes(SPEC, 16, fp8) == block_bytes(SPEC, 16, torch.bfloat16)
    budget = 1000 * block_bytes(SPEC, 16, torch.bfloat16)
    bf16_blocks = num_blocks_for_budget(SPEC, 16, torch.bfloat16, budget)
    fp8_blocks = num_blocks_for_budget(SPEC, 16, fp8, budget)
    assert (bf16_blocks, fp8_blocks) == (999, 1999)  # each less its padding block


def test_an_fp8_pool_is_float8_and_hands_its_scales_to_the_attention():
    pool = KVCache.allocate(SPEC, 8, 16, torch.float8_e4m3fn, torch.device("cpu"), K_SCALES)
    assert pool.pool.dtype == torch.float8_e4m3fn and pool.is_fp8
    assert pool.context_kwargs() == {"k_scales": K_SCALES, "v_scales": [1.0, 1.0]}
    plain = KVCache.allocate(SPEC, 8, 16, torch.bfloat16, torch.device("cpu"), K_SCALES)
    assert plain.context_kwargs() == {}  # "auto": ForwardContext gets what it always got


@pytest.mark.parametrize(
    "scales, needle",
    [([1.0], "got 1 with"), ([1.0, 0.0], "[0.0] bad"), ([1.0, float("nan")], "nan")],
)
def test_scales_that_do_not_fit_the_pool_are_a_value_error_naming_them(scales, needle):
    with pytest.raises(ValueError, match=r"k_scales must be 2 positive finite floats") as info:
        KVCache.allocate(SPEC, 4, 16, torch.float8_e4m3fn, torch.device("cpu"), scales)
    assert needle in str(info.value)


def test_the_kv_cache_dtype_flag_is_derived_for_nodes_and_both_pools():
    _, config = parse_node_args("node", ["--kv-cache-dtype", "fp8"])
    assert config.cache.kv_cache_dtype == "fp8"
    assert EngineConfig().cache.kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        parse_node_args("node", ["--kv-cache-dtype", "int4"])
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        CacheConfig(kv_cache_dtype="fp16")
    configs = configs_from_args(
        build_parser().parse_args(["serve", "--prefill-kv-cache-dtype", "fp8"])
    )
    assert configs.engines["prefill"].cache.kv_cache_dtype == "fp8"
    assert configs.engines["decode"].cache.kv_cache_dtype == "auto"


def test_an_auto_worker_keeps_its_pool_and_takes_the_checkpoint_scales(model_dir):
    worker = Worker(engine(model_dir, num_kv_blocks=16))
    kv = worker.kv_cache
    assert kv.pool.dtype == torch.float32 and kv.context_kwargs() == {}
    assert (kv.k_scales, kv.v_scales) == (K_SCALES, V_SCALES)
    fmt = worker.runtime.kv_format
    assert (fmt.kv_dtype, fmt.kv_scales, fmt.quantization) == ("float32", "none", "none")
    assert (fmt.num_layers, fmt.num_kv_heads, fmt.block_size) == (2, 2, 16)
    assert fmt.architecture == worker.spec.architecture
    assert fmt.geometry == worker.spec.kv_cache_geometry  # K and V planes of 2 heads


def test_the_launcher_summary_shows_the_kv_dtype_and_the_tokens_it_holds():
    info = {"num_kv_blocks": 8192, "block_size": 16, "max_model_len": 2048, "pid": 12,
            "device": "cuda:1", "dtype": "bfloat16",
            "kv_format": {"kv_dtype": "float8_e4m3fn"}}  # fmt: skip
    line = node_summary(NodeProcess("decode-0", "decode", "tcp://d", [], 1), {"info": info})
    assert "KV float8_e4m3fn 8192 blocks x 16 = 131072 tokens" in line
    assert "max concurrency 64.0 requests of 2048 tokens" in line


@needs_fp8_attention
def test_an_fp8_worker_allocates_float8_with_the_checkpoint_scales_and_twice_the_blocks(
    model_dir,
):
    budget = 1 << 20
    bf16 = Worker(engine(model_dir, "bfloat16", kv_cache_memory_bytes=budget))
    fp8 = Worker(engine(model_dir, "bfloat16", kv_cache_memory_bytes=budget, kv_cache_dtype="fp8"))
    assert fp8.kv_cache.pool.dtype == torch.float8_e4m3fn
    assert fp8.runtime.num_kv_blocks + 1 == 2 * (bf16.runtime.num_kv_blocks + 1)
    assert fp8.kv_cache.context_kwargs() == {"k_scales": K_SCALES, "v_scales": V_SCALES}
    assert fp8.runtime.kv_format.kv_dtype == "float8_e4m3fn"
    assert fp8.runtime.kv_format.kv_scales == "k 0.5,1.0 v 1.0,0.25"
    assert fp8.runtime.kv_format.mismatch(bf16.runtime.kv_format) is not None
