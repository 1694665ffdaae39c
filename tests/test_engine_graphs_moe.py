"""Qwen3-MoE in the engine's CUDA-graph decode buckets: a real row's bits do not depend on the
padded batch bucket or the context bucket it runs in, graphs == eager, engine == trainer.

Two halves, as for the dense family (tests/test_engine_graphs.py):
- the engine on CPU: ``ModelRunner.simulate_buckets`` runs every pure-decode step eagerly on the
  padded inputs a graph replay gets (scratch block, padded rows decoding token 0, the context
  bucket's host bound and full-width block table), on the float64-exact reference kernels. The
  reference MoE is not sync-free (``unique``, ``nonzero``), which does not matter here: the
  simulation runs eagerly. The capture itself runs on the GPU (benchmarks/families/moe_e2e.py, graphs on).
- the MoE block on the Triton backend (interpreter, tiny shapes): no host read anywhere in its
  forward (what graph capture needs), and its real rows' bits unchanged by padded rows.
Controls: padded rows written into a real sequence's block (the dense control) and a
capacity-factor expert layer (GShard-style token dropping, the usual batch-variant MoE) fail.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import bitmatch
import bitmatch.kernels as K
from bitmatch.engine import SamplingParams
from bitmatch.engine.graphs import graph_safe
from bitmatch.models import family_of, unwrap_causal_lm
from bitmatch.models.qwen3_moe import Qwen3MoeFamily
from bitmatch.models.state import create_state, drop_state
from bitmatch.testing import same_outputs
from bitmatch.testing.models import random_prompts, tiny_model
from graph_buckets import eager_and_simulated, one_request_in_buckets, padding_into_a_real_block, run, staggered
from host_reads import host_reads
from test_engine import assert_bitmatch

# both layers sparse, 8 experts top-2; small attention (the reference kernels are slow per step)
TINY = dict(hidden_size=64, num_hidden_layers=2, mlp_only_layers=[], num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(scope="module")
def model():
    return bitmatch.patch(tiny_model("qwen3moe-e8-k2", dtype=torch.bfloat16, seed=1, **TINY))


def _staggered():
    return staggered(lo=3, hi=30)


@pytest.fixture(scope="module")
def runs(model):
    return eager_and_simulated(model, *_staggered(), decode_steps=5)


@pytest.fixture(scope="module")
def eager(runs):
    return runs[0]


@pytest.fixture(scope="module")
def simulated(runs):
    return runs[1]


# ---------------------------------------------------------------- the opt-in
def test_family_opts_into_graphs(model):
    assert graph_safe(model)
    assert graph_safe(tiny_model("qwen3moe-e4-k1-step2"))  # dense and sparse layers mixed

    class OwnMlp(Qwen3MoeFamily):  # a subclass with its own MLP must opt in again
        def mlp(self, *a, **kw):
            return super().mlp(*a, **kw)
    assert not OwnMlp().cuda_graph_safe(unwrap_causal_lm(model))


def test_lora_on_linears_keeps_the_moe_family_in_graphs():
    # LoRA on plain linears reads kept merged weights in the engine (tests/test_engine_graphs_lora.py);
    # a LoRA layer bitmatch's LoRA linear cannot run keeps the model eager
    peft = pytest.importorskip("peft")
    base = tiny_model("qwen3moe-e8-k2", dtype=torch.float32, **TINY)
    pm = peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    assert family_of(pm) is family_of(base)
    assert graph_safe(pm)
    layer = unwrap_causal_lm(pm).model.layers[0].self_attn.q_proj
    layer.fan_in_fan_out = True
    assert not graph_safe(pm)


def test_tensor_parallel_models_stay_eager():
    # a model registered for tensor parallelism (bitmatch.parallel) runs its steps eagerly
    m = tiny_model("qwen3moe-e8-k2", dtype=torch.float32, **TINY)
    lm = unwrap_causal_lm(m)
    assert graph_safe(m)
    create_state(lm).tp = object()
    try:
        assert not graph_safe(m)
    finally:
        drop_state(lm, "tp")


# ---------------------------------------------------------------- the MoE block on Triton
def _block(dtype=torch.bfloat16):
    m = tiny_model("qwen3moe-e8-k2", dtype=dtype, seed=2, hidden_size=32, moe_intermediate_size=16,
                   num_hidden_layers=1, mlp_only_layers=[])
    lm = unwrap_causal_lm(m)
    return family_of(m), lm.model.layers[0].mlp, lm.config.hidden_size


def _triton_mlp(fam, mlp, x):
    with K.use_backend("triton"), torch.no_grad():
        return fam.mlp(mlp, x, x.dtype)


@pytest.mark.interpreter
def test_moe_block_triton_forward_reads_nothing_on_the_host_on_cuda():
    pytest.importorskip("triton")
    fam, mlp, H = _block()
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with host_reads() as reads:
        _triton_mlp(fam, mlp, x)
    # the expert-id range check goes to the device (torch._assert_async) on the Triton backend,
    # the branch CUDA takes; the reference backend's check reads on the host (the control below)
    assert not reads, reads


def test_control_reference_moe_block_reads_on_the_host():
    # the detector's control: the CPU reference (unique + nonzero + tolist per expert) is caught
    fam, mlp, H = _block()
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with host_reads() as reads, torch.no_grad():
        fam.mlp(mlp, x, x.dtype)
    found = {what for what, _ in reads}
    assert {"aten._unique2", "aten.nonzero", "Tensor.tolist"} <= found, found


def _capacity_dropping(orig, factor=1.0):
    """GShard/Switch-style experts: each expert keeps its first int(factor * T * k / E) rows (in
    token order) and drops the rest: the capacity grows with the batch, so padding changes it."""
    def experts(x, ids, weights, w_in, w_out, **kw):
        T, k = ids.shape
        E = w_in.shape[0]
        cap = max(1, int(factor * T * k / E))
        flat = ids.reshape(-1)
        rank_in_expert = (F.one_hot(flat, E).cumsum(0) - 1).gather(1, flat[:, None])[:, 0]
        return orig(x, ids, weights * (rank_in_expert < cap).view(T, k), w_in, w_out, **kw)
    return experts


@pytest.mark.interpreter
def test_moe_block_triton_real_rows_same_bits_in_every_bucket(monkeypatch):
    pytest.importorskip("triton")
    fam, mlp, H = _block()
    g = torch.Generator().manual_seed(3)
    real = torch.randn(3, H, generator=g).to(torch.bfloat16)
    real[2] = real[0]  # two rows on the same experts: a capacity of 1 per expert drops one of them
    pad_row = torch.randn(1, H, generator=g).to(torch.bfloat16)  # what padded rows carry (token 0's state)

    def in_bucket(b):
        return _triton_mlp(fam, mlp, torch.cat([real, pad_row.expand(b - 3, H)]))[:3]
    alone = in_bucket(3)
    for b in (4, 8, 16):  # 16 rows x top-2: the 64-row tile config, not the 16-row one
        torch.testing.assert_close(in_bucket(b).view(torch.int16), alone.view(torch.int16), rtol=0, atol=0)
    # control: capacity-limited experts see the padding (capacity 1 alone, 2 in bucket 8)
    monkeypatch.setattr(K, "moe_experts", _capacity_dropping(K.moe_experts))
    assert not torch.equal(in_bucket(8), in_bucket(3))


# ---------------------------------------------------------------- the engine (simulated graphs)
def test_padded_buckets_same_bits_as_eager(eager, simulated):
    assert same_outputs(eager, simulated)


def test_same_request_in_every_batch_bucket(model):
    # one fixed request, alone and with 2 and 6 neighbours (buckets 1, 4, 8; 1 padded row in the
    # last two): identical bits
    runs = one_request_in_buckets(model, (0, 2, 6), target_len=17, others_hi=25, decode_steps=3)
    assert all(same_outputs([runs[0]], [r]) for r in runs[1:])


def test_same_request_in_every_context_bucket(model, monkeypatch):
    # the same two requests under graphs captured up to 32, 128 and 1024 tokens: the decode steps
    # run at host bounds 32, 128, 512 and with block tables 2, 8, 64 blocks wide
    import bitmatch.engine.graphs as G
    import bitmatch.engine.model_runner as MR
    seen = []
    orig = MR.forward_hidden

    def spy(model, ids, ctx, *a, **kw):
        if ctx.max_query_len == 1:
            seen.append((ctx.max_seq_len, ctx.block_table.shape[1]))
        return orig(model, ids, ctx, *a, **kw)
    for engine_module in (MR, G):   # the engine's call sites (each imports forward_hidden at its top)
        monkeypatch.setattr(engine_module, "forward_hidden", spy)
    prompts = random_prompts(2, 9, 20, seed=8)
    params = [SamplingParams(temperature=0.9, max_tokens=4, ignore_eos=True, seed=i) for i in range(2)]
    runs = []
    for cap in (32, 128, 1024):
        seen.clear()
        eng, outs = run(model, prompts, params, simulate=True, max_seq_len_to_capture=cap)
        assert eng.model_runner.num_simulated_steps == 3
        assert set(seen) == {(min(cap, 512), -(-cap // 16))}, (cap, seen)
        runs.append(outs)
    assert all(same_outputs(runs[0], r) for r in runs[1:])


def test_engine_equals_trainer_with_graphs(model, simulated):
    # Diff = 0: the simulated-graph engine's logprobs are token_logprobs' on the same tokens, in
    # right-padded batches of 5 (another batch than the engine's)
    _, params = _staggered()
    assert assert_bitmatch(model, simulated, params) == sum(sp.max_tokens for sp in params)


def test_control_padding_into_a_real_block_changes_bits(model, eager, monkeypatch):
    # the dense tests' control: padded rows write into a real sequence's block, not the scratch block
    prompts, params = _staggered()
    with padding_into_a_real_block(monkeypatch):
        _, got = run(model, prompts, params, simulate=True)
    assert not same_outputs(eager, got)
