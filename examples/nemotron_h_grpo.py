"""GRPO with TRL on a hybrid Mamba2 + attention model (Nemotron-H), bitmatched on every step.

Default: a tiny Nemotron-H built in code (random weights: Mamba2, MoE, attention and MLP blocks,
chunk_size 16 so rollouts cross Mamba chunks) learns the toy task of examples/trl_grpo.py on CPU
(prompt "c:", reward = fraction of the completion repeating the letter). bitmatch.Engine rolls out
with the per-sequence Mamba state (boundary state + open chunk) and paged K/V; the adapter checks
every generation step (on_mismatch="raise"), so a finished run is Diff = 0 on each step, and the
script asserts it again from the history, and that the reward rose.

    python examples/nemotron_h_grpo.py                  # tiny model, CPU, 16 steps in ~5.5 min
    python examples/nemotron_h_grpo.py --model PATH     # a real NemotronHForCausalLM checkpoint
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trl_grpo as base  # noqa: E402  (the toy task, tokenizer and GRPOConfig are shared)


def tiny_policy(seed: int = 0):
    """The tiny Nemotron-H of the tests (every block kind, chunk_size 16), fp32, trainable."""
    import torch

    from bitmatch.models.nemotron_h import tiny_model

    return tiny_model(torch.float32, seed=seed).train()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="NemotronHForCausalLM path or hub id (default: a tiny one built in code)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--output-dir", default="/tmp/bitmatch-nemotron-h-grpo")
    a = ap.parse_args(argv)

    import torch
    from trl import GRPOTrainer

    import bitmatch.adapters.trl

    torch.manual_seed(0)
    if a.model:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(a.model)
        use_cpu = not torch.cuda.is_available()
        args = base.toy_config(a.output_dir, a.steps, use_cpu=use_cpu, bf16=not use_cpu,
                               learning_rate=a.lr or 1e-6, max_completion_length=256)
        compute_dtype = torch.float32 if use_cpu else torch.bfloat16
    else:
        model, tokenizer = tiny_policy(), base.char_tokenizer()
        args = base.toy_config(a.output_dir, a.steps, learning_rate=a.lr or 1e-2, per_device_train_batch_size=16,
                               num_generations=8, temperature=1.0)
        compute_dtype = torch.float32
    trainer = GRPOTrainer(model=model, reward_funcs=base.repeat_letter_reward, args=args,
                          train_dataset=base.toy_dataset(), processing_class=tokenizer)
    trainer = bitmatch.adapters.trl.attach(trainer, compute_dtype=compute_dtype)   # the one line

    t0 = time.time()
    trainer.train()
    wall = time.time() - t0
    rows = [h for h in trainer.state.log_history if "reward" in h]
    for r in rows:
        print(f"step {r['step']:>3} reward {r['reward']:.3f} diff_max {r.get('bitmatch/diff_max', float('nan')):.3g} "
              f"mismatches {r.get('bitmatch/mismatch_tokens', float('nan')):.0f}")
    hist = trainer._bitmatch.history
    assert hist and all(h.total > 0 and h.mismatches == 0 and h.diff_max == 0.0 for h in hist), hist
    k = max(1, len(rows) // 4)
    first = sum(r["reward"] for r in rows[:k]) / k
    last = sum(r["reward"] for r in rows[-k:]) / k
    print(f"bitmatch: {len(hist)} generation steps checked, {sum(h.total for h in hist)} tokens, 0 mismatches; "
          f"mean reward first {k} steps {first:.3f}, last {k} steps {last:.3f}; {wall:.0f} s")
    if not a.model:
        assert last > first, f"reward did not rise: {first:.3f} -> {last:.3f}"
    return trainer, first, last


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
