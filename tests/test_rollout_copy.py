"""RolloutCopy on every registered family: an fp32-master trainer under bf16 compute and its copy
(big matrices in bf16, the family's ``fp32_parameters`` in fp32) give the engine the trainer's
logprobs bit for bit. Control: the same copy with the declared parameters in bf16 too differs
(Qwen3-MoE's router reads its weight in fp32), so the declaration is what makes it pass."""
from __future__ import annotations

import pytest
import torch
import transformers

import bitmatch
import bitmatch.sync as bsync
from bitmatch.engine import Engine, SamplingParams
from bitmatch.models.registry import families
from bitmatch.testing.models import pad_batch, random_prompts

BF16, F32 = torch.bfloat16, torch.float32
FAMILIES = {f.name: f for f in families()}
# the parameters each family reads in fp32, by the end of their HF names (found in the model code)
EXPECTED_FP32 = {
    "dense": (),
    "qwen3_moe": (".mlp.gate.weight",),
    "nemotron_h": (".norm.weight", ".norm_f.weight", ".A_log", ".D", ".mixer.gate.weight"),
    "deepseek_v4": ("_hc.fn", "_hc.base", "_hc.scale", "hc_head.hc_fn", "hc_head.hc_base", "hc_head.hc_scale",
                    ".mlp.gate.weight", ".self_attn.sinks", ".position_bias"),
}


def _trainer(fam):
    """An fp32-master tiny model of ``fam`` whose every weight and float buffer is off the bf16 grid
    (a weight that happens to be bf16-exact, as ones or zeros, would hide a missing declaration)."""
    cfg = fam.tiny_config()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        lm = transformers.AutoModelForCausalLM.from_config(cfg, dtype=F32).eval()
        with torch.no_grad():
            for _, p in lm.named_parameters():
                p.add_(torch.randn_like(p) * 1e-3)
            for n, b in lm.named_buffers():
                if n.endswith("e_score_correction_bias"):
                    b.copy_(torch.randn_like(b) * 0.05)
    bitmatch.patch(lm, compute_dtype=BF16)
    return lm


def _diff(lm, copy, n=6):
    """Max |engine logprob - trainer logprob| over ``n`` sampled sequences, and the tokens compared."""
    copy.publish(0)
    eng = Engine(copy.model, seed=0)
    sp = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    outs = eng.generate(random_prompts(n, 2, 12, seed=1), sp, use_tqdm=False)
    seqs = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
    ids, mask = pad_batch(seqs)
    with torch.no_grad():
        lp = bitmatch.token_logprobs(lm, ids, mask, temperature=1.0, compute_dtype=BF16)
    worst, tokens = 0.0, 0
    for b, o in enumerate(outs):
        p, c = len(o.prompt_token_ids), len(o.outputs[0].token_ids)
        got = torch.tensor(o.outputs[0].logprobs, dtype=F32)
        worst = max(worst, (got - lp[b, p - 1:p + c - 1].float()).abs().max().item())
        tokens += c
    return worst, tokens


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_copy_matches_trainer_bit_for_bit(name):
    fam = FAMILIES[name]
    lm = _trainer(fam)
    copy = bsync.RolloutCopy(lm, BF16)
    declared = fam.fp32_parameters(copy.model)
    want = {n for n, _ in copy.model.named_parameters(remove_duplicate=False) if n.endswith(EXPECTED_FP32[name])}
    assert declared == want, f"{name}: fp32_parameters {sorted(declared ^ want)[:6]} differ from the model code's"
    for n, p in copy.model.named_parameters(remove_duplicate=False):
        assert p.dtype == (F32 if n in declared else BF16), f"{name}: {n} stored in {p.dtype}"
    assert copy.model.lm_head.weight.dtype == BF16 and copy.model.get_input_embeddings().weight.dtype == BF16
    worst, tokens = _diff(lm, copy)
    assert tokens > 0 and worst == 0.0, f"{name}: engine vs trainer Diff = {worst} over {tokens} tokens"
    assert copy.differing() == []


def test_declared_parameters_in_bf16_differ(monkeypatch):
    fam = FAMILIES["qwen3_moe"]
    lm = _trainer(fam)
    monkeypatch.setattr(type(fam), "fp32_parameters", lambda self, m: set())
    copy = bsync.RolloutCopy(lm, BF16)
    assert all(p.dtype == BF16 for p in copy.model.parameters())
    worst, _ = _diff(lm, copy)
    assert worst > 0.0, "the router rounded to bf16 still matched: the control proves nothing"


def test_fp32_compute_stores_everything_in_fp32():
    lm = _trainer(FAMILIES["qwen3_moe"])
    copy = bsync.RolloutCopy(lm, F32)
    assert {p.dtype for p in copy.model.parameters()} == {F32}


def test_publish_goes_through_the_copys_sender():
    """``RolloutCopy.sender`` is the injection point for a sender that times or logs the publish
    (benchmarks/adapters/trl_step.py): the copy publishes through it, with the same bits as without."""
    lm = _trainer(FAMILIES["dense"])
    copy = bsync.RolloutCopy(lm, BF16)
    sends = []

    class Logged:
        def __init__(self, receiver):
            self.inner = bsync.InProcessSender(receiver)

        def send(self, model, version, dtype):
            sends.append(version)
            return self.inner.send(model, version, dtype)
    copy.sender = Logged(copy.receiver)
    copy.publish(3)
    assert sends == [3] and copy.require_ready(3) == 3 and copy.differing() == []
