"""DeepSeek-V4 in the engine's CUDA-graph decode buckets: a real row's bits do not depend on the
padded batch bucket or the context bucket it runs in, engine == trainer, and the graph opt-in
(``DeepseekV4Family.cuda_graph_safe``) only where the decode step reads nothing back.

As for Qwen3-MoE (tests/test_engine_graphs_moe.py):
- the engine on CPU: ``ModelRunner.simulate_buckets`` runs every pure-decode step eagerly on the
  padded inputs a graph replay gets (scratch block, padded rows decoding token 0, the context
  bucket's host bound and full-width block table), on the reference kernels. The simulation needs
  the family's opt-in; it is forced on here (the simulation is eager, so a host read does not
  matter to it).
- the opt-in: on the Triton backend (interpreter) the mHC / MoE / head ops read nothing on the
  host, nor does a whole decode step after the first (which builds the rope tables, as a graph's
  warm-up run does): what ``cuda_graph_safe`` claims. The capture itself runs on the GPU.
Control: padded rows written into a real sequence's block change the bits.
"""
from __future__ import annotations

import pytest
import torch

import bitmatch
import bitmatch.kernels as K
from bitmatch.engine import SamplingParams
from bitmatch.engine.graphs import graph_safe
from bitmatch.models import deepseek_v4 as V4, family_of, unwrap_causal_lm
from bitmatch.models.deepseek_v4_tiny import tiny_model
from bitmatch.testing import same_outputs
from bitmatch.testing.models import random_prompts
from graph_buckets import (
    decode_step_reads,
    eager_and_simulated,
    lora_updates_keep_the_bits,
    one_request_in_buckets,
    opt_in_needs_runnable_lora,
    padding_into_a_real_block,
    run,
    staggered,
    stale_kept_weights,
)
from test_engine import assert_bitmatch

OPT_IN = V4.DeepseekV4Family.cuda_graph_safe  # the family's own, before any fixture forces it on


