"""`bitmatch replay BUNDLE --model PATH`: a repro bundle rescored on the step's model.

The bundles are written by the step checker itself (``StepChecker.check`` on a real mismatch, and
``write_bundle``, its writer, for a matching step): rollouts from ``bitmatch.Engine`` on a rollout
copy with one corrupted weight (as tests/test_trl.py's fault injection), trainer logprobs from
``token_logprobs`` on the saved policy.
"""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch

import bitmatch
from bitmatch.cli import main
from bitmatch.diagnostics.replay import read_bundle, replay
from bitmatch.diagnostics.stepcheck import Divergence, StepChecker, weights_fingerprint, write_bundle
from bitmatch.engine import Engine, SamplingParams
from bitmatch.models import load_model
from bitmatch.models.lora import merged_state_dict
from bitmatch.testing.models import pad_batch, random_prompts, tiny_model

T = 0.9


def _step(policy, rollout_model, prompts):
    """(config, tensors, rollout lp, trainer lp, completion mask) of one generation step, TRL's layout."""
    outs = Engine(rollout_model, seed=0).generate(
        prompts, SamplingParams(temperature=T, max_tokens=4, ignore_eos=True, seed=1), use_tqdm=False)
    p_ids, p_mask = pad_batch(prompts, "left")
    c_ids, c_mask = pad_batch([o.outputs[0].token_ids for o in outs], "right")
    rollout_lp = torch.zeros(c_ids.shape)
    for b, o in enumerate(outs):
        rollout_lp[b, :len(o.outputs[0].logprobs)] = torch.tensor(o.outputs[0].logprobs)
    with torch.no_grad():
        lp = bitmatch.token_logprobs(policy, torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1),
                                     temperature=T)
    trainer_lp = lp[:, -c_ids.shape[1]:] * c_mask
    cfg = {"temperature": T, "top_k": None, "top_p": 1.0, "compute_dtype": "torch.bfloat16",
           "weights_fingerprint": weights_fingerprint(merged_state_dict(policy), torch.bfloat16)}
    tensors = {"prompt_ids": p_ids, "prompt_mask": p_mask, "completion_ids": c_ids, "completion_mask": c_mask,
               "rollout_logprobs": rollout_lp, "trainer_logprobs": trainer_lp}
    return cfg, tensors, rollout_lp, trainer_lp, c_mask


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(checkpoint folder, mismatch bundle, matching bundle)."""
    root = tmp_path_factory.mktemp("replay")
    policy = tiny_model("qwen3", torch.bfloat16, seed=0)
    policy.save_pretrained(root / "ckpt")
    bitmatch.patch(policy, compute_dtype=torch.bfloat16)
    prompts = random_prompts(3, 3, 9, seed=2)

    cfg, tensors, _, _, _ = _step(policy, policy, prompts)
    good = write_bundle(str(root / "good"), {"step": 1, "mode": "train", **cfg}, tensors)

    bad_rollout = copy.deepcopy(policy)
    with torch.no_grad():   # one weight of the rollout copy only: the trainer keeps the step's policy
        bad_rollout.model.layers[1].mlp.down_proj.weight.mul_(1.5)
    cfg, tensors, rollout_lp, trainer_lp, c_mask = _step(policy, bad_rollout, prompts)
    checker = StepChecker("log", str(root / "repro"))
    check = checker.check(step=2, mode="train", rollout=rollout_lp, trainer=trainer_lp, mask=c_mask,
                          diagnose=lambda res: Divergence(int(tensors["completion_ids"][res.first_divergence]),
                                                          "First divergent layer: not located.", config=cfg,
                                                          tensors=tensors))
    assert check.mismatches > 0 and check.bundle, "the corrupted rollout weight changed no logprob"
    return str(root / "ckpt"), check.bundle, good


def test_replay_of_a_mismatch_exits_1_and_reports_it(saved, capsys, tmp_path):
    ckpt, bad, _ = saved
    report = tmp_path / "replay.json"
    assert main(["replay", bad, "--model", ckpt, "--device", "cpu", "--json", str(report)]) == 1
    out = capsys.readouterr().out
    assert "rescored vs rollout logprobs: tokens compared" in out and "first divergence at (seq" in out
    assert "weights fingerprint: matches the bundle's" in out
    # the saved policy is the trainer's: its side reproduces; locate on the step's model finds no op
    # differing between packed and paged forwards (the rollout's weights were the fault)
    trainer_line = next(ln for ln in out.splitlines() if ln.startswith("rescored vs trainer logprobs:"))
    assert "mismatches 0," in trainer_line, out
    assert "locate (first divergent sequence):" in out and "from the rollout's weights" in out
    assert "verdict: the rollout's logprobs DIFFER" in out
    r = json.loads(report.read_text())
    assert r["bitmatched"] is False and r["trainer"]["bitmatched"] is True and r["rollout"]["mismatches"] > 0
    assert r["located"]["first_divergent"] is None


def test_replay_of_a_matching_step_exits_0(saved, capsys):
    ckpt, _, good = saved
    assert main(["replay", good, "--model", ckpt, "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "rollout logprobs reproduced bit for bit" in out and "locate" not in out


def test_replay_on_other_weights_is_refused_by_fingerprint(saved, capsys, tmp_path):
    ckpt, bad, _ = saved
    other = tiny_model("qwen3", torch.bfloat16, seed=5)
    other.save_pretrained(tmp_path / "other")
    assert main(["replay", bad, "--model", str(tmp_path / "other"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "fingerprint" in err and "--any-weights" in err and "step 2" in err
    # forced: the rollout's logprobs are not reproduced on other weights (and exit says so)
    assert main(["replay", bad, "--model", str(tmp_path / "other"), "--device", "cpu", "--any-weights"]) == 1


def test_replay_bad_inputs_name_the_fix(saved, capsys, tmp_path):
    ckpt, bad, _ = saved
    assert main(["replay", str(tmp_path / "nope"), "--model", ckpt]) == 2
    assert "is not a folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["replay", str(tmp_path / "empty"), "--model", ckpt]) == 2
    assert "has no config.json: not a repro bundle" in capsys.readouterr().err
    assert main(["replay", bad]) == 2     # no --model, and the bundle names no checkpoint
    assert "give --model PATH_OR_HUB" in capsys.readouterr().err
    assert main(["replay", bad, "--model", str(tmp_path / "no-ckpt")]) == 2
    assert capsys.readouterr().err.startswith("bitmatch replay: ")


def test_read_bundle_lines_up_trl_rows(saved):
    _, bad, _ = saved
    b = read_bundle(bad)
    t = torch.load(os.path.join(bad, "tokens.pt"))
    assert b.ids.shape[1] == t["prompt_ids"].shape[1] + t["completion_ids"].shape[1]
    assert b.completion_len == t["completion_ids"].shape[1] and b.dtype == torch.bfloat16 and b.temperature == T


def test_verl_layout_replays_too(saved, tmp_path):
    """verl's check writes whole rows (input_ids, attention_mask, responses, response_mask) and the
    rollout dtype: the same step in that layout replays to the same verdict."""
    ckpt, _, good = saved
    t = torch.load(os.path.join(good, "tokens.pt"))
    verl = write_bundle(str(tmp_path / "verl"), {"step": 1, "temperature": T, "rollout_dtype": "torch.bfloat16",
                                                 "framework": "verl"}, {
        "input_ids": torch.cat([t["prompt_ids"], t["completion_ids"]], 1),
        "attention_mask": torch.cat([t["prompt_mask"], t["completion_mask"]], 1),
        "responses": t["completion_ids"], "response_mask": t["completion_mask"],
        "rollout_logprobs": t["rollout_logprobs"], "trainer_logprobs": t["trainer_logprobs"]})
    b = read_bundle(verl)
    assert b.dtype == torch.bfloat16 and b.completion_len == t["completion_ids"].shape[1]
    model = load_model(ckpt, dtype=torch.bfloat16)
    res = replay(b, model)
    assert res.bitmatched and res.fingerprint_matches is None and res.located is None, res.summary()
