"""Tensor-parallel nodes on cuda_ipc's direct path: real processes (`scripts/launch_pd.sh`), the
tiny random Qwen2 of tests/test_tp_e2e.py (2 KV heads), two GPUs (one per rank, so it skips
with fewer). For P TP2 -> D TP1, P TP1 -> D TP2 and P TP2 -> D TP2 every sending prefill rank
writes its KV heads straight into the pools of the decode ranks holding them (each rank logs
its direct route; none falls back to frames), the greedy text equals that of the same layout
over zmq (the same KV bytes reach the same decode ranks, so the same tokens), and every block
is free afterwards on both nodes. The same layouts on CPU (frames): tests/test_tp_e2e.py.

Run: `python -m pytest tests/test_tp_cuda_ipc_gpu.py -v -rs` (about a minute per layout).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_tp_e2e import LAUNCH, PROMPTS, completion_text  # tests/ is on sys.path

from tests.pd_stack import PDStack
from tests.tiny_models import save_tiny_tool_model

pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (one per tensor-parallel rank)"
)

# Layout -> (flags, sending prefill ranks). Ranks share GPUs across the two nodes, so that each
# pairing has a rank writing into another GPU's pool and, but for P TP2 -> D TP2, one into its
# own GPU's.
LAYOUTS = {
    "P_tp2-D_tp1": (("--prefill-tp", "2", "--decode-tp", "1", "--prefill-gpus", "0,1",
                     "--decode-gpus", "1"), 2),
    "P_tp1-D_tp2": (("--prefill-tp", "1", "--decode-tp", "2", "--prefill-gpus", "0",
                     "--decode-gpus", "0,1"), 1),
    "P_tp2-D_tp2": (("--prefill-tp", "2", "--decode-tp", "2", "--prefill-gpus", "0,1",
                     "--decode-gpus", "0,1"), 2),
}  # fmt: skip
DIRECT = "is written straight into its pool"  # CudaIpcSender's log line, one per sending rank
FALLBACK = "goes as frames through host memory"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_tool_model(tmp_path_factory.mktemp("tp_cuda_ipc") / "model")


def serve(model_dir: Path, flags: tuple[str, ...], log: Path) -> list[str]:
    """The greedy texts of PROMPTS from a stack of `flags`, which must end with every block of
    both nodes free."""
    stack = PDStack("--model", str(model_dir), *flags, *LAUNCH, log_path=log)
    try:
        texts = [completion_text(stack.url, prompt) for prompt in PROMPTS]
        nodes = stack.get("/health")[1]["nodes"]
        assert all(n["load"].get("kv_transfer_failures", 0) == 0 for n in nodes)
        stack.wait_for(
            lambda: all(n["load"]["used_blocks"] == 0 for n in stack.get("/health")[1]["nodes"]),
            "every node's blocks freed",
        )
    finally:
        assert stack.stop() == [], "processes left after Ctrl-C"
    return texts


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_direct_writes_between_tp_sizes_give_the_text_of_zmq(layout, model_dir, tmp_path):
    flags, senders = LAYOUTS[layout]
    zmq_text = serve(model_dir, (*flags, "--transport", "zmq"), tmp_path / "zmq.log")
    ipc_log = tmp_path / "cuda_ipc.log"
    ipc_text = serve(model_dir, (*flags, "--transport", "cuda_ipc"), ipc_log)
    log = ipc_log.read_text()
    assert log.count(DIRECT) == senders and FALLBACK not in log, log[-4000:]
    assert ipc_text == zmq_text
