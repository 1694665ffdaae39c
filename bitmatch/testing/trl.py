"""The toy GRPO task and the scaffolding of the TRL tests (one copy, in the package: no source
checkout needed): the character tokenizer, one-letter prompts, the repeat-the-letter reward, a tiny
Qwen3 policy, the task's ``GRPOConfig``; a ``GRPOTrainer`` built on it for any policy; and the
assertions every TRL test makes on a run. ``examples/trl_grpo.py`` runs this task. Needs trl
(``pip install bitmatch[trl]``).

No invariance guarantee of its own: it builds runs; the adapter under test checks Diff = 0.
"""
from __future__ import annotations

import functools
import importlib.util
import pathlib
import random

import torch

from bitmatch.testing.models import tiny_model

TEMPERATURE = 0.9   # != 1: the temperature must be divided the same way on both sides
LETTERS = "abcd"
TOY_COMPLETION_LEN = 8

# the examples of a source checkout (``load_example``: tests that run an example itself)
EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


# ----------------------------------------------------------------------------- the toy task

def char_tokenizer():
    """A real ``PreTrainedTokenizerFast``, one token per character (ids as
    ``bitmatch.testing.models.CharTokenizer``: 0 <pad>, 1 <bos>, 2 <eos>, then '\\n' and printable ASCII)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{ch: i + 3 for i, ch in enumerate(chars)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   clean_up_tokenization_spaces=False)


def tiny_policy(seed: int = 0, dtype=None, layers: int = 2):
    """A tiny random-weight Qwen3 (hidden 64, vocab 128) in fp32, trainable."""
    model = tiny_model("qwen3", dtype=dtype or torch.float32, seed=seed, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    model.train()
    return model


def toy_dataset(n: int = 256, seed: int = 0):
    """``n`` prompts "x:" with x drawn from LETTERS (a ``datasets.Dataset`` with a "prompt" column)."""
    from datasets import Dataset

    rng = random.Random(seed)
    return Dataset.from_dict({"prompt": [f"{rng.choice(LETTERS)}:" for _ in range(n)]})


def repeat_letter_reward(prompts, completions, **kwargs):
    """Fraction of the completion's characters equal to the prompt's letter (max_len characters)."""
    out = []
    for p, c in zip(prompts, completions):
        letter = p[0]
        out.append(sum(ch == letter for ch in c) / TOY_COMPLETION_LEN)
    return out


def toy_config(output_dir: str, steps: int, **overrides):
    """GRPOConfig for the toy task on CPU (fp32, no gradient checkpointing, seeded)."""
    from trl import GRPOConfig

    kw = dict(output_dir=output_dir, use_cpu=True, bf16=False, max_steps=steps, learning_rate=3e-3,
              per_device_train_batch_size=32, num_generations=8, max_completion_length=TOY_COMPLETION_LEN,
              temperature=1.0, beta=0.0, logging_steps=1, save_strategy="no", report_to=[], seed=0,
              gradient_checkpointing=False, disable_dropout=True, dataloader_num_workers=0,
              lr_scheduler_type="constant")
    kw.update(overrides)
    return GRPOConfig(**kw)


# ----------------------------------------------------------------------------- test scaffolding

@functools.lru_cache(maxsize=None)
def load_example(name: str):
    """The module ``examples/<name>.py`` of this checkout (loaded once), for tests that run an
    example itself. FileNotFoundError naming the path outside a source checkout."""
    path = EXAMPLES / f"{name}.py"
    if not path.is_file():
        raise FileNotFoundError(f"load_example: no {path} (running an example needs a source checkout)")
    spec = importlib.util.spec_from_file_location(f"bitmatch_example_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def toy_reward(prompts, completions, **kwargs):
    """The toy task's reward plus a small term for distinct characters: a random policy's samples
    rarely hit the prompt letter in a few steps, and all-equal rewards give zero advantages (no
    optimizer step would change a weight, whatever the sampler's seed)."""
    return [r + 0.01 * len(set(c)) for r, c in zip(repeat_letter_reward(prompts, completions), completions)]


def grpo_trainer(policy, output_dir, steps: int, *, dataset_size: int = 64, reward=toy_reward,
                 peft_config=None, rollout_func=None, **config):
    """``trl.GRPOTrainer`` on the toy task: ``policy`` (a tiny model), ``steps`` optimizer steps, the
    example's ``toy_config`` (CPU, fp32, seeded) with ``config`` overriding it, T = TEMPERATURE
    unless given, a toy dataset of ``dataset_size`` prompts and the character tokenizer."""
    from trl import GRPOTrainer

    config.setdefault("temperature", TEMPERATURE)
    args = toy_config(str(output_dir), steps, **config)
    return GRPOTrainer(model=policy, reward_funcs=reward, args=args, train_dataset=toy_dataset(dataset_size),
                       processing_class=char_tokenizer(), peft_config=peft_config, rollout_func=rollout_func)


def logged(trainer, key):
    """Every value TRL logged under ``key``, in step order."""
    return [h[key] for h in trainer.state.log_history if key in h]


def params_snapshot(model):
    """Copies of the trainable parameters, by name (for ``assert_trained``)."""
    return {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}


def assert_trained(before, model, names=()):
    """Some trainable weight changed since ``before`` (a ``params_snapshot``), and each of ``names``."""
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


__all__ = ["TEMPERATURE", "LETTERS", "TOY_COMPLETION_LEN", "char_tokenizer", "tiny_policy", "toy_dataset",
           "repeat_letter_reward", "toy_config", "load_example", "toy_reward", "grpo_trainer", "logged",
           "params_snapshot", "assert_trained", "assert_diff_zero"]
