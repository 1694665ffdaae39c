"""What a new user hit (issue 51): diagnostics that blame the wrong thing and engine options that
did not do what vLLM's do. ``locate --pair hf`` pairs like with like on every family (no false
divergence); ``locate --pair backend`` runs each family's own tiny config; the per-step check names
weights written after sampling; prefix caching reuses a repeated prompt's prefill inside one
``generate``; ``max_model_len`` and the other vLLM engine arguments by name."""
from __future__ import annotations

import pytest
import torch

import bitmatch
from bitmatch.engine import Engine, SamplingParams
from bitmatch.testing import same_outputs
from bitmatch.testing.models import random_prompts, tiny_model
from test_engine import assert_bitmatch

# ----------------------------------------------------------------------------- prefix caching (51.10)

def _prefill_tokens(engine) -> list:
    """Wrap the scheduler: each step's [(seq_id, new tokens, tokens already computed)]."""
    steps, schedule = [], engine.scheduler.schedule

    def wrapped():
        out = schedule()
        steps.append([(s.seq_id, n, s.num_computed_tokens) for s, n in out])
        return out
    engine.scheduler.schedule = wrapped
    return steps


@pytest.mark.parametrize("family", ["qwen3-hd64-gqa4-tied", "deepseek_v4"])
def test_repeated_prompt_reuses_its_prefill_in_one_generate(family):
    """Three identical 201-token prompts in one call (GRPO's n samples of a prompt): the second and
    third report 192 cached tokens (12 full blocks of 16) and compute only the other 9; every
    token and logprob is bitwise the uncached run's."""
    model = bitmatch.patch(tiny_model(family, dtype=torch.bfloat16, seed=0))
    prompt = random_prompts(1, 201, 201, seed=3)[0]
    params = [SamplingParams(temperature=0.7, max_tokens=3, ignore_eos=True, seed=i) for i in range(3)]
    ref = Engine(model).generate([prompt] * 3, params, use_tqdm=False)
    eng = Engine(model, enable_prefix_caching=True)
    steps = _prefill_tokens(eng)
    outs = eng.generate([prompt] * 3, params, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, 192, 192]
    prefill = sum(n for s in steps for _, n, c in s if c < 201)
    assert prefill == 201 + 2 * 9, steps
    assert same_outputs(ref, outs)
    assert_bitmatch(model, outs, params)


# ----------------------------------------------------------------------------- vLLM argument names (51.11)

def test_max_model_len_and_vllm_argument_names():
    model = tiny_model("qwen3-hd64-gqa4-tied", seed=0, num_hidden_layers=1)
    eng = Engine(model, max_model_len=16, num_gpu_blocks=16)
    assert eng.max_model_len == 16
    out = eng.generate([list(range(3, 13))], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 16 and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="prompt of 16 tokens leaves no room under max_model_len=16"):
        eng.add_request(list(range(3, 19)), SamplingParams(max_tokens=1))
    limit = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"max_model_len={limit + 1} is longer than the model's "
                                         f"max_position_embeddings={limit}"):
        Engine(model, max_model_len=limit + 1)
    with pytest.raises(ValueError, match="max_model_len must be an int >= 1"):
        Engine(model, max_model_len=0)
    with pytest.raises(ValueError, match=r"tensor_parallel_size= \(vLLM's\) is not supported: shard the model"):
        Engine(model, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"kv_cache_dtype= \(vLLM's\) is not supported"):
        Engine(model, kv_cache_dtype="fp8")
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['no_such_arg'\]"):
        Engine(model, no_such_arg=1)
    assert "max_model_len" in Engine.__doc__ and "tensor_parallel_size" in Engine.__doc__


# ----------------------------------------------------------------------------- locate --pair hf (51.2)

def _pairs_like_with_like(row) -> bool:
    """A compared op's HF reference is its own module's output, or the input of a module it feeds:
    never the input of a module that contains it (that is the op's input, not its output)."""
    ref = row["ref"]
    if ref is None or ref.startswith("HF log_softmax"):
        return True
    _, mod, kind = ref.split(" ")
    if kind == "output":
        return mod == row["name"]
    return not row["name"].startswith(mod + ".")


