"""Programmatic dependent launch (`common/model/kernels/pdl.py`): when it is on (CUDA graph
captures on Hopper only), and, on a Hopper GPU, that a chain of the decode step's kernels
replayed from a CUDA graph with PDL gives the same bits as without it (each kernel waits for the
one before it before reading)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported

import pytest  # noqa: E402

pytest.importorskip("triton")

from common.model.graph_capture import recording_graphs  # noqa: E402
from common.model.kernels import pdl  # noqa: E402

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def test_off_on_cpu_and_when_switched_off(monkeypatch):
    with recording_graphs():
        assert pdl.pdl_args(torch.device("cpu")) == {}
        assert not pdl.pdl_enabled(torch.device("cpu"))
        monkeypatch.setenv("PDSERVE_PDL", "0")
        assert not pdl.pdl_enabled(torch.device("cuda", 0))
        assert pdl.pdl_args(torch.device("cuda", 0)) == {}


def test_recording_graphs_nests_and_ends():
    from common.model import graph_capture

    assert not graph_capture.recording()
    with recording_graphs():
        with recording_graphs():
            assert graph_capture.recording()
        assert graph_capture.recording()
    assert not graph_capture.recording()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU answer")
def test_off_without_cuda():
    with recording_graphs():
        assert not pdl.pdl_enabled(torch.device("cuda", 0))


def _chain(layers, h, quant):
    """RMSNorm -> FP8, a split-K GEMM (its epilogue), the o_proj quantization, a GEMM,
    SiLU-and-mul -> FP8 and a GEMM, per layer, each reading what the one before wrote."""
    from common.model.kernels import fp8_gemm_kernels as gemm
    from common.model.kernels import fp8_quant

    res = h
    for w in layers:
        xq, res = fp8_quant.rms_norm_fp8(h, w["ln"], 1e-6, res, quant)
        qkv = gemm.w8a8_channel_mm(xq.data, xq.scale, *w["a"], torch.bfloat16)
        aq = fp8_quant.quantize_fp8(qkv[:, : h.shape[1]], quant)
        gu = gemm.w8a8_channel_mm(aq.data, aq.scale, *w["gu"], torch.bfloat16)
        hq = fp8_quant.silu_and_mul_fp8(gu, quant)
        h = gemm.w8a8_channel_mm(hq.data, hq.scale, *w["down"], torch.bfloat16)
    return h


@pytest.mark.skipif(not HOPPER, reason="PDL needs a Hopper (sm90+) GPU")
@pytest.mark.parametrize("m", [1, 8])
def test_graph_with_pdl_equals_without(monkeypatch, m):
    from common.model.quantization.activation import ActivationQuant

    torch.manual_seed(0)
    dev, hidden, inter = torch.device("cuda"), 1024, 2816

    def weight(n, k):
        w = (torch.randn(n, k, device=dev) * 0.5).to(torch.float8_e4m3fn)
        return w, torch.rand(n, device=dev) * 1e-2 + 1e-3

    layers = [
        {"ln": torch.rand(hidden, device=dev, dtype=torch.bfloat16),
         "a": weight(hidden + 256, hidden), "gu": weight(2 * inter, hidden),
         "down": weight(hidden, inter)}
        for _ in range(6)
    ]  # fmt: skip
    quant = ActivationQuant("token")
    h0 = torch.randn(m, hidden, device=dev, dtype=torch.bfloat16)
    outs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("PDSERVE_PDL", flag)
        assert not pdl.pdl_enabled(dev)  # never outside a graph capture
        graph = torch.cuda.CUDAGraph()
        with recording_graphs():
            assert pdl.pdl_enabled(dev) == (flag == "1")
            _chain(layers, h0, quant)  # the warm-up: compiles what the capture launches
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                out = _chain(layers, h0, quant)
        replays = []
        for _ in range(20):
            graph.replay()
            replays.append(out.clone())
        torch.cuda.synchronize()
        outs[flag] = replays
    assert all(torch.equal(r, outs["0"][0]) for r in outs["0"] + outs["1"])