@pytest.fixture(scope="module")
def simulate_graphs():
    """The family's decode graphs forced on (CPU simulation only: there is no capture here)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(V4.DeepseekV4Family, "cuda_graph_safe", lambda self, lm: True)
        yield


@pytest.fixture(scope="module")
def model():
    return bitmatch.patch(tiny_model(torch.bfloat16, seed=1))


def _staggered():
    # prompts long enough to close CSA (rate 2) and HCA (rate 4) windows while decoding
    return staggered(lo=5, hi=14)


@pytest.fixture(scope="module")
def runs(model, simulate_graphs):
    return eager_and_simulated(model, *_staggered(), decode_steps=5)


@pytest.fixture(scope="module")
def eager(runs):
    return runs[0]


@pytest.fixture(scope="module")
def simulated(runs):
    return runs[1]


# ---------------------------------------------------------------- the engine (simulated graphs)
def test_padded_buckets_same_bits_as_eager(eager, simulated):
    assert same_outputs(eager, simulated)


def test_same_request_in_every_batch_bucket(model, simulate_graphs):
    # one fixed request alone and with 2 and 6 neighbours (buckets 1, 4, 8): identical bits
    runs = one_request_in_buckets(model, (0, 2, 6), target_len=13, others_hi=16, decode_steps=3)
    assert all(same_outputs([runs[0]], [r]) for r in runs[1:])


def test_same_request_in_every_context_bucket(model, simulate_graphs):
    # graphs captured up to 32 and 1024 tokens: host bounds 32 / 512, block tables 2 / 64 wide
    prompts = random_prompts(2, 9, 14, seed=8)
    params = [SamplingParams(temperature=0.9, max_tokens=4, ignore_eos=True, seed=i) for i in range(2)]
    runs = [run(model, prompts, params, simulate=True, max_seq_len_to_capture=cap)[1] for cap in (32, 1024)]
    assert same_outputs(runs[0], runs[1])


def test_engine_equals_trainer_with_graphs(model, simulated):
    # Diff = 0: the simulated-graph engine's logprobs are token_logprobs' on the same tokens
    _, params = _staggered()
    assert assert_bitmatch(model, simulated, params) == sum(sp.max_tokens for sp in params)


def test_control_padding_into_a_real_block_changes_bits(model, eager, monkeypatch):
    prompts, params = _staggered()
    with padding_into_a_real_block(monkeypatch):
        _, got = run(model, prompts, params, simulate=True)
    assert not same_outputs(eager, got)


# ---------------------------------------------------------------- the opt-in
def _mhc_moe_head(m, ids):
    """The mHC / MoE / head ops of a decode step alone (layer 0: hash routing, layer 1: learned)."""
    lm = unwrap_causal_lm(m)
    spec, layer = family_of(m).build_spec(lm), lm.model.layers[0]
    streams = torch.randn(ids.shape[0], spec.hc_mult, spec.hidden_size).to(torch.bfloat16)
    head = lm.model.hc_head
    post, comb, x = V4._hc(streams, layer.attn_hc, spec)
    y = V4.moe_block(layer.mlp, x, ids, spec, 0, torch.bfloat16)
    streams = K.hc_post(streams, y, post, comb)
    K.hc_head(streams, head.hc_fn, head.hc_base, head.hc_scale, eps=1e-6, norm_eps=1e-6)
    V4.moe_block(lm.model.layers[1].mlp, x, ids, spec, 1, torch.bfloat16)


def _decode_step_reads(model, part: str, backend: str = "triton"):
    """Host reads of a simulated pure-decode step on ``backend``: of the whole forward (part
    "step"; the second decode step: the first builds the rope tables once, as a graph's warm-up
    run does) or of the mHC / MoE / head ops alone (part "mhc_moe")."""
    return decode_step_reads(model, random_prompts(3, 4, 6, seed=3),
                             SamplingParams(temperature=0.8, max_tokens=3, ignore_eos=True), backend,
                             part=_mhc_moe_head if part == "mhc_moe" else None)


@pytest.mark.interpreter
def test_mhc_moe_and_head_read_nothing_on_the_host(model, simulate_graphs):
    reads = _decode_step_reads(model, "mhc_moe")
    assert not reads, reads


@pytest.mark.interpreter
def test_decode_step_reads_nothing_on_the_host(model, simulate_graphs):
    # what cuda_graph_safe claims: the batched attention and everything else, after the warm-up
    reads = _decode_step_reads(model, "step")
    assert not reads, reads


def test_control_reference_decode_step_reads_on_the_host(model, simulate_graphs):
    # the detector's control: the CPU reference (host-side grouping, exact CPU math) is caught
    assert _decode_step_reads(model, "step", backend="reference")


def test_family_opts_into_graphs(model, monkeypatch):
    monkeypatch.setattr(V4.DeepseekV4Family, "cuda_graph_safe", OPT_IN)
    assert graph_safe(model)
    assert graph_safe(tiny_model(torch.bfloat16, seed=2, mlp_layer_types=["moe"] * 4))

    class OwnForward(V4.DeepseekV4Family):  # a subclass with its own forward must opt in again
        def forward_hidden(self, *a, **kw):
            return super().forward_hidden(*a, **kw)
    assert not OwnForward().cuda_graph_safe(unwrap_causal_lm(model))


# ---------------------------------------------------------------- LoRA in the graphs
LORA_TARGETS = ["q_a_proj", "q_b_proj", "kv_proj", "o_b_proj"]


def _lora_model():
    peft = pytest.importorskip("peft")
    base = tiny_model(torch.bfloat16, seed=2)
    torch.manual_seed(3)
    pm = peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=4, target_modules=LORA_TARGETS, lora_dropout=0.0,
                                                   init_lora_weights=False))
    return bitmatch.patch(pm.eval())


def test_lora_models_opt_into_graphs():
    opt_in_needs_runnable_lora(_lora_model(), lambda pm: OPT_IN(family_of(pm), unwrap_causal_lm(pm)))


def test_lora_buckets_and_trainer_across_weight_updates(simulate_graphs):
    # the attention projections read from the kept merged weights in padded buckets: same bits as
    # eager and as token_logprobs, before and after an update of A and B between generate calls
    lora_updates_keep_the_bits(_lora_model(), *_staggered(), assert_bitmatch)


def test_control_lora_stale_kept_weight_differs(simulate_graphs, monkeypatch):
    pm = _lora_model()
    prompts, params = _staggered()
    outs = stale_kept_weights(pm, prompts, params, monkeypatch)
    with pytest.raises(AssertionError, match="differ"):
        assert_bitmatch(pm, outs, params)


@pytest.mark.interpreter
def test_lora_decode_step_reads_nothing_on_the_host(simulate_graphs):
    # what the opt-in claims with LoRA layers: their engine forward reads the kept weight
    reads = _decode_step_reads(_lora_model(), "step")
    assert not reads, reads
