"""FP8 checkpoints as published, written from a tiny random HF model, and the dequantized
reference: HF transformers in float32 on the dequantized weights, each decoder linear layer's
input fake-quantized the way the format says (written here, independently of
`common.model.quantization`).

Formats (tensor names and dtypes as the checkpoints on the Hub hold them; where the dtype of
compressed-tensors scales varies between llm-compressor versions we write bfloat16, the
model dtype, which is what its recent versions save):

- hf_block: `weight` F8_E4M3, `weight_scale_inv` F32 [ceil(N/128), ceil(K/128)]
- hf_tensor_static: `weight` F8_E4M3, `weight_scale` F32 [], `input_scale` F32 []
- hf_tensor_dynamic: `weight` F8_E4M3, `weight_scale` F32 []
- ct_channel (FP8_DYNAMIC): `weight` F8_E4M3, `weight_scale` BF16 [N, 1]
- ct_tensor_static (FP8): `weight` F8_E4M3, `weight_scale` BF16 [1], `input_scale` BF16 [1]

Mixture-of-experts models are written with one tensor per expert, as transformers saves them
and as the Hub holds them (`mlp.experts.7.gate_proj.weight` and its scales), each quantized
like a dense linear; the routers (`mlp.gate.weight`) stay high precision. In the reference the
experts fake-quantize their input and their SiLU-and-mul output per token and 128 columns
(block formats) or per token (every other format: a static `input_scale` does not apply to
experts in pdserve), then multiply the dequantized weights in float32.
"""

from __future__ import annotations

import functools
import json
import re
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8, MAX, FLOOR = torch.float8_e4m3fn, 448.0, 1.0 / (448.0 * 512.0)

_CT_WEIGHTS = {"type": "float", "num_bits": 8, "symmetric": True, "dynamic": False}
_CT_ACTS = {"type": "float", "num_bits": 8, "symmetric": True}


def _ct(weights: str, acts: str, dynamic: bool) -> dict:
    group = {
        "targets": ["Linear"],
        "weights": {**_CT_WEIGHTS, "strategy": weights, "observer": "minmax"},
        "input_activations": {**_CT_ACTS, "strategy": acts, "dynamic": dynamic},
        "output_activations": None,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


# format -> (quantization_config, weight scale layout, activation scheme)
FORMATS = {
    "hf_block": (
        {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        },
        "block",
        "group",
    ),
    "hf_tensor_static": (
        {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]},
        "tensor",
        "static",
    ),
    "hf_tensor_dynamic": (
        {"quant_method": "fp8", "activation_scheme": "dynamic"},
        "tensor",
        "token",
    ),
    "ct_channel": (_ct("channel", "token", True), "channel", "token"),
    "ct_tensor_static": (_ct("tensor", "tensor", False), "tensor", "static"),
}


def fake_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x / scale).clamp(-MAX, MAX).to(FP8).float() * scale


def act_fake_quant(x: torch.Tensor, scheme: str, input_scale: torch.Tensor | None) -> torch.Tensor:
    if scheme == "static":
        return fake_quant(x, input_scale)
    if scheme == "token":
        return fake_quant(x, (x.abs().amax(-1, keepdim=True) / MAX).clamp(min=FLOOR))
    groups = x.unflatten(-1, (-1, 128))  # the tests' hidden sizes are multiples of 128 here
    scale = (groups.abs().amax(-1, keepdim=True) / MAX).clamp(min=FLOOR)
    return fake_quant(groups, scale).flatten(-2)


