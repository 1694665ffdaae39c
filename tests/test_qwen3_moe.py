"""Qwen3-MoE on bitmatch kernels: parity with HF's fp32 forward, engine == trainer bit for bit
(routing identical on both sides, ties, zero-token experts), float64 gradients (router included),
and a control: HF's own MoE forward differs from the engine."""
from __future__ import annotations

import copy

import pytest
import torch

import bitmatch
import bitmatch.kernels as K
from bitmatch.engine import Engine, SamplingParams
from bitmatch.testing.models import pad_batch, random_prompts, tiny_model
from test_engine import assert_bitmatch, hf_logprobs


def _hf_logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize("name", ["qwen3moe-e8-k2", "qwen3moe-e4-k1-step2"])
def test_parity_with_hf_fp32(name):
    """The family is the real architecture: HF's own fp32 forward agrees to rounding."""
    hf = tiny_model(name, dtype=torch.float32, seed=3)
    ids, mask = pad_batch(random_prompts(2, 4, 20, seed=5), "left")
    ref = _hf_logits(hf, ids, mask)
    got = _hf_logits(bitmatch.patch(copy.deepcopy(hf)), ids, mask)
    m = mask.bool()
    err = (got[m] - ref[m]).abs().max().item()
    assert err < 2e-5, f"{name}: max |logit diff| vs HF fp32 {err}"
    assert not torch.equal(got[m], ref[m])  # other summation orders: parity, not bits


def _record_routes(monkeypatch):
    """Patch kernels.moe_route to record {input row bytes: chosen experts} for every routed token."""
    seen: dict[bytes, tuple] = {}
    orig = K.moe_route

    def spy(logits, top_k, **kw):
        w, ids = orig(logits, top_k, **kw)
        for row, e in zip(logits, ids):
            seen[row.detach().contiguous().view(torch.int32).numpy().tobytes()] = tuple(e.tolist())
        return w, ids

    monkeypatch.setattr(K, "moe_route", spy)
    return seen


@pytest.mark.parametrize("name,engine_kw,n,max_tokens", [
    ("qwen3moe-e8-k2", dict(max_num_seqs=3, max_num_batched_tokens=16, block_size=16), 4, 5),
    ("qwen3moe-e4-k1-step2", dict(max_num_seqs=1, enable_chunked_prefill=False), 3, 6),
    ("qwen3moe-e8-k2", dict(max_num_seqs=8, max_num_batched_tokens=7, block_size=32), 4, 5),
])
def test_engine_equals_trainer_and_routes_agree(name, engine_kw, n, max_tokens, monkeypatch):
    model = bitmatch.patch(tiny_model(name, dtype=torch.bfloat16, seed=1))
    prompts = random_prompts(n, 2, 28, seed=7)
    params = [SamplingParams(temperature=t, max_tokens=max_tokens, seed=i)
              for i, t in enumerate([1.0, 0.7, 0.0, 1.0, 0.7][:n])]
    routes = _record_routes(monkeypatch)
    outs = Engine(model, **engine_kw).generate(prompts, params, use_tqdm=False)
    engine_routes = dict(routes)
    assert assert_bitmatch(model, outs, params, batch=3) == sum(len(o.outputs[0].token_ids) for o in outs)
    # the trainer, over the tokens the engine ran (all but each sequence's last sampled token), routes
    # the same router-logit rows (same bytes) to the same experts: no routing replay needed
    routes.clear()
    ids, mask = pad_batch([o.prompt_token_ids + o.outputs[0].token_ids[:-1] for o in outs], "left")
    with torch.no_grad():
        bitmatch.token_logprobs(model, ids, mask)
    assert routes, "no MoE layer ran"
    assert routes.keys() == engine_routes.keys()
    assert all(engine_routes[k] == v for k, v in routes.items())


def test_ties_and_zero_token_experts():
    """Duplicated router rows tie experts 1 = 3 = 5 (2 = 6): the lowest index wins on both sides, and
    with 16 experts top-1 most experts receive zero tokens in each decode step."""
    model = tiny_model("qwen3moe-e8-k2", dtype=torch.bfloat16, seed=2)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                w = layer.mlp.gate.weight
                w[3].copy_(w[1])
                w[5].copy_(w[1])
                w[6].copy_(w[2])
    bitmatch.patch(model)
    x = torch.randn(64, model.config.hidden_size).to(torch.bfloat16)
    logits = K.linear(x.float(), model.model.layers[0].mlp.gate.weight.float())
    _, ids = K.moe_route(logits, 2, scoring="softmax", renormalize=True)
    rows = [set(r) for r in ids.tolist()]
    # a tied copy is chosen only after its lower twin: 5 never (1 and 3 fill top-2 first)
    assert all(5 not in r and (3 not in r or 1 in r) and (6 not in r or 2 in r) for r in rows)
    assert any({1, 3} == r for r in rows) and any(1 in r for r in rows)
    params = [SamplingParams(temperature=1.0, max_tokens=5, seed=i) for i in range(3)]
    outs = Engine(model, max_num_seqs=3).generate(random_prompts(3, 3, 20, seed=9), params, use_tqdm=False)
    assert_bitmatch(model, outs, params)

    sparse = bitmatch.patch(tiny_model("qwen3moe-e8-k2", dtype=torch.bfloat16, seed=4, num_experts=16,
                                       num_experts_per_tok=1))
    outs = Engine(sparse, max_num_seqs=4).generate(random_prompts(4, 2, 12, seed=3),
                                                   [SamplingParams(temperature=1.0, max_tokens=4, seed=i)
                                                    for i in range(4)], use_tqdm=False)
    assert_bitmatch(sparse, outs, [SamplingParams(temperature=1.0)] * 4)


def test_control_hf_moe_forward_differs():
    """The same check with the stock HF forward (bf16 experts, index_add in expert order) finds
    mismatches: the comparison can fail."""
    hf = tiny_model("qwen3moe-e8-k2", dtype=torch.bfloat16, seed=1)
    model = bitmatch.patch(copy.deepcopy(hf))
    params = [SamplingParams(temperature=1.0, max_tokens=6, seed=i) for i in range(4)]
    outs = Engine(model, max_num_seqs=4).generate(random_prompts(4, 4, 30, seed=11), params, use_tqdm=False)
    stock = hf_logprobs(hf, outs, 1.0)
    diff = sum(int((torch.tensor(o.outputs[0].logprobs) != s).sum()) for o, s in zip(outs, stock))
    assert diff > 0


def test_gradients_match_float64_router_included():
    m32 = tiny_model("qwen3moe-e8-k2", dtype=torch.float32, seed=6)
    m64 = copy.deepcopy(m32).double()
    m64.config._experts_implementation = "eager"  # HF's grouped_mm has no float64
    bitmatch.patch(m32)
    ids, mask = pad_batch(random_prompts(2, 6, 16, seed=2), "right")
    lp = bitmatch.token_logprobs(m32, ids, mask, temperature=0.8)
    (lp * mask[:, 1:]).sum().backward()
    logits = m64(input_ids=ids, attention_mask=mask).logits[:, :-1] / 0.8
    ref = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    (ref * mask[:, 1:]).sum().backward()
    g32, g64 = dict(m32.named_parameters()), dict(m64.named_parameters())
    checked = 0
    for n, p in g32.items():
        want = g64[n].grad
        if want is None or want.abs().max() == 0:
            continue
        err = ((p.grad.double() - want).norm() / want.norm()).item()
        assert err < 1e-4, f"{n}: relative grad error {err}"
        checked += 1
    assert any("mlp.gate.weight" in n for n in g32) and checked > 10
