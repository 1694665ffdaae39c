"""Quantized DeepSeek-V4 checkpoints (FP8 e4m3 128x128 blocks, FP4 e2m1 experts) load as bf16.

A tiny random DeepSeek-V4 is saved in DeepSeek's own tensor names, its linear weights quantized
here (the writer below is the test's own, not bitmatch's): attention and shared-expert weights in
fp8 with per-128x128-block scales (partial blocks included), routed experts in packed fp4 with
e8m0 scales per 32 values. The loaded weights must equal a float64 reference dequantization
rounded once to bf16, bit for bit, and the original weights within the quantization step; a
control that drops the scales must be far off.
"""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import bitmatch
from bitmatch.models import check_supported, quant
from bitmatch.models.deepseek_v4_tiny import tiny_model
from bitmatch.models.hub import load_pretrained

FP8_MAX = 448.0
# wq_b / indexer.wq_b are 256 x 128 or 128 x 128 (whole blocks); wkv 32 x 128, wo_b 128 x 32 and the
# shared experts' w2 128 x 64 end in partial blocks; routed experts 64 x 128 and 128 x 64 (fp4)
TINY = dict(hidden_size=128, num_attention_heads=8, head_dim=32, q_lora_rank=128, moe_intermediate_size=64)


def _fp8_target(key: str) -> bool:
    return key.endswith(".weight") and (".attn." in key or ".shared_experts." in key) and \
        "compressor" not in key and "weights_proj" not in key and not key.endswith("norm.weight")


def _fp4_target(key: str) -> bool:
    return key.endswith(".weight") and ".ffn.experts." in key