def _quantize(
    w: torch.Tensor, layout: str, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 weight, scale as stored in `dtype`, per-element float32 scale)."""
    n, k = w.shape
    if layout == "tensor":
        amax = w.abs().amax()
    elif layout == "channel":
        amax = w.abs().amax(1, keepdim=True)
    else:
        tiles = torch.nn.functional.pad(w, (0, -k % 128, 0, -n % 128)).unflatten(0, (-1, 128))
        amax = tiles.unflatten(2, (-1, 128)).abs().amax((1, 3))
    scale = (amax / MAX).clamp(min=FLOOR).to(dtype)
    full = scale.float()
    if layout == "block":
        full = full.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return (w / full).clamp(-MAX, MAX).to(FP8), scale, full


def is_quantized(name: str) -> bool:
    """A decoder linear layer's (DeepSeek's `kv_a_proj_with_mqa` too) or an expert's weight
    (not a router's `gate.weight`)."""
    return name.startswith("model.layers.") and (
        name.endswith(("_proj.weight", "_proj_with_mqa.weight")) or _EXPERT.match(name) is not None
    )


def published_tensors(hf) -> dict[str, torch.Tensor]:
    """`hf`'s tensors under the names its checkpoint holds (transformers' save: one tensor per
    expert, no tied LM head)."""
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        tensors: dict[str, torch.Tensor] = {}
        for file in sorted(Path(folder).glob("*.safetensors")):
            tensors.update(load_file(str(file)))
    return tensors


_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_PART = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # Mixtral's names


def stacked_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Published per-expert tensors restacked as transformers holds them in memory:
    `experts.gate_up_proj` [E, 2I, H] (each expert's gate rows, then its up rows) and
    `experts.down_proj` [E, H, I] (Mixtral's `block_sparse_moe` as `mlp`); every other tensor
    as it is."""
    out, parts = {}, {}
    for name, tensor in tensors.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        match = _EXPERT.match(name)
        if match is None:
            out[name] = tensor
            continue
        part = _PART.get(match.group(3), match.group(3))
        parts.setdefault(match.group(1), {})[(int(match.group(2)), part)] = tensor
    for prefix, by in parts.items():
        experts = range(1 + max(e for e, _ in by))
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([by[(e, "gate_proj")], by[(e, "up_proj")]]) for e in experts]
        )
        out[f"{prefix}.down_proj"] = torch.stack([by[(e, "down_proj")] for e in experts])
    return out


def write(hf, folder: Path, fmt: str, calibration: torch.Tensor) -> dict[str, torch.Tensor]:
    """Save `hf` in `fmt` to `folder`; return the dequantized float32 tensors (in the
    checkpoint's names) and, under "<linear>.input_scale", each dense linear layer's static
    activation scale (float32). Experts of a static format get an `input_scale` of 1.0 in the
    file, as the formats carry one per linear; pdserve does not use it."""
    qconfig, layout, acts = FORMATS[fmt]
    ct = fmt.startswith("ct_")
    input_scales = _calibrate(hf, calibration) if acts == "static" else {}
    tensors, dequantized = {}, {}
    for name, w in published_tensors(hf).items():
        if not is_quantized(name):
            tensors[name] = dequantized[name] = w.contiguous()
            continue
        q, stored, full = _quantize(w.float(), layout, torch.bfloat16 if ct else torch.float32)
        prefix = name.removesuffix(".weight")
        tensors[name] = q
        scale_name = "weight_scale_inv" if layout == "block" else "weight_scale"
        tensors[f"{prefix}.{scale_name}"] = (
            stored.reshape(1) if ct and layout == "tensor" else stored
        )
        dequantized[name] = q.float() * full
        if acts == "static" and ".experts." in prefix:
            tensors[f"{prefix}.input_scale"] = torch.ones(1 if ct else ())
        if prefix in input_scales:
            s = input_scales[prefix]
            s = s.reshape(1).bfloat16() if ct else s  # [1] BF16 / [] F32
            tensors[f"{prefix}.input_scale"] = s
            dequantized[f"{prefix}.input_scale"] = s.float().reshape(())
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads(hf.config.to_json_string())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": qconfig}))
    return dequantized


@torch.no_grad()
def _calibrate(hf, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Static input scales as a calibration run finds them: amax / 448 of each layer's input.
    q/k/v (and gate/up) see the same input, so they get the same scale."""
    amax: dict[str, torch.Tensor] = {}
    hooks = [
        module.register_forward_pre_hook(
            lambda m, args, name=name: amax.__setitem__(name, args[0].abs().amax())
        )
        for name, module in hf.named_modules()
        if isinstance(module, torch.nn.Linear) and name.startswith("model.layers.")
    ]
    hf(tokens[None])
    for hook in hooks:
        hook.remove()
    return {name: (a.float() / MAX).clamp(min=FLOOR) for name, a in amax.items()}


ROW_PARALLEL = ("o_proj", "down_proj")
# DeepSeek's kv_b_proj is written in FP8 like every projection, but pdserve folds it into the
# latent attention as a 16-bit weight (dequantized at load): its input is never quantized.
HIGH_PRECISION_INPUT = ("kv_b_proj",)


def reference(hf_cls, config, dequantized: dict[str, torch.Tensor], fmt: str, tp: int = 1):
    """HF float32 on the dequantized weights, each decoder linear's input (but
    HIGH_PRECISION_INPUT's) fake-quantized. At `tp` > 1 a row-parallel layer's input is
    quantized per rank's slice of its columns, as each rank does (a dynamic per-token scale
    is then the amax of that slice)."""
    _, _, acts = FORMATS[fmt]
    model = hf_cls(config).eval()
    weights = {k: v for k, v in dequantized.items() if not k.endswith("input_scale")}
    result = model.load_state_dict(stacked_experts(weights), strict=False)
    assert set(result.missing_keys) <= {"lm_head.weight"}, result.missing_keys
    assert not result.unexpected_keys, result.unexpected_keys
    if config.tie_word_embeddings:
        model.tie_weights()
    for name, module in model.named_modules():
        if type(module).__name__.endswith("Experts") and name.startswith("model.layers."):
            experts_acts = "group" if acts == "group" else "token"
            module.forward = functools.partial(_experts_w8a8, module, experts_acts)
        decoder_linear = isinstance(module, torch.nn.Linear) and name.startswith("model.layers.")
        if decoder_linear and not name.endswith(HIGH_PRECISION_INPUT):
            scale = dequantized.get(f"{name}.input_scale")
            parts = tp if name.endswith(ROW_PARALLEL) else 1
            module.register_forward_pre_hook(
                lambda m, args, s=scale, n=parts: (
                    torch.cat([act_fake_quant(x, acts, s) for x in args[0].chunk(n, -1)], -1),
                )
            )
    return model


def _experts_w8a8(module, acts: str, hidden, top_k_index, top_k_weights):
    """transformers' stacked experts (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I], SiLU)
    with their input and their SiLU-and-mul output fake-quantized in `acts`."""
    out = torch.zeros_like(hidden)
    x = act_fake_quant(hidden, acts, None)
    inter = module.gate_up_proj.shape[1] // 2
    for expert in range(module.gate_up_proj.shape[0]):
        tokens, slots = torch.where(top_k_index == expert)
        if tokens.numel() == 0:
            continue
        gate_up = x[tokens] @ module.gate_up_proj[expert].T
        h = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = act_fake_quant(h, acts, None) @ module.down_proj[expert].T
        out.index_add_(0, tokens, y * top_k_weights[tokens, slots, None])
    return out
