"""Expert routing in one Triton launch: the gate's logits (x @ W^T, float32 accumulation, the
weight read in its own dtype), softmax or sigmoid scores, DeepSeek's group limit and correction
bias, top-k by repeated argmax, renormalization and scaling. The rules are those of
`common.model.layers.moe_routing.select_experts`, the CPU path and this kernel's oracle; only
the pick between exactly equal scores may differ.

Work split (`RouteTiles`): a program computes the logits of `block_t` tokens for a slice of the
experts. With one slice (`splits` = 1, prefill) it keeps them in registers and selects at once.
At decode sizes one token block would leave most SMs idle reading the gate weight alone, so the
experts are split over `splits` programs that write their logits to a float32 scratch; the last
of them to finish (a per-token-block ticket, released after a CTA barrier, acquired by the
last) selects for the whole block and resets its ticket to 0. The tickets live in one buffer
per device: calls on a device must be stream-ordered, as one engine's forward passes are.

No shape depends on the routing and nothing syncs with the host: CUDA graphs capture a call.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from common.model.kernels.loads import load_k
from common.model.kernels.pdl import pdl_args, pdl_prologue
from common.model.spec import MoESpec

TICKETS = 1024  # token blocks a split launch may have (more blocks never split)
DOT_MIN_TOKENS = 5  # from here token blocks of >= 16 rows go through tl.dot
WIDE_MIN_TOKENS = 512  # from here the prefill tiles (`_wide_tiles`)
DOT_BLOCKS = 128  # token blocks a prefill launch aims for (about one per SM)
REGISTER_TILE = 4096  # float32 values per [block_t, experts] array, and per FMA accumulator


@dataclasses.dataclass(frozen=True)
class RouteTiles:
    block_t: int  # tokens per program (a power of two)
    splits: int  # programs sharing one token block's experts (a power of two)
    block_k: int  # hidden values per loop step
    num_warps: int = 4
    num_stages: int = 3  # Triton's default: the loads of that many loop steps in flight


def pick_route_tiles(tokens: int, experts: int, hidden: int, sms: int = 132) -> RouteTiles:
    """Decode (T < DOT_MIN_TOKENS): one block of all tokens, FMA logits, experts split down to
    one per program until `sms` programs run. Beyond, blocks of 16 tokens through tl.dot,
    slices of >= 16 experts, split likewise. From WIDE_MIN_TOKENS (prefill) blocks of 16 to
    64 tokens, about DOT_BLOCKS of them, each reading the gate weight once for all its
    tokens, and the experts split only while under half the SMs would have a program: on an
    H200 (Qwen3-30B-A3B's gate, 128 experts) 10.2 / 11.7 / 16.1 us at 512 / 2048 / 8192
    tokens, where the decode rule took 14.4 / 17.4 / 36.3 (DeepSeek-V2-Lite's 64 experts:
    8.3 / 9.5 / 9.5 against 9.0 / 10.6 / 17.1), the same experts picked for every row."""
    if tokens >= WIDE_MIN_TOKENS:
        return _wide_tiles(tokens, experts, hidden, sms)
    if tokens < DOT_MIN_TOKENS:
        block_t, min_slice = triton.next_power_of_2(max(tokens, 1)), 1
    else:
        block_t, min_slice = 16, 16
    e_pad = _experts_padded(experts, block_t >= 16)
    blocks = triton.cdiv(tokens, block_t)
    splits = 1
    while blocks <= TICKETS and blocks * splits < sms and e_pad // (2 * splits) >= min_slice:
        splits *= 2
    slice_ = e_pad // splits
    if min_slice == 1:
        # FMA accumulator [block_t, slice, block_k]: few, wide steps (a decode launch's time is
        # its programs' load latency, step after step).
        block_k = max(32, REGISTER_TILE // (block_t * slice_))
    else:
        block_k = 64 if block_t * slice_ <= REGISTER_TILE // 2 else 32
    block_k = min(block_k, max(16, triton.next_power_of_2(hidden)))
    warps = 8 if block_t * e_pad > REGISTER_TILE // 2 else 4
    return RouteTiles(block_t, splits, block_k, warps)


def _wide_tiles(tokens: int, experts: int, hidden: int, sms: int) -> RouteTiles:
    e_pad = _experts_padded(experts, True)
    widest = max(16, 2 * REGISTER_TILE // e_pad)  # [block_t, E] float32 logits in registers
    block_t = 16
    while block_t < min(64, widest) and tokens >= 2 * block_t * DOT_BLOCKS:
        block_t *= 2
    blocks = triton.cdiv(tokens, block_t)
    splits = 1
    while blocks <= TICKETS and blocks * splits < sms // 2 and e_pad // (2 * splits) >= 16:
        splits *= 2
    block_k = 128 if block_t * (e_pad // splits) <= REGISTER_TILE // 2 else 64
    block_k = min(block_k, max(16, triton.next_power_of_2(hidden)))
    return RouteTiles(block_t, splits, block_k, num_warps=4, num_stages=4)


def route(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    moe: MoESpec,
    correction_bias: torch.Tensor | None = None,
    tiles: RouteTiles | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` [T, H], `gate_weight` [E, H] -> (weights [T, k] float32, ids [T, k] int32), the best
    first, as `select_experts(x.float() @ gate_weight.float().T, moe, correction_bias)`."""
    tokens, hidden, experts = _check(x, gate_weight, moe, correction_bias)
    device, k = x.device, moe.top_k
    weights = torch.empty(tokens, k, dtype=torch.float32, device=device)
    ids = torch.empty(tokens, k, dtype=torch.int32, device=device)
    if tokens == 0:
        return weights, ids
    tiles = tiles or pick_route_tiles(tokens, experts, hidden, _sm_count(device))
    use_dot = tiles.block_t >= 16
    e_pad = _experts_padded(experts, use_dot)
    blocks = triton.cdiv(tokens, tiles.block_t)
    _check_tiles(tiles, e_pad, blocks)
    slice_ = e_pad // tiles.splits
    scratch = weights  # unused without a split
    if tiles.splits > 1:
        scratch = torch.empty(blocks * tiles.block_t, e_pad, dtype=torch.float32, device=device)
    x = x if x.stride(1) == 1 else x.contiguous()
    w = gate_weight if gate_weight.stride(1) == 1 else gate_weight.contiguous()
    same = x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16)
    _route_kernel[(blocks, tiles.splits)](
        x, w, correction_bias if correction_bias is not None else weights, scratch,
        _tickets(device), weights, ids,
        tokens, hidden, experts, x.stride(0), w.stride(0), experts // moe.num_groups,
        float(moe.routed_scaling),
        BLOCK_T=tiles.block_t, E_PAD=e_pad, E_SLICE=slice_, BLOCK_K=tiles.block_k,
        SPLITS=tiles.splits, USE_DOT=use_dot, CAST_F32=not same,
        EVEN_K=hidden % tiles.block_k == 0, TOP_K=k, K_PAD=triton.next_power_of_2(k),
        SIGMOID=moe.scoring == "sigmoid", RENORM=moe.renormalize,
        HAS_BIAS=correction_bias is not None, NUM_GROUPS=moe.num_groups,
        G_PAD=triton.next_power_of_2(moe.num_groups), TOPK_GROUPS=moe.topk_groups,
        TOP2_SUM=moe.group_score == "top2_sum", num_warps=tiles.num_warps,
        num_stages=tiles.num_stages, **pdl_args(device),
    )  # fmt: skip
    return weights, ids


