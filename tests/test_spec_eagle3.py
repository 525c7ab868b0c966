"""EAGLE-3 on CPU: a tiny random head written by the test in the published layout loads; its
paged forward (a prompt, then single rows) matches a plain torch implementation of the same
math written here; the target's aux hidden states are HF's hidden states at those layers; and
the proposer drafts what a full-recompute rollout of the reference drafts, in target ids
through d2t, across a verify step."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from common.engine.config import SpeculativeConfig
from common.engine.kv_cache import KVCache
from common.engine.scheduler import ScheduledBatch, ScheduledSeq
from common.engine.sequence import Sequence
from common.engine.spec_decode.eagle3 import Eagle3Proposer
from common.engine.spec_decode.paged import PagedRows, ProposerPool
from common.model.attention import create_backend
from common.model.eagle3 import load_eagle3_head
from common.model.loader import build_model
from common.model.source import read_spec, resolve_model
from common.model.spec import ModelSpec, RopeSpec
from common.protocol.sampling_params import SamplingParams

H, HEADS, KV_HEADS, INTER = 64, 4, 2, 128
VOCAB, DRAFT_VOCAB, TARGET_LAYERS = 384, 32, 8
EPS, THETA = 1e-5, 10000.0
BLOCK, K = 16, 4
CPU = torch.device("cpu")
TOL = dict(atol=2e-5, rtol=1e-4)  # float32, different op order (paged vs dense attention)


def head_tensors(seed: int, embed: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d = H // HEADS

    def w(*shape, std=0.1):
        return torch.randn(*shape, generator=g) * std

    def norm():
        return 1.0 + w(H, std=0.1)

    t = {
        "fc.weight": w(H, 3 * H, std=0.05),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": w(HEADS * d, 2 * H),
        "midlayer.self_attn.k_proj.weight": w(KV_HEADS * d, 2 * H),
        "midlayer.self_attn.v_proj.weight": w(KV_HEADS * d, 2 * H),
        "midlayer.self_attn.o_proj.weight": w(H, HEADS * d),
        "midlayer.mlp.gate_proj.weight": w(INTER, H),
        "midlayer.mlp.up_proj.weight": w(INTER, H),
        "midlayer.mlp.down_proj.weight": w(H, INTER),
        "norm.weight": norm(),
        "lm_head.weight": w(DRAFT_VOCAB, H, std=0.5),
        # draft id j is target id 2j + 5: odd ids from 5 on
        "d2t": torch.arange(DRAFT_VOCAB) + 5,
        "t2d": torch.zeros(VOCAB, dtype=torch.bool),
    }
    if embed:
        t["embed_tokens.weight"] = w(VOCAB, H, std=0.5)
    return t


def write_head(folder, seed: int = 0, embed: bool = False, **config) -> dict[str, torch.Tensor]:
    folder.mkdir(parents=True, exist_ok=True)
    tensors = head_tensors(seed, embed)
    save_file(tensors, str(folder / "model.safetensors"))
    raw = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": INTER,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": 1,
        "rms_norm_eps": EPS,
        "rope_theta": THETA,
        "max_position_embeddings": 2048,
        "vocab_size": VOCAB,
        "draft_vocab_size": DRAFT_VOCAB,
        "tie_word_embeddings": False,
        **config,
    }
    (folder / "config.json").write_text(json.dumps(raw))
    return tensors


# -- the reference: the head's math on dense tensors, every row recomputed -------------------
def rms(x, weight):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def rope(x, positions):
    d = x.shape[-1]
    inv = 1.0 / THETA ** (torch.arange(0, d, 2).float() / d)
    angles = positions[:, None].float() * inv[None]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def reference(t, embedding, ids, hidden):
    """(normed, prenorm, logits) of rows at positions 0..T-1, causal over all of them."""
    T, d = len(ids), H // HEADS
    x = torch.cat(
        [rms(embedding[ids], t["midlayer.input_layernorm.weight"]),
         rms(hidden, t["midlayer.hidden_norm.weight"])],
        dim=-1,
    )  # fmt: skip
    p = "midlayer.self_attn."
    q = (x @ t[p + "q_proj.weight"].T).view(T, HEADS, d)
    k = (x @ t[p + "k_proj.weight"].T).view(T, KV_HEADS, d)
    v = (x @ t[p + "v_proj.weight"].T).view(T, KV_HEADS, d)
    positions = torch.arange(T)
    q, k = rope(q, positions), rope(k, positions)
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) * d**-0.5
    scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
    attn = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(T, H)
    a = attn @ t[p + "o_proj.weight"].T + hidden
    m = rms(a, t["midlayer.post_attention_layernorm.weight"])
    mlp = F.silu(m @ t["midlayer.mlp.gate_proj.weight"].T) * (
        m @ t["midlayer.mlp.up_proj.weight"].T
    )
    prenorm = mlp @ t["midlayer.mlp.down_proj.weight"].T + a
    normed = rms(prenorm, t["norm.weight"])
    return normed, prenorm, normed @ t["lm_head.weight"].T


def reference_drafts(t, embedding, tokens, aux, k):
    """Drafts after `tokens` from aux hidden states of positions 0..len(tokens)-2."""
    hidden = list(aux @ t["fc.weight"].T)
    ids = list(tokens[1:])
    drafts = []
    for _ in range(k):
        _, prenorm, logits = reference(t, embedding, torch.tensor(ids), torch.stack(hidden))
        j = int(logits[-1].argmax())
        drafts.append(j + int(t["d2t"][j]))
        hidden.append(prenorm[-1])
        ids.append(drafts[-1])
    return drafts


# -- fixtures -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=H,
        intermediate_size=INTER,
        num_hidden_layers=TARGET_LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=512,
        initializer_range=0.25,
        rms_norm_eps=EPS,
    )
    folder = tmp_path_factory.mktemp("target")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


def load_target(target_dir):
    source = resolve_model(str(target_dir))
    spec = read_spec(source)
    model = build_model(spec, source, max_positions=512, dtype=torch.float32, device=CPU)
    kv = KVCache.allocate(spec, 32, BLOCK, torch.float32, CPU)
    return model, ProposerPool(kv, create_backend("torch"), CPU, spec.attention_scale)


def run_target(model, pool, tokens, start, blocks) -> torch.Tensor:
    """The target's aux hidden states of `tokens` at positions start.. (its KV in `pool`)."""
    rows = PagedRows(BLOCK)
    rows.add(tokens, start, blocks)
    with torch.inference_mode():
        model(*pool.inputs(rows))
    return model.model.aux_hidden.clone()