def quantize_fp8(w: torch.Tensor, ue8m0: bool):
    """(float8_e4m3fn weight, scale) with one scale per 128 x 128 block (the last blocks partial)."""
    n, k = w.shape
    nb, kb = -(-n // 128), -(-k // 128)
    pad = torch.zeros(nb * 128, kb * 128, dtype=torch.float64)
    pad[:n, :k] = w.double()
    amax = pad.abs().reshape(nb, 128, kb, 128).amax(dim=(1, 3)).clamp(min=1e-12)
    s = amax / FP8_MAX
    if ue8m0:
        s = torch.exp2(torch.ceil(torch.log2(s)))
    full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    q = (w.double() / full).clamp(-FP8_MAX, FP8_MAX).float().to(torch.float8_e4m3fn)
    return q, (s.float().to(torch.float8_e8m0fnu) if ue8m0 else s.float())


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize_fp4(w: torch.Tensor):
    """(int8 [N, K/2] two e2m1 codes a byte, low nibble = even column; e8m0 scale [N, K/32])."""
    n, k = w.shape
    g = w.double().reshape(n, k // 32, 32)
    s = torch.exp2(torch.ceil(torch.log2(g.abs().amax(-1).clamp(min=1e-12) / 6.0)))
    x = (g / s.unsqueeze(-1)).reshape(n, k)
    code = (x.abs().unsqueeze(-1) - E2M1.double()).abs().argmin(-1) | ((x < 0).long() << 3)
    byte = code[:, 0::2] | (code[:, 1::2] << 4)
    return byte.to(torch.uint8).view(torch.int8), s.float().to(torch.float8_e8m0fnu)


# ------------------------------------------------------------------ the reference: float64, one rounding

def round_bf16_reference(x: torch.Tensor) -> torch.Tensor:
    """float64 -> bf16, round-to-nearest-even on the float64 bit pattern (normal numbers)."""
    bits = x.view(torch.int64)
    drop = 52 - 7                                            # bf16 keeps 7 explicit mantissa bits
    lsb = (bits >> drop) & 1
    bits = ((bits + ((1 << (drop - 1)) - 1) + lsb) >> drop) << drop
    return bits.view(torch.float64).float().to(torch.bfloat16)   # exact from here on


def e8m0_value(s: torch.Tensor) -> torch.Tensor:
    return torch.tensor([2.0 ** (int(b) - 127) for b in s.view(torch.uint8).flatten()],
                        dtype=torch.float64).reshape(s.shape)


def e2m1_value(code: torch.Tensor) -> torch.Tensor:
    sign = torch.where(code >> 3 == 1, -1.0, 1.0).double()
    e, m = (code >> 1) & 3, (code & 1).double()
    mag = torch.where(e == 0, m * 0.5, (1.0 + m / 2) * torch.exp2((e - 1).double()))
    return sign * mag


def ref_fp8(q, s):
    n, k = q.shape
    sv = e8m0_value(s) if s.dtype == torch.float8_e8m0fnu else s.double()
    full = sv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    return q.double() * full


def ref_fp4(packed, s):
    b = packed.view(torch.uint8).long()
    v = torch.empty(b.shape[0], 2 * b.shape[1], dtype=torch.float64)
    v[:, 0::2], v[:, 1::2] = e2m1_value(b & 0xF), e2m1_value(b >> 4)
    return v * e8m0_value(s).repeat_interleave(32, 1)


# ------------------------------------------------------------------ the checkpoint

def write_checkpoint(folder, *, ue8m0=True, fp4=True, edit=None):
    """Save a tiny V4 in DeepSeek's names, quantize it; returns (original fp32 tensors, written tensors)."""
    model = tiny_model(**TINY)
    model.save_pretrained(folder)
    path = os.path.join(folder, "model.safetensors")
    with safe_open(path, "pt") as f:
        orig = {k: f.get_tensor(k) for k in f.keys()}
    out = {}
    for k, t in orig.items():
        base = k[: -len(".weight")]
        if fp4 and _fp4_target(k):
            out[k], out[base + ".scale"] = quantize_fp4(t)
        elif _fp8_target(k) or (not fp4 and _fp4_target(k)):
            out[k], s = quantize_fp8(t, ue8m0)
            out[base + (".scale" if ue8m0 else ".weight_scale_inv")] = s
        else:
            out[k] = t.to(torch.bfloat16)
    if edit:
        edit(out)
    os.remove(path)
    save_file(out, path, metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": [128, 128], **({"scale_fmt": "ue8m0"} if ue8m0 else {})}
    if fp4:
        cfg["expert_dtype"] = "fp4"
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return orig, out


def loaded_weight(model, key):
    """The loaded parameter for DeepSeek checkpoint key ``key`` (one of DENSE)."""
    return model.state_dict()[DENSE[key]]


@pytest.fixture(scope="module")
def fp8_fp4(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("dsv4_fp8_fp4"))
    orig, written = write_checkpoint(folder)
    model = load_pretrained(folder, dtype=torch.bfloat16)
    return folder, orig, written, model


DENSE = {  # DeepSeek checkpoint name -> HF parameter name
    "model.layers.1.attn.wq_b.weight": "model.layers.1.self_attn.q_b_proj.weight",      # 256 x 128: 2 whole blocks
    "model.layers.1.attn.wkv.weight": "model.layers.1.self_attn.kv_proj.weight",        # 32 x 128: partial rows
    "model.layers.1.attn.wo_b.weight": "model.layers.1.self_attn.o_b_proj.weight",      # 128 x 32: partial columns
    "model.layers.2.ffn.shared_experts.w2.weight": "model.layers.2.mlp.shared_experts.down_proj.weight"}  # 128 x 64


def test_fp8_weights_equal_the_reference_bit_for_bit(fp8_fp4):
    folder, orig, written, model = fp8_fp4
    assert not hasattr(model.config, "quantization_config") and model.config.dequantized_from["quant_method"] == "fp8"
    for key in DENSE:
        got = loaded_weight(model, key)
        assert got.dtype == torch.bfloat16
        ref = round_bf16_reference(ref_fp8(written[key], written[key[:-7] + ".scale"]))
        bad = (got.view(torch.int16) != ref.view(torch.int16)).nonzero()
        assert bad.numel() == 0, f"{key}: {len(bad)} elements differ, first at {bad[:5].tolist()}"
        # within the quantization step of the original: e4m3 keeps 4 significant bits (half-ulp 2**-4
        # relative) plus the bf16 rounding, and the block scale's absolute floor for tiny values
        o = orig[key].double()
        s = e8m0_value(written[key[:-7] + ".scale"]).repeat_interleave(128, 0).repeat_interleave(128, 1)
        s = s[:o.shape[0], :o.shape[1]]
        err = (got.double() - o).abs()
        assert bool((err <= o.abs() * (2 ** -4 + 2 ** -8) + s * 2 ** -9).all()), f"{key}: max err {err.max():.3g}"


def test_fp4_experts_equal_the_reference_bit_for_bit(fp8_fp4):
    folder, orig, written, model = fp8_fp4
    experts = model.model.layers[2].mlp.experts
    inter = TINY["moe_intermediate_size"]
    for e in range(4):
        p = f"model.layers.2.ffn.experts.{e}."
        ref = {w: round_bf16_reference(ref_fp4(written[p + w + ".weight"], written[p + w + ".scale"]))
               for w in ("w1", "w2", "w3")}
        got = {"w1": experts.gate_up_proj[e, :inter], "w3": experts.gate_up_proj[e, inter:], "w2": experts.down_proj[e]}
        for w in ref:
            assert torch.equal(got[w].view(torch.int16), ref[w].view(torch.int16)), f"expert {e} {w}"
            o = orig[p + w + ".weight"].double()
            # e2m1 between 2**-1 and 6 has one mantissa bit: error <= 1/4 of the value's power of two,
            # and the group scale's floor (half of the smallest step 0.5) for tiny values
            s = e8m0_value(written[p + w + ".scale"]).repeat_interleave(32, 1)
            assert bool(((got[w].double() - o).abs() <= o.abs() * 0.25 * 1.01 + s * 0.25).all())


def test_loaded_model_runs_and_token_logprobs(fp8_fp4):
    folder, orig, written, model = fp8_fp4
    check_supported(model)
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    lp = bitmatch.token_logprobs(model, ids, torch.ones_like(ids))
    assert lp.shape == (2, 11) and bool(torch.isfinite(lp).all()) and bool((lp <= 0).all())
    # HF's own eager forward: in float32 (transformers 5.19's bf16 DeepSeek-V4 forward mixes its fp32-kept
    # mHC outputs into bf16 linears and fails on CPU, quantized or not); ue8m0 products are exact in fp32
    m32 = load_pretrained(folder, dtype=torch.float32)
    key = next(iter(DENSE))
    assert torch.equal(m32.state_dict()[DENSE[key]], ref_fp8(written[key], written[key[:-7] + ".scale"]).float())
    with torch.no_grad():
        logits = m32(ids).logits
    assert bool(torch.isfinite(logits).all())
    hf = torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    lp32 = bitmatch.token_logprobs(m32, ids, torch.ones_like(ids))
    assert (lp32.double() - hf).abs().max() < 1e-4, "bitmatch's forward disagrees with HF's on the loaded weights"


def test_float32_scales_v3_names_and_fp8_experts(tmp_path):
    orig, written = write_checkpoint(str(tmp_path), ue8m0=False, fp4=False)
    model = load_pretrained(str(tmp_path), dtype=torch.bfloat16)
    for key in DENSE:
        ref = round_bf16_reference(ref_fp8(written[key], written[key[:-7] + ".weight_scale_inv"]))
        assert torch.equal(loaded_weight(model, key).view(torch.int16), ref.view(torch.int16)), key
    e = "model.layers.3.ffn.experts.1.w2.weight"
    ref = round_bf16_reference(ref_fp8(written[e], written[e[:-7] + ".weight_scale_inv"]))
    assert torch.equal(model.model.layers[3].mlp.experts.down_proj[1].view(torch.int16), ref.view(torch.int16))


def test_round_once_not_twice():
    # 1 + 2**-8 + 2**-30 is above the bf16 tie: one rounding goes up, torch's cast (via float32) goes down
    x = torch.tensor([1 + 2 ** -8 + 2 ** -30, -(1 + 2 ** -8), 3 * 2 ** -133, 2 ** -135, 0.0], dtype=torch.float64)
    got = quant.round_exact(x, torch.bfloat16)
    assert got[0].item() == 1 + 2 ** -7 and x[:1].to(torch.bfloat16).item() == 1.0
    # a tie goes to even; bf16 subnormals are multiples of 2**-133, below half of one is 0
    assert got[1].item() == -1.0 and got[2].item() == 3 * 2 ** -133 and got[3].item() == 0.0 and got[4].item() == 0.0


def test_control_without_scales_is_far_off(fp8_fp4):
    folder, orig, written, model = fp8_fp4
    key = next(iter(DENSE))
    unscaled = written[key].to(torch.float64)                      # the fp8 codes read as if they were weights
    o = orig[key].double()
    assert (unscaled - o).abs().max() > 100 * (loaded_weight(model, key).double() - o).abs().max()
    assert not torch.equal(unscaled.to(torch.bfloat16), loaded_weight(model, key))


def test_dequantized_bytes(fp8_fp4):
    folder, orig, written, model = fp8_fp4
    params = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    assert quant.dequantized_bytes(model.config) == params
    with open(os.path.join(folder, "config.json")) as f:
        assert quant.dequantized_bytes(json.load(f)) == params
    # from the headers: every weight at 2 bytes a value (the tiny model's fp32-kept parameters were saved bf16)
    logical = sum(math.prod(t.shape) for k, t in orig.items())
    assert quant.dequantized_bytes(folder) == quant.dequantized_bytes(os.path.join(folder, "model.safetensors")) \
        == 2 * logical


# ------------------------------------------------------------------ refusals, before any weight loads

def _config(folder, **quant_cfg):
    p = os.path.join(folder, "config.json")
    with open(p) as f:
        cfg = json.load(f)
    cfg["quantization_config"].update(quant_cfg)
    with open(p, "w") as f:
        json.dump(cfg, f)


@pytest.mark.parametrize("option, match", [
    ({"quant_method": "awq"}, "quant_method='awq' is not read by bitmatch"),
    ({"weight_block_size": [64, 64]}, r"weight_block_size=\[64, 64\] \(only \[128, 128\]\)"),
    ({"activation_scheme": "static"}, "activation_scheme='static'"),
    ({"fmt": "e5m2"}, "fmt='e5m2'"),
    ({"scale_fmt": "e4m3"}, "scale_fmt='e4m3'"),
    ({"packing": "awq"}, "unknown quantization_config keys"),
])
def test_refuses_options(tmp_path, option, match):
    write_checkpoint(str(tmp_path))
    _config(str(tmp_path), **option)
    with pytest.raises(quant.QuantizedCheckpointError, match=match):
        load_pretrained(str(tmp_path))


def test_refuses_wrong_scale_shape(tmp_path):
    key = "model.layers.1.attn.wq_b.scale"
    write_checkpoint(str(tmp_path), edit=lambda t: t.__setitem__(key, t[key][:1]))
    with pytest.raises(quant.QuantizedCheckpointError,
                       match=r"scale '.*wq_b.scale' has shape \[1, 1\].*needs \[2, 1\]"):
        load_pretrained(str(tmp_path))


def test_refuses_missing_scale(tmp_path):
    write_checkpoint(str(tmp_path), edit=lambda t: t.pop("model.layers.1.attn.wkv.scale"))
    with pytest.raises(quant.QuantizedCheckpointError, match=r"wkv.weight' is float8_e4m3fn but has no scale"):
        load_pretrained(str(tmp_path))


def test_refuses_fp4_without_expert_dtype(tmp_path):
    write_checkpoint(str(tmp_path))
    p = os.path.join(str(tmp_path), "config.json")
    with open(p) as f:
        cfg = json.load(f)
    cfg.pop("expert_dtype")
    with open(p, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(quant.QuantizedCheckpointError, match="does not declare expert_dtype='fp4'"):
        load_pretrained(str(tmp_path))


def test_refuses_bad_fp4_scale(tmp_path):
    key = "model.layers.3.ffn.experts.0.w2.scale"
    write_checkpoint(str(tmp_path), edit=lambda t: t.__setitem__(key, t[key].view(torch.uint8).float()))
    with pytest.raises(quant.QuantizedCheckpointError, match="need e8m0"):
        load_pretrained(str(tmp_path))
