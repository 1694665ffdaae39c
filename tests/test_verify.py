"""bitmatch.diagnostics.verify: compare (exact mismatch, KL, first divergence) and locate (first op)."""
import copy
import math

import pytest
import torch

from bitmatch.diagnostics.verify import compare, float_hex, locate
from bitmatch.testing.models import random_prompts, tiny_model


def test_compare_equal_and_perturbed():
    a = [[-1.0, -2.5, -0.125], [-3.0, -0.5]]
    r = compare(a, [list(x) for x in a])
    assert r.bitmatched and r.mismatches == 0 and r.total == 5 and r.max_abs_diff == 0 and r.k3_kl == 0
    assert r.first_divergence is None
    b = [[-1.0, -2.5, -0.125], [-3.0, -0.25]]
    r = compare(a, b)
    assert r.mismatches == 1 and r.first_divergence == (1, 1)
    assert r.first_rollout_hex == float_hex(-0.5) == "0xbf000000" and r.first_trainer_hex == "0xbe800000"
    assert r.max_abs_diff == pytest.approx(0.25)
    assert r.mean_abs_diff == pytest.approx(0.25 / 5)
    assert r.k3_kl == pytest.approx((math.exp(0.25) - 1 - 0.25) / 5)
    assert "first divergence" in r.summary()


def test_compare_tensors_mask_and_one_ulp():
    x = torch.randn(3, 7)
    y = x.clone()
    y[2, 4] = torch.nextafter(y[2, 4], torch.tensor(float("inf")))  # one ulp
    mask = torch.ones(3, 7)
    r = compare(x, y, mask)
    assert r.mismatches == 1 and r.first_divergence == (2, 4) and r.max_abs_diff > 0
    mask[2, 4] = 0
    r = compare(x, y, mask)
    assert r.bitmatched and r.total == 20
    with pytest.raises(ValueError):
        compare([[1.0, 2.0]], [[1.0]])


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3-hd64-gqa4-tied", dtype=torch.bfloat16, seed=0)


@pytest.mark.parametrize("target", ["layers.1.mlp.down_proj", "layers.0.self_attn.o_proj",
                                    "layers.1.self_attn.k_norm"])
def test_locate_names_perturbed_layer(model, target):
    b = copy.deepcopy(model)
    mod = b.get_submodule("model." + target)
    with torch.no_grad():
        w = mod.weight.view(-1)
        w[3] = torch.nextafter(w[3].float(), torch.tensor(float("inf"))).to(w.dtype) + 0.0625 * w[3].abs()
    prompts = random_prompts(3, 4, 20, seed=1)
    res = locate(model, b, prompts)
    assert res.first_divergent == target, res.summary()
    assert res.layer == int(target.split(".")[1]) and res.op == ".".join(target.split(".")[2:])
    same = locate(model, copy.deepcopy(model), prompts)
    assert same.bitmatched and same.ops_compared > 20


def test_locate_with_engine_object(model):
    from bitmatch.engine import Engine

    b = copy.deepcopy(model)
    with torch.no_grad():
        b.model.layers[1].mlp.up_proj.weight.mul_(1.5)
    eng = Engine(b, num_gpu_blocks=8)
    res = locate(model, eng, random_prompts(2, 3, 9, seed=2))
    assert res.first_divergent == "layers.1.mlp.up_proj"


def test_locate_fp32_master_vs_bf16_copy():
    from bitmatch.precision import compute_cast

    m32 = tiny_model("qwen3-hd64-gqa4-tied", dtype=torch.float32, seed=1)
    m16 = copy.deepcopy(m32)
    for p in m16.parameters():
        p.data = compute_cast(p.data, torch.bfloat16)
    prompts = random_prompts(2, 3, 9, seed=3)
    assert locate(m32, m16, prompts, compute_dtype_a=torch.bfloat16).bitmatched
    assert locate(m32, m16, prompts).first_divergent == "embed_tokens"


def test_locate_paged_schedule_matches_prefill(model):
    prompts = random_prompts(3, 5, 40, seed=4)
    for bs in (16, 32):
        assert locate(model, model, prompts, paged_b_block_size=bs).bitmatched
