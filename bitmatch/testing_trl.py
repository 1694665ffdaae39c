"""Scaffolding of the TRL tests (one copy): the toy GRPO task of ``examples/trl_grpo.py`` (character
tokenizer, one-letter prompts, repeat-the-letter reward), a ``GRPOTrainer`` built on it for any
policy, and the assertions every TRL test makes on a run. Needs trl (``pip install bitmatch[trl]``)
and a source checkout (the examples folder beside the package).

No invariance guarantee of its own: it builds runs; the adapter under test checks Diff = 0.
"""
from __future__ import annotations

import functools
import importlib.util
import pathlib

TEMPERATURE = 0.9   # != 1: the temperature must be divided the same way on both sides

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


@functools.lru_cache(maxsize=None)
def load_example(name: str):
    """The module ``examples/<name>.py`` of this checkout (loaded once; tests use its toy task and
    tiny policies). FileNotFoundError naming the path outside a source checkout."""
    path = EXAMPLES / f"{name}.py"
    if not path.is_file():
        raise FileNotFoundError(f"load_example: no {path} (the TRL test scaffolding needs a source checkout)")
    spec = importlib.util.spec_from_file_location(f"bitmatch_example_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def toy_reward(prompts, completions, **kwargs):
    """The toy task's reward plus a small term for distinct characters: a random policy's samples
    rarely hit the prompt letter in a few steps, and all-equal rewards give zero advantages (no
    optimizer step would change a weight, whatever the sampler's seed)."""
    ex = load_example("trl_grpo")
    return [r + 0.01 * len(set(c)) for r, c in zip(ex.repeat_letter_reward(prompts, completions), completions)]


def grpo_trainer(policy, output_dir, steps: int, *, dataset_size: int = 64, reward=toy_reward,
                 peft_config=None, rollout_func=None, **config):
    """``trl.GRPOTrainer`` on the toy task: ``policy`` (a tiny model), ``steps`` optimizer steps, the
    example's ``toy_config`` (CPU, fp32, seeded) with ``config`` overriding it, T = TEMPERATURE
    unless given, a toy dataset of ``dataset_size`` prompts and the character tokenizer."""
    from trl import GRPOTrainer

    ex = load_example("trl_grpo")
    config.setdefault("temperature", TEMPERATURE)
    args = ex.toy_config(str(output_dir), steps, **config)
    return GRPOTrainer(model=policy, reward_funcs=reward, args=args, train_dataset=ex.toy_dataset(dataset_size),
                       processing_class=ex.char_tokenizer(), peft_config=peft_config, rollout_func=rollout_func)


def logged(trainer, key):
    """Every value TRL logged under ``key``, in step order."""
    return [h[key] for h in trainer.state.log_history if key in h]


def params_snapshot(model):
    """Copies of the trainable parameters, by name (for ``assert_trained``)."""
    return {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}


def assert_trained(before, model, names=()):
    """Some trainable weight changed since ``before`` (a ``params_snapshot``), and each of ``names``."""
    import torch
    after = dict(model.named_parameters())
    assert any(not torch.equal(before[k], after[k].detach()) for k in before), "no optimizer step changed a weight"
    for name in names:
        assert not torch.equal(before[name], after[name].detach()), f"{name} did not train"


def assert_diff_zero(trainer, steps: int):
    """The adapter checked each of ``steps`` generation steps with tokens and found Diff = 0, and
    TRL's logs carry the zero."""
    hist = trainer._bitmatch.history
    assert [h.step for h in hist] == list(range(steps)), hist
    assert all(h.total > 0 and h.mismatches == 0 and h.diff_max == 0.0 for h in hist), hist
    assert logged(trainer, "bitmatch/mismatch_tokens") == [0.0] * steps


__all__ = ["TEMPERATURE", "load_example", "toy_reward", "grpo_trainer", "logged", "params_snapshot",
           "assert_trained", "assert_diff_zero"]
