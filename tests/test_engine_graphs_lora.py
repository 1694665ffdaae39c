"""PEFT LoRA models in the engine's CUDA-graph decode buckets (bitmatch.models.lora's kept weights).

The engine's paged steps read each LoRA layer's kept ``cast(merged_weight)`` instead of re-merging
W + s B A on every step; the kept tensor is refreshed in place when W, A or B change (version
counters, pointers, forced when the engine starts work), so a captured graph reading it stays
valid. Checked here on CPU (``ModelRunner.simulate_buckets`` runs each pure-decode step eagerly
on exactly the padded inputs a replay gets; the capture itself runs on the GPU):
- the family opts in with LoRA on plain linears, and not for layers ``linear`` cannot run;
- a request's bits do not depend on its bucket, and the engine equals the trainer (which
  re-merges in its forward) before and after an optimizer-like update of A and B, and after a
  write through ``.data`` (no version bump) between generate calls;
- control: a kept weight left stale after the update (the refresh disabled) makes the engine
  differ from the trainer, so the comparison sees a stale weight.
- LoRA projections join the engine's fused q/k/v and gate/up copies (as a merged model's do:
  one GEMM, the kept weight inside the fused copy); control: a fused part built from the base
  weight alone (adapters dropped) makes the engine differ from the trainer.
"""
from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")

import bitmatch  # noqa: E402
from bitmatch.engine import Engine, SamplingParams  # noqa: E402
from bitmatch.engine.graphs import graph_safe  # noqa: E402
from bitmatch.models import lora, unwrap_causal_lm  # noqa: E402
from bitmatch.models.state import get_state  # noqa: E402
from bitmatch.precision import cast_param  # noqa: E402
from bitmatch.testing import same_outputs  # noqa: E402
from bitmatch.testing.models import random_prompts, tiny_model  # noqa: E402
from graph_buckets import opt_in_needs_runnable_lora, stale_kept_weights, step_lora  # noqa: E402
from test_engine import assert_bitmatch  # noqa: E402

TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


def _peft(dtype=torch.bfloat16, seed=0):
    base = tiny_model("qwen3-hd64-gqa4-tied", dtype=dtype, seed=seed)
    torch.manual_seed(seed + 1)
    pm = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0,
                                                   init_lora_weights=False))
    pm.eval()
    return bitmatch.patch(pm)


def _staggered():
    prompts = random_prompts(5, 3, 30, seed=11)
    params = [SamplingParams(temperature=t, max_tokens=2 + i, ignore_eos=True, seed=i)
              for i, t in enumerate([0.8, 1.0, 0.0, 0.6, 0.8])]
    return prompts, params


def _generate(eng, prompts, params):
    return eng.generate(prompts, params, use_tqdm=False)


@pytest.fixture(scope="module")
def pm():
    return _peft()


def test_lora_models_opt_into_graphs(pm):
    # and a layer the LoRA linear cannot run (fan_in_fan_out) keeps the model eager
    opt_in_needs_runnable_lora(pm, graph_safe)


def test_kept_weight_is_the_merged_cast():
    pm = _peft(torch.float32)
    mod = next(m for m in unwrap_causal_lm(pm).modules() if lora.is_lora_layer(m))
    kept = lora.rollout_weight(mod, torch.bfloat16)
    assert torch.equal(kept.view(torch.int16), cast_param(lora.merged_weight(mod), torch.bfloat16).view(torch.int16))
    ptr = kept.data_ptr()
    step_lora(pm, 0.05)
    again = lora.rollout_weight(mod, torch.bfloat16)
    assert again.data_ptr() == ptr  # refreshed in place: a captured graph keeps reading it
    assert torch.equal(again.view(torch.int16), cast_param(lora.merged_weight(mod), torch.bfloat16).view(torch.int16))
    mod.scaling["default"] = mod.scaling["default"] * 2  # a scaling change is part of the key
    assert torch.equal(lora.rollout_weight(mod, torch.bfloat16).view(torch.int16),
                       cast_param(lora.merged_weight(mod), torch.bfloat16).view(torch.int16))


def test_buckets_and_trainer_across_weight_updates(pm):
    prompts, params = _staggered()
    eager = Engine(pm, num_gpu_blocks=96, max_num_seqs=8)
    graphs = Engine(pm, num_gpu_blocks=96, max_num_seqs=8)
    graphs.model_runner.simulate_buckets = True
    for update in (None, "optimizer", "data"):
        if update == "optimizer":
            step_lora(pm, 0.05)
        elif update == "data":  # behind autograd's back: no version bump; the engine's forced refresh sees it
            for n, p in pm.named_parameters():
                if n.endswith("lora_B.default.weight"):
                    v = p._version
                    p.data.mul_(1.5)
                    assert p._version == v
        a = _generate(eager, prompts, params)
        b = _generate(graphs, prompts, params)
        assert graphs.model_runner.num_simulated_steps > 0
        assert same_outputs(a, b), update
        assert assert_bitmatch(pm, b, params) > 0, update


