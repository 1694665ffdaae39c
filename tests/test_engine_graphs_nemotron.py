"""Nemotron-H (hybrid Mamba2 / attention / MLP / MoE) in the engine's CUDA-graph decode buckets: a
real row's bits do not depend on the padded batch bucket or the context bucket it runs in, engine ==
trainer, and the graph opt-in (``NemotronHFamily.cuda_graph_safe``) only where the decode step
reads nothing back.

As for the other families (tests/graph_buckets.py):
- the engine on CPU: ``ModelRunner.simulate_buckets`` runs every pure-decode step eagerly on the
  padded inputs a graph replay gets: padded rows decode token 0 in the scratch block AND the
  scratch state slot (the Mamba layers' per-sequence conv / SSM state and open-chunk buffers), on
  the reference kernels. Decode steps cross Mamba chunk boundaries (the chunk closes inside a
  graph step and folds the open chunk into the state). A bucket's first step runs twice, as a
  capture does (warm-up, then the replay): the warm-up writes into the scratch block and slot only.
- the opt-in: on the Triton backend (interpreter) a whole decode step reads nothing on the host
  (conv, scan, gated norm, attention with host bounds, MoE). The capture itself runs on the GPU.
Controls: padded rows written into a real sequence's K/V block, or given a real sequence's state
slot, or a capture's warm-up on the rows' real state slots, change the bits; the reference
backend's decode step reads on the host (the probe works).
"""
from __future__ import annotations

import pytest
import torch

import bitmatch
from bitmatch.engine import SamplingParams, model_runner
from bitmatch.engine.graphs import graph_safe
from bitmatch.models import nemotron_h as NH, unwrap_causal_lm
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

# every block type (Mamba, attention, MLP, MoE); a chunk of 8 so decode crosses chunk boundaries
CHUNK = 8


@pytest.fixture(scope="module")
def model():
    return bitmatch.patch(NH.FAMILY.tiny_model(dtype=torch.bfloat16, seed=1, chunk_size=CHUNK))


def _staggered():
    return staggered(lo=5, hi=14)


@pytest.fixture(scope="module")
def runs(model):
    return eager_and_simulated(model, *_staggered(), decode_steps=5)


@pytest.fixture(scope="module")
def eager(runs):
    return runs[0]


@pytest.fixture(scope="module")
def simulated(runs):
    return runs[1]


# ---------------------------------------------------------------- the engine (simulated graphs)
def test_the_model_has_every_block_type(model):
    kinds = set(NH.FAMILY.build_spec(unwrap_causal_lm(model)).block_types)
    assert kinds == {NH.MAMBA, NH.ATTN, NH.MLP, NH.MOE}, kinds


def test_padded_buckets_same_bits_as_eager(eager, simulated):
    assert same_outputs(eager, simulated)


def test_same_request_in_every_batch_bucket(model):
    # one fixed request alone and with 2 and 6 neighbours (buckets 1, 4, 8): identical bits; its
    # 13-token prompt and 4 new tokens cross the chunk boundary at position 16 while decoding
    runs = one_request_in_buckets(model, (0, 2, 6), target_len=13, others_hi=16, decode_steps=3)
    assert all(same_outputs([runs[0]], [r]) for r in runs[1:])


def test_same_request_in_every_context_bucket(model):
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


def test_control_padding_into_a_real_state_slot_changes_bits(model, eager, monkeypatch):
    # padded rows decode in the last real row's Mamba state slot instead of the scratch one (the
    # last row: the staggered batch's longest-lived request, which reads its state again)
    orig = model_runner.ModelRunner.pad

    def bad_pad(self, inp, bucket):
        p = orig(self, inp, bucket)
        if bucket > inp.B:
            p.state_slots = p.state_slots.copy()
            p.state_slots[inp.B:] = inp.state_slots[inp.B - 1]
        return p
    monkeypatch.setattr(model_runner.ModelRunner, "pad", bad_pad)
    prompts, params = _staggered()
    _, got = run(model, prompts, params, simulate=True)
    assert not same_outputs(eager, got)


def test_control_capture_warmup_on_the_real_slots_changes_bits(model, eager, monkeypatch):
    # the GPU's capture runs a bucket's first step once more before the replay; a warm-up on the
    # rows' real state slots advances their conv / SSM state, and the replay reads that update
    def on_real_slots(runner, slot_mapping, state_slots, step):
        return step()
    monkeypatch.setattr(model_runner, "warm_up_on_scratch", on_real_slots)
    prompts, params = _staggered()
    _, got = run(model, prompts, params, simulate=True)
    assert not same_outputs(eager, got)