@pytest.mark.parametrize("family", ["dense", "qwen3_moe", "deepseek_v4", "nemotron_h"])
def test_locate_hf_pair_finds_no_divergence_on_every_family(family, tmp_path, capsys):
    import json

    from bitmatch.cli import main

    rc = main(["locate", "--family", family, "--pair", "hf", "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert rc == 0 and "verdict: no divergent op" in out, out
    (r,) = json.loads((tmp_path / "r.json").read_text())["results"]
    compared = [o for o in r["ops"] if o["status"] != "not compared"]
    assert compared and all(_pairs_like_with_like(o) for o in compared), \
        [(o["name"], o["ref"]) for o in compared if not _pairs_like_with_like(o)]
    if family == "nemotron_h":   # the attention output is o_proj's input, as in the dense families
        rows = {o["name"]: o for o in r["ops"]}
        assert rows["layers.2.mixer.attn"]["ref"] == "HF layers.2.mixer.o_proj input"
        assert rows["layers.2.mixer.attn"]["status"] == "within tol"


# ----------------------------------------------------------------------------- locate --pair backend (51.7)

@pytest.mark.parametrize("family", [
    "nemotron_h",
    pytest.param("qwen3_moe", marks=pytest.mark.slow),      # the interpreter takes minutes on these
    pytest.param("deepseek_v4", marks=pytest.mark.slow),
])
def test_locate_backend_pair_runs_each_family_tiny_config(family, capsys):
    """The family's own tiny config (what every check builds) runs on the Triton backend too: under
    Triton's interpreter here, within tolerance of the reference. Nemotron-H's chunk of 8 was
    refused by the Triton scan (chunks of 16 and up); prompts of 20 tokens cross its chunk of 16."""
    pytest.importorskip("triton")
    from bitmatch.cli import main

    rc = main(["locate", "--family", family, "--pair", "backend", "--prompts", "2", "--max-len", "20"])
    out = capsys.readouterr()
    assert rc == 0 and "verdict: no divergent op" in out.out, out.out + out.err


# ----------------------------------------------------------------------------- the per-step check (51.3)

def test_stepcheck_names_weights_written_between_sampling_and_scoring(tmp_path):
    """Shared weights written in place after the rollout sampled (an optimizer step before the
    loss): every op agrees on the weights as they are now, so the locate finds nothing; the
    message names the written tensor from the engine's version-counter snapshot instead of blaming
    the sampler."""
    from bitmatch.diagnostics.stepcheck import BitmatchMismatchError, Divergence, StepChecker, locate_sentence
    from bitmatch.testing.models import pad_batch

    model = bitmatch.patch(tiny_model("qwen3-hd64-gqa4-tied", dtype=torch.bfloat16, seed=0))
    eng = Engine(model, num_gpu_blocks=32)
    outs = eng.generate(random_prompts(2, 5, 12, seed=1),
                        SamplingParams(temperature=0.7, max_tokens=4, ignore_eos=True, seed=0), use_tqdm=False)
    assert eng.weights_written_since_sampling() == []
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(1 + 2 ** -5)
    assert eng.weights_written_since_sampling() == ["model.layers.0.mlp.down_proj.weight"]
    ids, mask = pad_batch([o.prompt_token_ids + o.outputs[0].token_ids for o in outs], "right")
    trainer = bitmatch.token_logprobs(model, ids, mask, temperature=0.7)
    rollout, cmask = torch.zeros_like(trainer), torch.zeros_like(trainer)
    for s, o in enumerate(outs):
        p = len(o.prompt_token_ids) - 1
        rollout[s, p:p + 4] = torch.tensor(o.outputs[0].logprobs)
        cmask[s, p:p + 4] = 1

    def diagnose(res):
        s, _ = res.first_divergence
        where = locate_sentence(model, eng, ids[s:s + 1], mask[s:s + 1], compute_dtype=torch.bfloat16,
                                block_size=eng.block_size,
                                written_since_sampling=eng.weights_written_since_sampling())
        return Divergence(-1, where)
    with pytest.raises(BitmatchMismatchError) as e:
        StepChecker("raise", str(tmp_path)).check(step=1, mode="train", rollout=rollout, trainer=trainer,
                                                   mask=cmask, diagnose=diagnose)
    msg = str(e.value)
    assert "the weights changed after the rollout sampled: 'model.layers.0.mlp.down_proj.weight'" in msg, msg
    assert "rollout_weights='copy'" in msg and "comes after the logits" not in msg, msg
    # without the snapshot, a shared model still says the comparison cannot see weights written since
    where = locate_sentence(model, eng, ids[:1], mask[:1], compute_dtype=torch.bfloat16, block_size=eng.block_size)
    assert "share one model" in where and "weights written after sampling" in where, where


def test_trl_check_names_weights_written_before_the_loss(tmp_path):
    """The issue's case through TRL (rollout_weights='shared', the check at the loss): a weight
    written in place between the rollout and the loss is named as the cause, in the message and
    the repro bundle."""
    pytest.importorskip("trl")
    import json
    import os

    import bitmatch.adapters.trl as bt
    from bitmatch.testing.trl import grpo_trainer, tiny_policy

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    trainer = grpo_trainer(tiny_policy(), tmp_path / "out", 2, per_device_train_batch_size=8, num_generations=4,
                           max_completion_length=6, learning_rate=3e-3)
    trainer = bt.attach(trainer, on_mismatch="warn")
    bm = trainer._bitmatch
    loss = bm._orig["_compute_loss"]

    def write_then_loss(model, inputs):
        if trainer.state.global_step == 1:
            with torch.no_grad():
                trainer.model.model.layers[0].mlp.down_proj.weight.mul_(1.5)
        return loss(model, inputs)
    bm._orig["_compute_loss"] = write_then_loss
    with pytest.warns(UserWarning) as w:
        trainer.train()
    (msg,) = [str(x.message) for x in w if "rollout and trainer logprobs differ" in str(x.message)]
    assert "weights changed after the rollout sampled: 'model.layers.0.mlp.down_proj.weight'" in msg, msg
    assert "comes after the logits" not in msg, msg
    cfg = json.loads(open(os.path.join(bm.history[1].bundle, "config.json")).read())
    assert cfg["rollout_weights"] == "shared"
    assert cfg["weights_written_since_sampling"] == ["model.layers.0.mlp.down_proj.weight"]
