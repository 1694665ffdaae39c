"""TRL adapter end to end: real trl.GRPOTrainer on CPU, tiny Qwen3 built in code, bitmatch.Engine rollouts.

Every generation step is checked by the adapter itself (on_mismatch="raise"): a run that finishes
proves Diff = 0 on each step; the tests also read the per-step history and TRL's logged metrics.
The control runs stock TRL with a logprob-reporting HF-generate rollout and must find mismatches.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("peft")

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from bitmatch.testing.trl import assert_trained, grpo_trainer, logged, params_snapshot, tiny_policy  # noqa: E402


def make_trainer(tmp_path, steps=5, lora=False, rollout_func=None, **over):
    """A tiny GRPO run on the toy task: 2 prompts x 4 generations, 6 completion tokens, T=0.9."""
    kw = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=6,
              learning_rate=2e-2 if lora else 3e-3)
    kw.update(over)
    peft_config = None
    if lora:
        from peft import LoraConfig
        peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                                 target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"])
    return grpo_trainer(tiny_policy(), tmp_path / "out", steps, peft_config=peft_config,
                        rollout_func=rollout_func, **kw)


# ----------------------------------------------------------------------------- dense

@pytest.mark.parametrize("rollout_weights", ["shared", "copy"])
def test_grpo_five_steps_diff_zero(tmp_path, rollout_weights):
    import bitmatch.adapters.trl as bt

    trainer = bt.attach(make_trainer(tmp_path), rollout_weights=rollout_weights)
    before = params_snapshot(trainer.model)
    trainer.train()
    hist = trainer._bitmatch.history
    assert [h.step for h in hist] == [0, 1, 2, 3, 4]          # one check per generation step
    assert all(h.total > 0 and h.mismatches == 0 and h.diff_max == 0.0 and h.kl_k3 == 0.0 for h in hist), hist
    assert logged(trainer, "bitmatch/diff_max") == [0.0] * 5
    assert logged(trainer, "bitmatch/mismatch_tokens") == [0.0] * 5
    assert logged(trainer, "bitmatch/kl_k3") == [0.0] * 5
    # what the zeros are over: every step's tokens and its 8 completions (2 prompts x 4 generations)
    assert logged(trainer, "bitmatch/compared_tokens") == [float(h.total) for h in hist]
    assert logged(trainer, "bitmatch/compared_seqs") == [8.0] * 5
    assert_trained(before, trainer.model)
    if rollout_weights == "copy":   # a fingerprint-verified publish per optimizer step
        assert trainer._bitmatch.receiver.version == 4
        assert trainer._bitmatch.rollout_model is trainer._bitmatch.engine.model


def _hf_rollout(prompts, trainer):
    """Stock rollout with logprobs: HF generate, log_softmax(logits / T) of the sampled tokens (vLLM's rule)."""
    from trl.models import unwrap_model_for_generation

    tok = trainer.processing_class
    prompt_ids = [tok(p)["input_ids"] for p in prompts]
    L = max(map(len, prompt_ids))
    ids = torch.tensor([[tok.pad_token_id] * (L - len(p)) + p for p in prompt_ids])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompt_ids])
    with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as m, torch.no_grad():
        out = m.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=trainer.temperature,
                         top_k=0, top_p=1.0, max_new_tokens=trainer.max_completion_length,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         output_logits=True, return_dict_in_generate=True)
    comp = out.sequences[:, L:]
    lps = torch.stack([torch.log_softmax(lg.float() / trainer.temperature, -1) for lg in out.logits], 1)
    lps = lps.gather(-1, comp.unsqueeze(-1)).squeeze(-1)
    completion_ids, logprobs = [], []
    for c, lp in zip(comp.tolist(), lps.tolist()):
        n = c.index(tok.eos_token_id) + 1 if tok.eos_token_id in c else len(c)
        completion_ids.append(c[:n])
        logprobs.append(lp[:n])
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}


def test_control_stock_trl_has_nonzero_diff(tmp_path):
    """The same run without bitmatch: stock trainer logprobs vs a stock rollout's differ."""
    import bitmatch.adapters.trl as bt

    trainer = bt.watch(make_trainer(tmp_path, rollout_func=_hf_rollout), on_mismatch="log")
    trainer.train()
    hist = trainer._bitmatch.history
    assert len(hist) == 5 and all(h.total > 0 for h in hist)
    assert sum(h.mismatches for h in hist) > 0, hist
    assert max(h.diff_max for h in hist) > 0.0
    assert max(logged(trainer, "bitmatch/mismatch_tokens")) > 0