def test_control_stale_kept_weight_differs(pm, monkeypatch):
    prompts, params = _staggered()
    outs = stale_kept_weights(pm, prompts, params, monkeypatch)
    with pytest.raises(AssertionError, match="differ"):
        assert_bitmatch(pm, outs, params)


def test_lora_projections_run_fused(pm):
    # q and v carry adapters, k does not: the fused q/k/v copy holds the merged casts and k's cast
    prompts, params = _staggered()
    eng = Engine(pm, num_gpu_blocks=96, max_num_seqs=8)  # held: the last engine to go drops the fused copies
    outs = _generate(eng, prompts, params)
    assert assert_bitmatch(pm, outs, params) > 0
    for layer in unwrap_causal_lm(pm).model.layers:
        attn = layer.self_attn
        entry = get_state(attn).derived["qkv"]
        want = torch.cat([cast_param(lora.merged_weight(attn.q_proj), torch.bfloat16),
                          cast_param(attn.k_proj.weight, torch.bfloat16),
                          cast_param(lora.merged_weight(attn.v_proj), torch.bfloat16)])
        assert torch.equal(entry.weight.view(torch.int16), want.view(torch.int16))
        assert not lora.rollout_weights_of(attn.q_proj)  # no second kept copy beside the fused one


def test_control_fused_part_without_adapters_differs(monkeypatch):
    pm = _peft(seed=3)
    monkeypatch.setattr(lora, "fused_part", lambda mod, dtype: (cast_param(mod.get_base_layer().weight, dtype),
                                                               mod.get_base_layer().bias))
    prompts, params = _staggered()
    outs = _generate(Engine(pm, num_gpu_blocks=96, max_num_seqs=8), prompts, params)
    with pytest.raises(AssertionError, match="differ"):
        assert_bitmatch(pm, outs, params)


def _fp32_master_peft(seed=5):
    """fp32 master weights computed in bf16 (TRL's mixed precision on shared weights)."""
    base = tiny_model("qwen3", dtype=torch.float32, seed=seed)
    torch.manual_seed(seed + 1)
    pm = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0,
                                                   init_lora_weights=False))
    pm.eval()
    return bitmatch.patch(pm, compute_dtype=torch.bfloat16)


def _update_plain_params(pm, how):
    """Change the norms' and the LM head's weights: in place (version bump) or through .data."""
    lm = unwrap_causal_lm(pm)
    with torch.no_grad():
        for p in (lm.model.norm.weight, lm.lm_head.weight, lm.model.layers[0].input_layernorm.weight):
            if how == "optimizer":
                p.mul_(1.25)
            else:
                v = p._version
                p.data.mul_(0.75)
                assert p._version == v


def test_kept_casts_of_fp32_masters_follow_updates():
    """An engine step reads each fp32 parameter it casts at use (norms, the LM head) from a kept
    bf16 cast (same bits as the cast, no re-cast per decode step); an in-place update or a write
    through .data between generate calls reaches it: eager engine == simulated replays == trainer."""
    pm = _fp32_master_peft()
    lm = unwrap_causal_lm(pm)
    prompts, params = _staggered()
    eager = Engine(pm, num_gpu_blocks=96, max_num_seqs=8)
    graphs = Engine(pm, num_gpu_blocks=96, max_num_seqs=8)
    graphs.model_runner.simulate_buckets = True
    for update in (None, "optimizer", "data"):
        if update:
            _update_plain_params(pm, update)
        a = _generate(eager, prompts, params)
        b = _generate(graphs, prompts, params)
        assert graphs.model_runner.num_simulated_steps > 0
        assert same_outputs(a, b), update
        assert assert_bitmatch(pm, b, params) > 0, update
        kept = lora._KEPT_CASTS.get(lm.lm_head.weight, {}).get(torch.bfloat16)
        assert kept is not None and torch.equal(kept[1].view(torch.int16),
                                                cast_param(lm.lm_head.weight, torch.bfloat16).view(torch.int16))
        assert lora._KEPT_CASTS.get(lm.model.norm.weight)


def test_control_stale_kept_casts_differ(monkeypatch):
    """Kept casts never refreshed after their first fill: the same update makes the engine differ
    from the trainer (the comparison sees a stale cast)."""
    pm = _fp32_master_peft(seed=6)
    prompts, params = _staggered()
    eng = Engine(pm, num_gpu_blocks=96, max_num_seqs=8)
    assert assert_bitmatch(pm, _generate(eng, prompts, params), params) > 0
    orig = lora._cast_into
    monkeypatch.setattr(lora, "_cast_into", lambda entry, p, dtype, force=False:
                        entry[1] if entry[1] is not None else orig(entry, p, dtype))
    _update_plain_params(pm, "optimizer")
    with pytest.raises(AssertionError, match="differ"):
        assert_bitmatch(pm, _generate(eng, prompts, params), params)
