"""Where a graphed prefill step's wall time goes before the GPU runs ahead of the host.

One prompt of `--prefill-lengths[0]` tokens through the prefill graphs, the step written out
as `ModelRunner.launch` and `PrefillGraphs.launch` run it, with host marks (perf_counter) and a
CUDA event at each point: where the event's time is close to the host's, the GPU was waiting
for the host. Prints the median step time of `runner.execute` and of this copy, plain, with
the host lists and metadata built beforehand (cached), and with the metadata built after piece
0 is launched; then each point's host and GPU times, and the launch times of the first layers'
eager calls. It reads private attributes of the runner and the graphs, and mirrors their code:
keep it in step with them. CUDA only (on CPU nothing is captured).

    python benchmarks/prefill_step_marks.py --model benchmarks/configs/qwen3-30b-a3b \
        --prefill-lengths 2048
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_engine import engine_options, parse_args  # noqa: E402
from common import LLM, SamplingParams  # noqa: E402
from common.engine.cuda_graphs import Replay  # noqa: E402
from common.engine.prompt_logprobs import prompt_rows  # noqa: E402
from common.engine.scheduler import ScheduledBatch, ScheduledSeq  # noqa: E402
from common.engine.sequence import Sequence  # noqa: E402
from common.engine.step_handle import StepHandle  # noqa: E402

args = parse_args(sys.argv[1:])
if not torch.cuda.is_available():
    sys.exit("prefill_step_marks.py needs CUDA: on CPU no prefill graphs are captured")
llm = LLM(**engine_options(args))
worker = llm.engine.worker
runner = worker.runner
pg = runner.prefill_graphs
cuda = worker.device.type == "cuda"
n = args.prefill_lengths[0]
spec = worker.spec
seq = Sequence("s", torch.randint(0, spec.vocab_size, (n,)).tolist(), SamplingParams(temperature=0))
seq.block_ids = worker.allocator.allocate(-(-(n + 1) // worker.config.cache.block_size))
batch = ScheduledBatch([ScheduledSeq(seq, 0, n)])


def sync():
    if cuda:
        torch.cuda.synchronize()


def ev():
    if not cuda:
        return None
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


def step(cached=None, early=False, marks=None):
    marks = [] if marks is None else marks

    def mark(name):
        marks.append((name, time.perf_counter(), ev()))

    mark("start")
    if cached is None:
        h = runner.host_inputs(batch)
        h.prompt_rows = prompt_rows(batch)
        mark("host_inputs")
    else:
        h, md = cached
    handle = StepHandle(batch, h.sample_rows)
    if cached is None and not early:
        md = runner.metadata(h)
        mark("metadata")
    m = len(h.input_ids)
    bucket = pg.bucket(m)
    slot, gen = pg.staging.acquire()
    rows = slot.vectors[:2].numpy()
    rows[0, :m], rows[1, :m], rows[:, m:bucket] = h.input_ids, h.positions, 0
    pg._vectors[:, :bucket].copy_(slot.vectors[:2, :bucket], non_blocking=True)
    mark("staged")
    pieces = pg.pieces[bucket]
    pieces[0].replay()
    mark("piece0")
    if cached is None and early:
        md = runner.metadata(h)
        mark("metadata")
    ctx = pg._context(md, None)
    for i, (layer, piece) in enumerate(zip(pg.model.stage.layers, pieces[1:], strict=True)):
        pg.attend(layer, m, ctx)
        if i < 3:
            mark(f"attend{i}")
        piece.replay()
        if i < 3:
            mark(f"piece{i + 1}")
    mark("all pieces")
    replay = Replay(pg.hidden[:m], slot, gen)
    logits = runner._logits(h, replay.output)
    runner._sample(handle, batch, logits)
    handle.replay = replay
    mark("sampled")
    handle.result()
    mark("result")
    return h, md


PROBES = []


def probe(owner, name):
    fn = getattr(owner, name)

    def wrapped(*a, **k):
        t = time.perf_counter()
        r = fn(*a, **k)
        PROBES.append((name, t, time.perf_counter()))
        return r

    setattr(owner, name, wrapped)


def report(label, marks):
    t0, e0 = marks[0][1], marks[0][2]
    print(f"-- {label}")
    for name, t, e in marks:
        g = e0.elapsed_time(e) if cuda else float("nan")
        print(f"  {name:12s} host {1e3 * (t - t0):8.3f} ms   gpu {g:8.3f} ms")


def timed(fn, reps=9):
    out = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return 1e3 * statistics.median(out)


with torch.inference_mode():
    for _ in range(3):
        cached = step()
    sync()
    print(f"runner.execute median {timed(lambda: runner.execute(batch)):.3f} ms")
    print(f"study step median {timed(step):.3f} ms")
    print(f"study step, host inputs and metadata cached {timed(lambda: step(cached)):.3f} ms")
    print(f"study step, metadata after piece 0 {timed(lambda: step(early=True)):.3f} ms")
    t = time.perf_counter()
    for _ in range(20):
        h = runner.host_inputs(batch)
    t1 = time.perf_counter()
    for _ in range(20):
        runner.metadata(h)
    t2 = time.perf_counter()
    print(f"host_inputs {1e3 * (t1 - t) / 20:.3f} ms, metadata {1e3 * (t2 - t1) / 20:.3f} ms")
    import common.engine.device_copy as dc
    import common.engine.model_runner as mr
    import common.model.attention.triton_backend as tb

    probe(tb, "fresh_prefill")
    probe(tb, "takes_fresh_path")
    probe(runner.backend, "write_kv")
    probe(pg, "_context")
    probe(mr, "to_device")
    probe(dc, "to_device_from")
    marks = []
    PROBES.clear()
    sync()
    step(marks=marks)
    sync()
    t0 = marks[0][1]
    for name, a, b in PROBES[:20]:
        print(f"  probe {name:18s} at {1e3 * (a - t0):7.3f} took {1e3 * (b - a):7.3f} ms")
    for label, kw in (("plain", {}), ("cached", {"cached": cached}), ("early", {"early": True})):
        for _ in range(2):
            marks = []
            sync()
            step(marks=marks, **kw)
            sync()
        report(label, marks)