@triton.jit
def _logits(x_ptr, w_ptr, tokens, experts, T, H, E, stride_x, stride_w,
            BLOCK_T: tl.constexpr, E_SLICE: tl.constexpr, BLOCK_K: tl.constexpr,
            USE_DOT: tl.constexpr, CAST_F32: tl.constexpr, EVEN_K: tl.constexpr):  # fmt: skip
    """[BLOCK_T, E_SLICE] float32 logits. Rows past T read token 0 and experts past E read
    expert 0 (unmasked hot loads); the caller ignores both."""
    x_rows = x_ptr + tl.where(tokens < T, tokens, 0).to(tl.int64)[:, None] * stride_x
    w_rows = w_ptr + tl.where(experts < E, experts, 0).to(tl.int64)[:, None] * stride_w
    rk = tl.arange(0, BLOCK_K)
    if USE_DOT:
        acc = tl.zeros((BLOCK_T, E_SLICE), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            a = load_k(x_rows, k0 + rk, H, EVEN_K)
            b = load_k(w_rows, k0 + rk, H, EVEN_K)
            if CAST_F32:
                a, b = a.to(tl.float32), b.to(tl.float32)
            # bf16 x bf16 products are exact in float32: only the summation order differs
            # from a float32 matmul.
            acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee" if CAST_F32 else "tf32")
        return acc
    acc3 = tl.zeros((BLOCK_T, E_SLICE, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        a = load_k(x_rows, k0 + rk, H, EVEN_K).to(tl.float32)
        b = load_k(w_rows, k0 + rk, H, EVEN_K).to(tl.float32)
        acc3 += a[:, None, :] * b[None, :, :]
    return tl.sum(acc3, axis=2)


@triton.jit
def _argmax(values, index):
    """Per row: the best value, its index (the lowest of equal ones) and its one-hot mask."""
    best, pick = tl.max(values, axis=1, return_indices=True, return_indices_tie_break_left=True)
    return best, pick, index[None, :] == pick[:, None]


@triton.jit
def _mask_groups(choice, experts, group_size, NUM_GROUPS: tl.constexpr, G_PAD: tl.constexpr,
                 TOPK_GROUPS: tl.constexpr, TOP2_SUM: tl.constexpr):  # fmt: skip
    """`choice` with the experts outside each row's TOPK_GROUPS best groups at -inf; a group
    scores its best choice, or the sum of its best two."""
    group_of = experts // group_size
    groups = tl.arange(0, G_PAD)
    score = tl.full((choice.shape[0], G_PAD), float("-inf"), tl.float32)
    for g in tl.static_range(NUM_GROUPS):
        mine = tl.where(group_of[None, :] == g, choice, float("-inf"))
        best = tl.max(mine, axis=1)
        if TOP2_SUM:
            _, _, first = _argmax(mine, experts)
            best += tl.max(tl.where(first, float("-inf"), mine), axis=1)
        score = tl.where(groups[None, :] == g, best[:, None], score)
    kept = tl.zeros((choice.shape[0], G_PAD), dtype=tl.int32)
    for _ in tl.static_range(TOPK_GROUPS):
        _, _, hit = _argmax(score, groups)
        kept = tl.where(hit, 1, kept)
        score = tl.where(hit, float("-inf"), score)
    keep = tl.zeros(choice.shape, dtype=tl.int32)
    for g in tl.static_range(NUM_GROUPS):
        group_kept = tl.max(tl.where(groups[None, :] == g, kept, 0), axis=1)
        keep = tl.where(group_of[None, :] == g, group_kept[:, None], keep)
    return tl.where(keep != 0, choice, float("-inf"))


@triton.jit
def _select(logits, tokens, bias_ptr, weights_ptr, ids_ptr, T, E, group_size, scaling,
            E_PAD: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
            SIGMOID: tl.constexpr, RENORM: tl.constexpr, HAS_BIAS: tl.constexpr,
            NUM_GROUPS: tl.constexpr, G_PAD: tl.constexpr, TOPK_GROUPS: tl.constexpr,
            TOP2_SUM: tl.constexpr):  # fmt: skip
    """From [rows, E_PAD] logits, each row's TOP_K (weight, id), best first, stored for the
    rows below T."""
    experts = tl.arange(0, E_PAD)
    valid = experts[None, :] < E
    if SIGMOID:
        scores = tl.sigmoid(logits)
    else:
        shifted = tl.where(valid, logits, float("-inf"))
        e = tl.exp(shifted - tl.max(shifted, axis=1)[:, None])
        scores = e / tl.sum(e, axis=1)[:, None]
    choice = scores
    if HAS_BIAS:
        bias = tl.load(bias_ptr + experts, mask=experts < E, other=0.0).to(tl.float32)
        choice = scores + bias[None, :]
    choice = tl.where(valid, choice, float("-inf"))
    if NUM_GROUPS > 1:
        choice = _mask_groups(choice, experts, group_size, NUM_GROUPS, G_PAD, TOPK_GROUPS,
                              TOP2_SUM)  # fmt: skip
    cols = tl.arange(0, K_PAD)
    picked = tl.zeros((logits.shape[0], K_PAD), dtype=tl.int32)
    weight = tl.zeros((logits.shape[0], K_PAD), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best, pick, hit = _argmax(choice, experts)
        if HAS_BIAS:
            w = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        else:
            w = best  # the choice is the score itself
        picked = tl.where(cols[None, :] == j, pick[:, None], picked)
        weight = tl.where(cols[None, :] == j, w[:, None], weight)
        choice = tl.where(hit, float("-inf"), choice)
    if RENORM:
        weight = weight / (tl.sum(weight, axis=1)[:, None] + 1e-20)
    weight = weight * scaling
    at = tokens.to(tl.int64)[:, None] * TOP_K + cols[None, :]
    mask = (tokens[:, None] < T) & (cols[None, :] < TOP_K)
    tl.store(weights_ptr + at, weight, mask=mask)
    tl.store(ids_ptr + at, picked, mask=mask)


@triton.jit
def _route_kernel(
    x_ptr, w_ptr, bias_ptr, scratch_ptr, tickets_ptr, weights_ptr, ids_ptr,
    T, H, E, stride_x, stride_w, group_size, scaling,
    BLOCK_T: tl.constexpr, E_PAD: tl.constexpr, E_SLICE: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLITS: tl.constexpr, USE_DOT: tl.constexpr, CAST_F32: tl.constexpr, EVEN_K: tl.constexpr,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, SIGMOID: tl.constexpr, RENORM: tl.constexpr,
    HAS_BIAS: tl.constexpr, NUM_GROUPS: tl.constexpr, G_PAD: tl.constexpr,
    TOPK_GROUPS: tl.constexpr, TOP2_SUM: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Program (token block b, slice s): the logits of b's tokens for experts
    [s * E_SLICE, (s + 1) * E_SLICE); the block's selection by the program that completes it."""
    pdl_prologue(PDL)
    block = tl.program_id(0)
    tokens = block * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.program_id(1) * E_SLICE + tl.arange(0, E_SLICE)
    logits = _logits(x_ptr, w_ptr, tokens, experts, T, H, E, stride_x, stride_w,
                     BLOCK_T, E_SLICE, BLOCK_K, USE_DOT, CAST_F32, EVEN_K)  # fmt: skip
    if SPLITS == 1:
        _select(logits, tokens, bias_ptr, weights_ptr, ids_ptr, T, E, group_size, scaling,
                E_PAD, TOP_K, K_PAD, SIGMOID, RENORM, HAS_BIAS, NUM_GROUPS, G_PAD,
                TOPK_GROUPS, TOP2_SUM)  # fmt: skip
    else:
        rows = scratch_ptr + tokens.to(tl.int64)[:, None] * E_PAD
        tl.store(rows + experts[None, :], logits)
        tl.debug_barrier()  # every thread's stores precede the release below
        ticket = tl.atomic_add(tickets_ptr + block, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLITS - 1:
            # L2, not L1: the other slices were written by other SMs.
            full = tl.load(rows + tl.arange(0, E_PAD)[None, :], cache_modifier=".cg")
            _select(full, tokens, bias_ptr, weights_ptr, ids_ptr, T, E, group_size, scaling,
                    E_PAD, TOP_K, K_PAD, SIGMOID, RENORM, HAS_BIAS, NUM_GROUPS, G_PAD,
                    TOPK_GROUPS, TOP2_SUM)  # fmt: skip
            tl.store(tickets_ptr + block, 0)  # every slice has taken its ticket


def _experts_padded(experts: int, dot: bool) -> int:
    """A power of two, and >= 16 for tl.dot."""
    return max(16 if dot else 1, triton.next_power_of_2(experts))


def _check_tiles(tiles: RouteTiles, e_pad: int, blocks: int) -> None:
    def power_of_two(n: int) -> bool:
        return n >= 1 and n & (n - 1) == 0

    slice_ = e_pad // tiles.splits if tiles.splits >= 1 else 0
    if not (power_of_two(tiles.block_t) and power_of_two(tiles.splits) and slice_ >= 1) or (
        tiles.block_t >= 16 and slice_ < 16
    ):
        raise ValueError(
            f"{tiles} must split {e_pad} padded experts in powers of two (>= 16 per program "
            "with block_t >= 16)"
        )
    if tiles.splits > 1 and blocks > TICKETS:
        raise ValueError(f"{blocks} token blocks exceed the {TICKETS} tickets of a split launch")


def _check(x, gate_weight, moe: MoESpec, bias) -> tuple[int, int, int]:
    """(T, H, E), else a ValueError naming the shapes."""
    if x.dim() != 2 or gate_weight.dim() != 2 or x.shape[1] != gate_weight.shape[1]:
        raise ValueError(
            f"want x [T, H] and gate_weight [E, H], got {tuple(x.shape)}, {tuple(gate_weight.shape)}"
        )
    experts = gate_weight.shape[0]
    if experts != moe.num_experts:
        raise ValueError(f"gate_weight has {experts} experts, the MoESpec {moe.num_experts}")
    if bias is not None and tuple(bias.shape) != (experts,):
        raise ValueError(f"correction_bias must be [{experts}], got {tuple(bias.shape)}")
    tensors = [x, gate_weight] + ([bias] if bias is not None else [])
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"operands on several devices: {sorted(map(str, devices))}")
    if not all(t.is_floating_point() for t in tensors):
        raise ValueError(f"route takes float tensors, got {[t.dtype for t in tensors]}")
    return x.shape[0], x.shape[1], experts


@functools.cache
def _tickets(device: torch.device) -> torch.Tensor:
    """The split launches' per-token-block tickets on `device`; every launch leaves them 0."""
    return torch.zeros(TICKETS, dtype=torch.int32, device=device)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # an H200's, so CPU runs pick the tiles the GPU picks
    return torch.cuda.get_device_properties(device).multi_processor_count
