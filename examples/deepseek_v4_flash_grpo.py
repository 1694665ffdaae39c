"""GRPO on DeepSeek-V4 with TRL, bitmatched: every generation step asserts Diff = 0.

Default: a tiny DeepSeek-V4 built in code (``bitmatch.models.deepseek_v4_tiny``: sliding, CSA with
the Lightning Indexer and HCA layers, hash and learned routing, mHC with 2 streams; random
weights, character tokenizer) learns the toy task of ``examples/trl_grpo.py`` on CPU: the prompt
is a letter and a colon, the reward the fraction of the completion repeating that letter. The
reward rises while the adapter checks rollout == trainer logprobs on every step (raises otherwise).

    python examples/deepseek_v4_flash_grpo.py                    # tiny model, CPU
    python examples/deepseek_v4_flash_grpo.py --model PATH       # a DeepSeek-V4(-Flash) checkpoint

DeepSeek-V4-Flash ships FP8 e4m3 (attention / shared weights, 128 x 128 block scales) and FP4 e2m1
(routed experts, a scale per 32 values) tensors with a ``quantization_config``; bitmatch's kernels
run bf16 / fp32, so ``bitmatch.models.hub.load_pretrained`` dequantizes such a checkpoint tensor by tensor
at load time (``bitmatch.models.quant``; the same bits on every load). A format it cannot read
exactly is refused before any weight loads. The full Flash needs ~0.57 TB once dequantized: see
docs/deepseek_v4.md for what fits where.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trl_grpo as toy  # noqa: E402  (the toy task, tokenizer and config are shared with that example)


def load_checkpoint(path: str, dtype):
    """The model at ``path``, FP8 / FP4 weights dequantized into ``dtype``; SystemExit naming what is
    supported when the checkpoint's quantization cannot be read exactly."""
    from bitmatch.models.hub import load_pretrained
    from bitmatch.models.quant import QuantizedCheckpointError

    try:
        return load_pretrained(path, dtype=dtype, who="--model")
    except QuantizedCheckpointError as e:
        raise SystemExit(str(e)) from None


def tiny_policy(seed: int = 0):
    from bitmatch.models.deepseek_v4_tiny import tiny_model

    model = tiny_model(seed=seed)
    return model.train()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model",
                    help="path of a DeepSeek-V4 checkpoint, bf16 or FP8/FP4 (default: a tiny one built in code)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--batch", type=int, default=16, help="completions per step (num_generations = 8)")
    ap.add_argument("--output-dir", default="/tmp/bitmatch-dsv4-grpo")
    a = ap.parse_args(argv)

    import torch
    from trl import GRPOTrainer

    import bitmatch.adapters.trl

    torch.manual_seed(0)
    torch.set_num_threads(1)  # the float64-exact CPU reference runs fastest on one thread (same bits)
    over = dict(per_device_train_batch_size=a.batch, num_generations=8, router_aux_loss_coef=0.0)
    if a.lr is not None:
        over["learning_rate"] = a.lr
    if a.model:
        from transformers import AutoTokenizer
        use_cpu = not torch.cuda.is_available()
        model = load_checkpoint(a.model, torch.float32 if use_cpu else torch.bfloat16)
        tokenizer = AutoTokenizer.from_pretrained(a.model)
        args = toy.toy_config(a.output_dir, a.steps, use_cpu=use_cpu, bf16=not use_cpu,
                              **{"learning_rate": 1e-6, "max_completion_length": 256, **over})
    else:
        model, tokenizer = tiny_policy(), toy.char_tokenizer()
        args = toy.toy_config(a.output_dir, a.steps, **{"learning_rate": 1e-2, **over})
    trainer = GRPOTrainer(model=model, reward_funcs=toy.repeat_letter_reward, args=args,
                          train_dataset=toy.toy_dataset(), processing_class=tokenizer)
    trainer = bitmatch.adapters.trl.attach(trainer, on_mismatch="raise")   # Diff = 0 asserted every step

    t0 = time.time()
    trainer.train()
    wall = time.time() - t0
    rows = [h for h in trainer.state.log_history if "reward" in h]
    for r in rows:
        print(f"step {r['step']:>3} reward {r['reward']:.3f} diff_max {r.get('bitmatch/diff_max', float('nan')):.3g} "
              f"mismatch {r.get('bitmatch/mismatch_tokens', float('nan')):.0f}")
    k = max(1, len(rows) // 4)
    first = sum(r["reward"] for r in rows[:k]) / k
    last = sum(r["reward"] for r in rows[-k:]) / k
    hist = trainer._bitmatch.history
    print(f"mean reward, first {k} steps: {first:.3f}; last {k} steps: {last:.3f}; {len(rows)} steps in {wall:.0f} s")
    print(f"bitmatch: {len(hist)} generation steps checked, {sum(h.total for h in hist)} tokens, "
          f"{sum(h.mismatches for h in hist)} mismatches, max diff {max(h.diff_max for h in hist):.3g}")
    return trainer


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    main()