def decode_batch(seq: Sequence) -> ScheduledBatch:
    seq.num_computed_tokens = seq.num_tokens - 1
    return ScheduledBatch([ScheduledSeq(seq, seq.num_computed_tokens, 1)])


def prompt_of(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=g).tolist()


# -- tests --------------------------------------------------------------------------------
def target_spec() -> ModelSpec:
    """A target the head fits (vocabulary and width of the tiny Llama)."""
    return ModelSpec(
        "LlamaForCausalLM", VOCAB, H, INTER, TARGET_LAYERS, HEADS, KV_HEADS, H // HEADS, EPS,
        RopeSpec(THETA), 512, False, False, False, None, (2,),
    )  # fmt: skip


def load_head(folder, embedding=None):
    return load_eagle3_head(
        folder, target_spec(), embedding, max_positions=64, dtype=torch.float32, device=CPU
    )


@pytest.mark.parametrize("own_embedding", [True, False])
def test_head_forward_matches_the_reference_for_a_prompt_then_single_rows(tmp_path, own_embedding):
    t = write_head(tmp_path, embed=own_embedding)
    g = torch.Generator().manual_seed(1)
    embedding = t.get("embed_tokens.weight", torch.randn(VOCAB, H, generator=g))
    head = load_head(tmp_path, None if own_embedding else lambda ids: F.embedding(ids, embedding))
    assert hasattr(head, "embed_tokens") == own_embedding
    kv = KVCache.allocate(head.spec.layer, 8, BLOCK, torch.float32, CPU)
    pool = ProposerPool(kv, create_backend("torch"), CPU, head.spec.layer.attention_scale)
    ids = torch.randint(0, VOCAB, (20,), generator=g)
    hidden = torch.randn(20, H, generator=g)
    want = reference(t, embedding, ids, hidden)
    got = []
    with torch.inference_mode():
        for start, end in ((0, 17), (17, 18), (18, 19), (19, 20)):  # a prompt, then decode rows
            rows = PagedRows(BLOCK)
            rows.add(ids[start:end].tolist(), start, [3, 1])  # blocks out of order
            input_ids, positions, ctx = pool.inputs(rows)
            normed, prenorm = head(input_ids, positions, hidden[start:end], ctx)
            got.append((normed, prenorm, head.compute_logits(normed)))
    for k in range(3):
        torch.testing.assert_close(torch.cat([step[k] for step in got]), want[k], **TOL)
    draft_ids = torch.tensor([0, 7, DRAFT_VOCAB - 1])
    assert head.to_target(draft_ids).tolist() == [5, 19, 2 * DRAFT_VOCAB + 3]


