"""PEFT LoRA on bitmatch kernels (bitmatch.models.lora): the trainer's LoRA forward equals, bit for
bit, a plain model holding the weights PEFT's own ``merge_adapter`` writes (what TRL pushes to the
rollout); gradients of A and B match a float64 reference of the stock LoRA formulation."""
from __future__ import annotations

import copy

import pytest
import torch

peft = pytest.importorskip("peft")

import bitmatch  # noqa: E402
import bitmatch.kernels as K  # noqa: E402
from bitmatch.models import lora  # noqa: E402
from bitmatch.testing import bits  # noqa: E402
from bitmatch.testing.models import pad_batch, random_prompts, tiny_model  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
T = 0.8


def peft_model(dtype, seed=0, dropout=0.0):
    from peft import LoraConfig, get_peft_model

    base = tiny_model("qwen3-hd64-gqa4-tied", dtype=dtype, seed=seed)
    torch.manual_seed(seed + 1)
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=dropout,
                                           init_lora_weights=False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_forward_equals_peft_merged_weights(dtype):
    pm = peft_model(dtype)
    bitmatch.patch(pm)
    ids, mask = pad_batch(random_prompts(4, 3, 20, seed=2), "left")
    got = bitmatch.token_logprobs(pm, ids, mask, temperature=T)
    # the rollout's weights: PEFT's own merge (as TRL does before pushing to vLLM), into a plain model
    merged = copy.deepcopy(pm)
    merged.merge_adapter()
    plain = tiny_model("qwen3-hd64-gqa4-tied", dtype=dtype, seed=5)
    sd = {k.removeprefix("base_model.model.").replace(".base_layer", ""): v
          for k, v in merged.state_dict().items() if "lora_" not in k}
    plain.load_state_dict(sd)
    want = bitmatch.token_logprobs(plain, ids, mask, temperature=T)
    assert torch.equal(bits(got), bits(want))
    # merged_state_dict (what attach() publishes to the rollout copy) holds the same bytes
    for name, w in lora.merged_state_dict(pm):
        assert torch.equal(bits(w), bits(dict(plain.named_parameters())[name])), name


def test_control_unmerged_lora_formulation_differs():
    """x W^T + s (x A^T) B^T on the same kernels gives other bits than x (W + s B A)^T."""
    pm = peft_model(torch.bfloat16)
    mod = pm.base_model.model.model.layers[0].mlp.down_proj
    x = torch.randn(64, mod.in_features).to(torch.bfloat16)
    a, b, s = mod.lora_A["default"].weight, mod.lora_B["default"].weight, mod.scaling["default"]
    with torch.no_grad():
        unmerged = K.linear(x, mod.base_layer.weight) + s * K.linear(K.linear(x, a), b)
        merged = lora.linear(mod, x, torch.bfloat16)
    assert not torch.equal(bits(unmerged), bits(merged))