def test_capture_warmup_writes_only_the_scratch_block_and_slot(model, monkeypatch):
    # every cache's last block / slot is the scratch one; the rest is as before the warm-up
    orig, warmups = model_runner.warm_up_on_scratch, []

    def checked(runner, slot_mapping, state_slots, step):
        caches = [t for g in runner.caches.values() for entry in g.values() for t in entry]
        before = [t[:-1].clone() for t in caches]
        out = orig(runner, slot_mapping, state_slots, step)
        assert all(torch.equal(b, t[:-1]) for b, t in zip(before, caches))
        warmups.append(int(slot_mapping.numel()))
        return out
    monkeypatch.setattr(model_runner, "warm_up_on_scratch", checked)
    eng, _ = run(model, *_staggered(), simulate=True)
    assert warmups and eng.model_runner.num_simulated_steps > len(warmups)


# ---------------------------------------------------------------- the opt-in
def _decode_step_reads(model, backend: str = "triton"):
    """Host reads of the second simulated pure-decode step's forward on ``backend`` (Triton: the
    interpreter; the Triton scan needs chunks >= 16)."""
    return decode_step_reads(model, random_prompts(3, 13, 18, seed=3),
                             SamplingParams(temperature=0.8, max_tokens=3, ignore_eos=True), backend)


@pytest.fixture(scope="module")
def model16():
    return bitmatch.patch(NH.FAMILY.tiny_model(dtype=torch.bfloat16, seed=1, chunk_size=16))


@pytest.mark.interpreter
def test_decode_step_reads_nothing_on_the_host(model16):
    # what cuda_graph_safe claims: Mamba conv / scan / gated norm, attention, MLP, MoE, norms
    reads = _decode_step_reads(model16)
    assert not reads, reads


def test_control_reference_decode_step_reads_on_the_host(model16):
    # the detector's control: the CPU reference (host-side per-sequence loops) is caught
    assert _decode_step_reads(model16, backend="reference")


def test_family_opts_into_graphs(model):
    assert graph_safe(model)

    class OwnForward(NH.NemotronHFamily):  # a subclass with its own forward must opt in again
        def forward_hidden(self, *a, **kw):
            return super().forward_hidden(*a, **kw)
    assert not OwnForward().cuda_graph_safe(unwrap_causal_lm(model))


# ---------------------------------------------------------------- LoRA in the graphs
LORA_TARGETS = ["in_proj", "q_proj", "o_proj", "up_proj", "down_proj"]  # PEFT refuses conv1d / out_proj on Mamba


def _lora_model(chunk=CHUNK):
    peft = pytest.importorskip("peft")
    base = NH.FAMILY.tiny_model(dtype=torch.bfloat16, seed=2, chunk_size=chunk)
    torch.manual_seed(3)
    pm = peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=4, target_modules=LORA_TARGETS, lora_dropout=0.0,
                                                   init_lora_weights=False))
    return bitmatch.patch(pm.eval())


def test_lora_models_opt_into_graphs():
    opt_in_needs_runnable_lora(_lora_model(), graph_safe)


@pytest.mark.interpreter
def test_lora_decode_step_reads_nothing_on_the_host():
    # what the opt-in claims with LoRA layers: their engine forward reads the kept weight, host-side
    # bookkeeping only (the Triton scan needs chunks >= 16)
    reads = _decode_step_reads(_lora_model(chunk=16))
    assert not reads, reads


def test_lora_buckets_and_trainer_across_weight_updates():
    # every LoRA'd projection of the hybrid (Mamba in_proj, attention, MLP and shared expert) read
    # from the kept merged weight in padded buckets: same bits as eager and as token_logprobs, before
    # and after an update of A and B between generate calls (the engine refreshes the kept weights)
    lora_updates_keep_the_bits(_lora_model(), *_staggered(), assert_bitmatch)


def test_control_lora_stale_kept_weight_differs(monkeypatch):
    # the comparison above sees a kept weight left stale after an update
    pm = _lora_model()
    prompts, params = _staggered()
    outs = stale_kept_weights(pm, prompts, params, monkeypatch)
    with pytest.raises(AssertionError, match="differ"):
        assert_bitmatch(pm, outs, params)