def test_grad_accumulation_and_num_iterations_diff_zero(tmp_path):
    """gradient_accumulation_steps=2, num_iterations=2: TRL computes old logprobs at generation time;
    they (the first iteration's) equal the rollout's."""
    import bitmatch.adapters.trl as bt

    trainer = bt.attach(make_trainer(tmp_path, steps=4, gradient_accumulation_steps=2, num_iterations=2,
                                     per_device_train_batch_size=4))
    trainer.train()
    hist = trainer._bitmatch.history
    assert len(hist) == 2 and all(h.total > 0 and h.mismatches == 0 for h in hist), hist
    assert all("old_per_token_logps" in b for b in trainer._buffered_inputs)


@pytest.mark.parametrize("check_at", ["loss", "generation"])
def test_check_uses_the_loss_logprobs_without_an_extra_forward(tmp_path, check_at, monkeypatch):
    """TRL's default (num_iterations=1, aligned accumulation) keeps no old logprobs. check_at="loss"
    compares the rollout with the logprobs the loss computes, collected over the generation's
    micro-batches (here 2 of 4 sequences each): one trainer forward per micro-batch, not one more
    per generation; "generation" pays that extra forward. Both prove Diff = 0."""
    import bitmatch
    import bitmatch.adapters.trl as bt

    trainer = bt.attach(make_trainer(tmp_path, steps=3, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                     steps_per_generation=2))
    trainer._bitmatch.check_at = check_at
    calls = []
    real = bitmatch.token_logprobs
    monkeypatch.setattr(bitmatch, "token_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
    trainer.train()
    hist = trainer._bitmatch.history
    assert [h.step for h in hist] == [0, 1, 2], hist
    assert all(h.total > 0 and h.mismatches == 0 and h.seqs == 8 for h in hist), hist
    assert logged(trainer, "bitmatch/compared_seqs") == [8.0] * 3
    assert len(calls) == 3 * (2 if check_at == "loss" else 3)
    assert not trainer._bitmatch._deferred


def test_deferred_check_sees_weights_changed_before_the_loss(tmp_path):
    """Control for the loss-time check: a weight changed between the rollout and the loss (behind
    the optimizer) makes the loss's logprobs differ from the rollout's, and the check names it."""
    import bitmatch.adapters.trl as bt

    trainer = bt.attach(make_trainer(tmp_path, steps=2), on_mismatch="log")
    bm = trainer._bitmatch
    loss = bm._orig["_compute_loss"]

    def corrupt_then_loss(model, inputs):
        if trainer.state.global_step == 1:
            with torch.no_grad():
                trainer.model.model.layers[0].mlp.down_proj.weight.mul_(1.5)
        return loss(model, inputs)

    bm._orig["_compute_loss"] = corrupt_then_loss
    trainer.train()
    assert [h.mismatches == 0 for h in bm.history] == [True, False], bm.history


# ----------------------------------------------------------------------------- LoRA

@pytest.mark.parametrize("mode", ["auto", "copy"])
def test_lora_grpo_diff_zero(tmp_path, mode):
    import bitmatch.adapters.trl as bt

    trainer = bt.attach(make_trainer(tmp_path, lora=True), rollout_weights=mode)
    assert trainer._bitmatch.rollout_weights == ("shared" if mode == "auto" else "copy")
    base_before = {k: v.detach().clone() for k, v in trainer.model.named_parameters() if "lora_" not in k}
    lora_before = params_snapshot(trainer.model)
    assert lora_before and all("lora_" in k for k in lora_before)
    trainer.train()
    hist = trainer._bitmatch.history
    assert len(hist) == 5 and all(h.total > 0 and h.mismatches == 0 for h in hist), hist
    assert_trained(lora_before, trainer.model)
    for k, v in trainer.model.named_parameters():   # never merged/unmerged in place: base weights untouched
        if k in base_before:
            assert torch.equal(v.detach(), base_before[k]), k
    if mode == "auto":  # shared: the engine read kept merged weights, no copy
        assert trainer._bitmatch.rollout_model is None
        return
    # the rollout copy holds the merged weights of the last step, not the base ones
    view = dict(trainer._bitmatch.rollout_model.named_parameters())
    w = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(view[w], base_before[f"base_model.model.{w}".replace(".weight", ".base_layer.weight")])


def test_fault_in_rollout_copy_raises_and_names_layer(tmp_path):
    import bitmatch.adapters.trl as bt

    trainer = bt.attach(make_trainer(tmp_path, lora=True), rollout_weights="copy")
    bm = trainer._bitmatch
    sync = bm.sync_rollout

    def sync_then_corrupt():
        sync()
        if trainer.state.global_step == 2:   # one weight of the rollout copy only
            with torch.no_grad():
                # through .data: behind the receiver's version counters (an in-place mul_ would be
                # refused before the step; tests/test_sync_security.py), so the step check must find it
                bm.rollout_model.model.layers[1].mlp.down_proj.weight.data.mul_(1.5)

    bm.sync_rollout = sync_then_corrupt
    with pytest.raises(bt.BitmatchMismatchError) as ei:
        trainer.train()
    msg = str(ei.value)
    assert "at step 2" in msg
    assert "First divergent layer: layers.1.mlp.down_proj" in msg
    assert "'model.layers.1.mlp.down_proj.weight'" in msg
    assert "First divergence: sequence" in msg and "(0x" in msg
    assert [h.mismatches == 0 for h in bm.history] == [True, True, False]
    path = bm.history[-1].bundle
    assert path and path in msg and os.path.isfile(os.path.join(path, "config.json"))
    tokens = torch.load(os.path.join(path, "tokens.pt"))
    assert tokens["completion_ids"].shape == tokens["rollout_logprobs"].shape
    import json
    cfg = json.load(open(os.path.join(path, "config.json")))
    assert cfg["step"] == 2 and cfg["weights_fingerprint"] and cfg["first_divergence"]["rollout_hex"].startswith("0x")


def test_on_mismatch_log_keeps_training(tmp_path):
    import bitmatch.adapters.trl as bt

    trainer = bt.attach(make_trainer(tmp_path, steps=2), rollout_weights="copy", on_mismatch="log")
    bm = trainer._bitmatch
    sync = bm.sync_rollout

    def sync_then_corrupt():
        sync()
        with torch.no_grad():  # behind the receiver's version counters (.data): the step check must see it
            bm.rollout_model.model.layers[0].self_attn.o_proj.weight.data.mul_(2.0)

    bm.sync_rollout = sync_then_corrupt
    trainer.train()
    assert len(bm.history) == 2 and all(h.mismatches > 0 for h in bm.history)
    assert all(v > 0 for v in logged(trainer, "bitmatch/mismatch_tokens"))
    assert "layers.0.self_attn.o_proj" in bm.history[0].message


# ----------------------------------------------------------------------------- errors, vLLM

def test_errors_name_the_fix(tmp_path):
    import bitmatch.adapters.trl as bt

    with pytest.raises(ValueError, match="on_mismatch must be one of"):
        bt.attach(make_trainer(tmp_path, steps=1), on_mismatch="explode")
    with pytest.raises(ValueError, match=r"min_p"):
        bt.attach(make_trainer(tmp_path, steps=1, min_p=0.1))
    with pytest.raises(ValueError, match=r"rollout_weights must be 'auto', 'shared' or 'copy'"):
        bt.attach(make_trainer(tmp_path, steps=1, lora=True), rollout_weights="merged")
    tr = bt.attach(make_trainer(tmp_path, steps=1))
    with pytest.raises(RuntimeError, match="already attached"):
        bt.attach(tr)


def test_engine_takes_trls_colocate_memory_share(tmp_path):
    # GRPOConfig.vllm_gpu_memory_utilization is the engine's own share, as for TRL's colocated
    # vLLM; an explicit budget in engine_kwargs wins
    import bitmatch.adapters.trl as bt

    tr = bt.attach(make_trainer(tmp_path, steps=1, vllm_gpu_memory_utilization=0.25))
    assert tr._bitmatch.engine_budget() == dict(gpu_memory_utilization=0.25, memory_share="engine")
    tr.train()
    assert tr._bitmatch.engine is not None
    tr = bt.attach(make_trainer(tmp_path / "b", steps=1), engine_kwargs=dict(kv_cache_bytes=2 ** 26))
    assert tr._bitmatch.engine_budget() == {}


def test_engine_runs_trls_whole_generation_batch(tmp_path):
    # max_num_seqs as TRL's colocated vLLM: per_device_train_batch_size * steps_per_generation
    # (one round of decode steps for the whole generation batch); engine_kwargs wins
    import bitmatch.adapters.trl as bt

    tr = bt.attach(make_trainer(tmp_path, steps=1))
    args = tr.args
    want = args.per_device_train_batch_size * args.steps_per_generation
    assert tr._bitmatch.engine_batch() == dict(max_num_seqs=want)
    tr.train()
    assert tr._bitmatch.engine.max_num_seqs == want
    tr = bt.attach(make_trainer(tmp_path / "b", steps=1), engine_kwargs=dict(max_num_seqs=3))
    assert tr._bitmatch.engine_batch() == {}


def test_use_vllm_without_plugin_enabled_is_refused(tmp_path, monkeypatch):
    """use_vllm=True needs the bitmatch vLLM plugin enabled (BITMATCH=1) before vLLM is built;
    the colocate run itself is tests/test_trl_vllm.py."""
    import bitmatch.adapters.trl as bt

    monkeypatch.delenv("BITMATCH", raising=False)
    tr = make_trainer(tmp_path, steps=1)
    tr.use_vllm = True   # as if GRPOConfig(use_vllm=True): attach checks before anything runs
    with pytest.raises(RuntimeError, match=r"BITMATCH=1"):
        bt.attach(tr)


def test_toy_task_needs_no_source_checkout(tmp_path, monkeypatch):
    """The toy task lives in the package: with no examples folder beside it, it still builds."""
    import bitmatch.testing.trl as ttrl
    monkeypatch.setattr(ttrl, "EXAMPLES", tmp_path / "no-examples")
    ds, tok = ttrl.toy_dataset(4), ttrl.char_tokenizer()
    assert len(ds) == 4 and all(p[0] in ttrl.LETTERS for p in ds["prompt"])
    assert tok.decode(tok("a:")["input_ids"]) == "a:"
    assert ttrl.repeat_letter_reward(["a:"], ["aaaabbbb"]) == [0.5]
    assert ttrl.toy_config(str(tmp_path), 1).max_completion_length == ttrl.TOY_COMPLETION_LEN
    with pytest.raises(FileNotFoundError, match="source checkout"):
        ttrl.load_example.__wrapped__("trl_grpo")


@pytest.mark.parametrize("rollout_weights", ["shared", "copy"])
def test_fp8_grpo_diff_zero_and_bf16_trainer_differs(tmp_path, rollout_weights):
    """attach(quantization="fp8"): the rollout (FP8 engine; the copy re-quantizes what the sync
    ships) and TRL's loss logprobs (FP8 trainer) agree every step; the control scores the same
    rollout with the bf16 trainer and differs. Refused with vLLM (the plugin has no FP8)."""
    import bitmatch
    import bitmatch.adapters.trl as bt

    trainer = bt.attach(make_trainer(tmp_path, steps=2), rollout_weights=rollout_weights, quantization="fp8")
    trainer.train()
    hist = trainer._bitmatch.history
    assert len(hist) == 2 and all(h.total > 0 and h.mismatches == 0 for h in hist), hist
    eng = trainer._bitmatch.engine
    assert eng.config.quantization == "fp8" or getattr(eng, "quantization", None) == "fp8"
    # control: the same completions scored by the bf16 trainer (the mode off) differ
    outs = eng.generate([[1, 5, 9, 13]], bitmatch.SamplingParams(temperature=0.9, max_tokens=6, seed=3))
    ids = torch.tensor([outs[0].prompt_token_ids + list(outs[0].outputs[0].token_ids)])
    m = trainer.model
    plain = bitmatch.patch(copy.deepcopy(m), quantization=None)   # the same weights, the mode off
    with torch.no_grad():
        fp8 = bitmatch.token_logprobs(m, ids, torch.ones_like(ids), temperature=0.9)
        bf16 = bitmatch.token_logprobs(plain, ids, torch.ones_like(ids), temperature=0.9)
    got = torch.tensor(outs[0].outputs[0].logprobs)
    assert torch.equal(fp8[0, 3:], got) if rollout_weights == "shared" else fp8.shape == bf16.shape
    assert not torch.equal(fp8, bf16)
    with pytest.raises(ValueError, match="quantization"):
        bt.attach(make_trainer(tmp_path / "q", steps=1), quantization="int8")