def test_lora_gradients_match_float64_reference():
    pm = peft_model(torch.float32, seed=3)
    ref = copy.deepcopy(pm).double()   # stock PEFT forward (unmerged), float64
    bitmatch.patch(pm)
    pm.train()
    ids = torch.tensor(random_prompts(3, 12, 12, seed=4))   # no padding: stock positions = bitmatch positions
    w = torch.randn(3, 11, dtype=torch.float64)
    lp = bitmatch.token_logprobs(pm, ids, None, temperature=T)
    (lp.double() * w).sum().backward()
    logits = ref(input_ids=ids).logits.double()[:, :-1]
    lp_ref = torch.log_softmax(logits / T, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    (lp_ref * w).sum().backward()
    assert (lp.double() - lp_ref).abs().max() < 1e-4
    got = {k: p.grad for k, p in pm.named_parameters() if p.requires_grad}
    want = {k: p.grad for k, p in ref.named_parameters() if p.requires_grad}
    assert set(got) == set(want) and len(got) == 2 * len(TARGETS) * 2
    for k in got:
        assert got[k] is not None and got[k].abs().sum() > 0, k
        err = (got[k].double() - want[k]).norm() / want[k].norm()
        assert err < 1e-4, (k, float(err))


def test_disabled_adapters_run_the_base_layer():
    """TRL's reference logprobs with PEFT (beta != 0): adapters disabled = the base model's bits."""
    pm = peft_model(torch.bfloat16)
    bitmatch.patch(pm)
    ids, mask = pad_batch(random_prompts(2, 3, 9, seed=6), "right")
    base = tiny_model("qwen3-hd64-gqa4-tied", dtype=torch.bfloat16, seed=0)
    with pm.disable_adapter():
        got = bitmatch.token_logprobs(pm, ids, mask, temperature=T)
    assert torch.equal(bits(got), bits(bitmatch.token_logprobs(base, ids, mask, temperature=T)))


def test_lora_dropout_in_training_is_refused():
    pm = peft_model(torch.float32, dropout=0.1)
    bitmatch.patch(pm)
    pm.train()
    ids = torch.tensor(random_prompts(1, 5, 5, seed=1))
    with pytest.raises(ValueError, match=r"lora_dropout=0.1.*LoraConfig\(lora_dropout=0.0\)"):
        bitmatch.token_logprobs(pm, ids, None, temperature=T)
    pm.eval()   # no dropout at inference: allowed
    bitmatch.token_logprobs(pm, ids, None, temperature=T)


def test_dora_is_refused():
    from peft import LoraConfig, get_peft_model

    pm = get_peft_model(tiny_model("qwen3-hd64-gqa4-tied", dtype=torch.float32),
                        LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    bitmatch.patch(pm)
    with pytest.raises(ValueError, match=r"use_dora=False"):
        bitmatch.token_logprobs(pm, torch.tensor([[3, 4, 5]]), None)


def _v4():
    from bitmatch.models.deepseek_v4_tiny import tiny_model as v4_tiny
    return v4_tiny(dtype=torch.float32)


def _moe():
    return tiny_model("qwen3moe-e8-k2", dtype=torch.float32)


def _dense():
    return tiny_model("qwen3-hd64-gqa4-tied", dtype=torch.float32)


@pytest.mark.parametrize("build,config,named", [
    (_moe, dict(target_modules=["gate"]), r"the MoE router \(mlp.gate\)"),
    (_moe, dict(target_modules=[], target_parameters=["mlp.experts.gate_up_proj"]), r"the routed experts"),
    (_v4, dict(target_modules=["o_a_proj"]), r"o_a_proj"),
    (_v4, dict(target_modules=[], target_parameters=["attn_hc.fn"]), r"an mHC mix"),
    (_dense, dict(target_modules=["lm_head"]), r"wraps lm_head"),
    (_dense, dict(target_modules=["embed_tokens"]), r"the token embeddings"),
])
def test_adapters_on_weights_read_directly_are_refused_by_name(build, config, named):
    # these modules' weights are read directly (routers, experts, V4's grouped o_a_proj, mHC, head,
    # embeddings): an adapter there would be ignored, so it is refused, naming the module and the
    # LoraConfig option. V4's o_a_proj adapter ran before, silently without its delta
    import warnings

    from peft import LoraConfig, get_peft_model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's tied-embedding notice
        pm = bitmatch.patch(get_peft_model(build(), LoraConfig(r=2, lora_alpha=4, **config)))
    with pytest.raises(ValueError, match=named + r".*target_modules"):
        bitmatch.token_logprobs(pm, torch.tensor([[3, 4, 5, 6]]), None)


def test_control_adapters_on_the_projections_run():
    # the refusal's control: the same models with adapters on projections bitmatch runs through its
    # LoRA linear reproduce PEFT's forward (V4: the query and output projections, MoE: attention)
    import copy as _copy

    from peft import LoraConfig, get_peft_model
    for build, targets in ((_v4, ["q_b_proj", "o_b_proj", "kv_proj"]), (_moe, ["q_proj", "o_proj"])):
        torch.manual_seed(3)
        pm = get_peft_model(build(), LoraConfig(r=2, lora_alpha=4, target_modules=targets, init_lora_weights=False))
        hf = _copy.deepcopy(pm)
        ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
        with torch.no_grad():
            ref = torch.log_softmax(hf(ids).logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
            with hf.disable_adapter():
                base = torch.log_softmax(hf(ids).logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
        got = bitmatch.token_logprobs(bitmatch.patch(pm), ids, None)
        assert (got - ref).abs().max() < 1e-4 < (ref - base).abs().max()


def test_trl_entropies_match_stock_computation(tmp_path):
    """The adapter's entropies (TRL's entropy metric / mask / bonus) are the entropies of the same
    distribution, computed from the stock model in float64."""
    pytest.importorskip("trl")
    import bitmatch.adapters.trl as bt
    from test_trl import make_trainer

    trainer = bt.attach(make_trainer(tmp_path, steps=1))
    model = trainer.model
    ref = copy.deepcopy(model)
    bitmatch.unpatch(ref)
    ref = ref.double()
    ids, mask = pad_batch(random_prompts(3, 4, 10, seed=8), "right")
    keep = 5
    with torch.no_grad():
        lp, ent, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, keep, compute_entropy=True)
        logits = ref(input_ids=ids, attention_mask=mask).logits.double()[:, -keep - 1:-1] / trainer.temperature
    logp = torch.log_softmax(logits, -1)
    ent_ref = -(logp.exp() * logp).sum(-1)
    lp_ref = logp.gather(-1, ids[:, -keep:, None]).squeeze(-1)
    m = mask[:, -keep:].bool()
    assert (ent.double() - ent_ref)[m].abs().max() < 1e-4
    assert (lp.double() - lp_ref)[m].abs().max() < 1e-4


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_lora_gradients_with_gradient_checkpointing(use_reentrant):
    """TRL's default gradient checkpointing: the LoRA gradients are the same as without it (reentrant
    checkpointing needs the embedding output to require grad, as PEFT arranges through HF's hook)."""
    pm = peft_model(torch.float32, seed=3)
    ref = copy.deepcopy(pm)
    for m in (pm, ref):
        bitmatch.patch(m)
        m.train()
    pm.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    pm.enable_input_require_grads()
    ids = torch.tensor(random_prompts(2, 9, 9, seed=4))
    for m in (pm, ref):
        bitmatch.token_logprobs(m, ids, None, temperature=T).sum().backward()
    got = {k: p.grad for k, p in pm.named_parameters() if p.requires_grad}
    want = {k: p.grad for k, p in ref.named_parameters() if p.requires_grad}
    assert all(got[k] is not None and torch.equal(got[k], want[k]) for k in want)