def test_head_without_a_tensor_or_for_another_target_is_refused(tmp_path):
    write_head(tmp_path / "big", vocab_size=VOCAB + 1)
    with pytest.raises(ValueError, match=f"vocab_size {VOCAB + 1}, the target {VOCAB}"):
        load_head(tmp_path / "big", lambda ids: ids)
    t = write_head(tmp_path / "partial")
    del t["midlayer.hidden_norm.weight"]
    save_file(t, str(tmp_path / "partial" / "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensors.*midlayer.hidden_norm.weight"):
        load_head(tmp_path / "partial", lambda ids: ids)


def test_aux_hidden_states_are_hf_hidden_states_at_those_layers(target_dir):
    model, pool = load_target(target_dir)
    model.model.aux_hidden_layers = (2, 4, 5)
    tokens = prompt_of(11, seed=3)
    aux = run_target(model, pool, tokens, 0, [0])
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        states = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    want = torch.cat([states[i][0] for i in (2, 4, 5)], dim=-1)  # [i]: layer i's input
    torch.testing.assert_close(aux, want, atol=1e-4, rtol=1e-4)


def test_proposer_drafts_the_reference_rollout_across_a_verify_step(target_dir, tmp_path):
    t = write_head(tmp_path / "head")
    target, target_pool = load_target(target_dir)
    proposer = Eagle3Proposer.build(
        SpeculativeConfig("eagle3", K, str(tmp_path / "head")),
        target,
        num_blocks=32,
        block_size=BLOCK,
        max_model_len=256,
        device=CPU,
        dtype=torch.float32,
        backend=create_backend("torch"),
    )
    assert target.model.aux_hidden_layers == (2, TARGET_LAYERS // 2, TARGET_LAYERS - 3)
    embedding = target.model.embed_tokens.weight.detach()
    blocks = [5, 2, 9]
    prompt = prompt_of(19, seed=4)
    seq = Sequence("a", prompt, SamplingParams(temperature=0))
    seq.block_ids = blocks
    # Prefill: the target computes the prompt and samples a token (any id serves the head).
    proposer.observe(["a"], [0], [len(prompt)], run_target(target, target_pool, prompt, 0, blocks))
    seq.output_token_ids = [7]
    drafts = proposer.propose(decode_batch(seq), [K]).token_ids[0]
    full = run_target(target, target_pool, seq.all_token_ids, 0, blocks)
    assert drafts == reference_drafts(t, embedding, seq.all_token_ids, full[:-1], K)
    assert all(d % 2 == 1 and 5 <= d < 2 * DRAFT_VOCAB + 5 for d in drafts)
    # Verify: the target runs the last token and the K drafts; two are kept, then a token of
    # its own. The rows after the kept ones were computed from rejected drafts.
    n = seq.num_tokens
    verify = run_target(target, target_pool, [seq.all_token_ids[-1], *drafts], n - 1, blocks)
    proposer.observe(["b", "a"], [0, n - 1], [0, K + 1], verify)
    seq.output_token_ids += [*drafts[:2], 11]
    drafts = proposer.propose(decode_batch(seq), [K - 1]).token_ids[0]
    full = run_target(target, target_pool, seq.all_token_ids, 0, blocks)
    assert drafts == reference_drafts(t, embedding, seq.all_token_ids, full[:-1], K - 1)
    assert proposer.num_unobserved_rows == 0


def test_unobserved_prompt_still_drafts_and_is_counted(target_dir, tmp_path):
    write_head(tmp_path / "head")
    target, target_pool = load_target(target_dir)
    proposer = Eagle3Proposer.build(
        SpeculativeConfig("eagle3", K, str(tmp_path / "head")),
        target,
        num_blocks=32,
        block_size=BLOCK,
        max_model_len=256,
        device=CPU,
        dtype=torch.float32,
        backend=create_backend("torch"),
    )
    seq = Sequence("a", prompt_of(30, seed=5), SamplingParams(temperature=0))
    seq.block_ids, seq.output_token_ids = [0, 1, 2], [9]
    # As on a decode node: the prompt's KV came from elsewhere, only its last row is observed.
    aux = run_target(target, target_pool, seq.prompt_token_ids, 0, seq.block_ids)
    proposer.observe(["a"], [29], [1], aux[29:])
    drafts = proposer.propose(decode_batch(seq), [K]).token_ids[0]
    assert len(drafts) == K and all(5 <= d < VOCAB for d in drafts)
    assert proposer.num_unobserved_rows == 29
