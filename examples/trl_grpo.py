"""GRPO with TRL, bitmatched: rollout logprobs equal the trainer's on every step (Diff = 0, KL = 0).

Default: a tiny Qwen3 built in code (random weights, character tokenizer) learns a toy task on
CPU in a few minutes: the prompt is one letter and a colon ("c:"); the reward is the fraction of
the completion's characters that repeat that letter ("cccccccc" scores 1.0). The reward rises
from ~0.01 to well above 0.5 while every generation step asserts Diff = 0.

    python examples/trl_grpo.py                       # tiny model, CPU, ~2-4 minutes
    python examples/trl_grpo.py --lora                # the same through a PEFT LoRA adapter
    python examples/trl_grpo.py --model Qwen/Qwen3-0.6B --dataset trl-lib/DeepMath-103K --steps 200
    BITMATCH=1 python examples/trl_grpo.py --model ... --use-vllm     # rollouts in vLLM (colocate)
    python examples/trl_grpo.py --no-bitmatch          # the stock run, for comparison (no check)

The one line that makes it bitmatched is ``trainer = bitmatch.adapters.trl.attach(GRPOTrainer(...))``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

# the toy task (tokenizer, prompts, reward, tiny policy, GRPOConfig) lives in the package, so the
# TRL tests and an installed bitmatch use the same one; the other examples import it from here too
from bitmatch.testing.trl import (  # noqa: F401  (the other examples read them from here)
    LETTERS,
    TOY_COMPLETION_LEN,
    char_tokenizer,
    repeat_letter_reward,
    tiny_policy,
    toy_config,
    toy_dataset,
)

# ----------------------------------------------------------------------------- main

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="HF model id or path (default: a tiny Qwen3 built in code)")
    ap.add_argument("--dataset", help="HF dataset with a 'prompt' column (default: the toy task)")
    ap.add_argument("--reward", default="toy", help="reward: 'toy' (repeat the letter) or 'length' "
                    "(shorter completions score higher; for real datasets without a verifier)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lora", action="store_true", help="train a PEFT LoRA adapter (r=8, alpha=16)")
    ap.add_argument("--use-vllm", action="store_true", help="roll out with vLLM colocate (needs BITMATCH=1 and "
                    "the bitmatch vLLM plugin)")
    ap.add_argument("--no-bitmatch", action="store_true", help="run stock TRL (no check), for comparison")
    ap.add_argument("--expert-parallel", action="store_true",
                    help="a tiny Qwen3-MoE (8 experts) with its experts spread over the torchrun ranks, each rank "
                         "its own prompts and only its experts (bitmatch.parallel.enable_expert_parallel, "
                         "keep_local_experts)")
    ap.add_argument("--on-mismatch", default="raise", choices=("raise", "warn", "log"))
    ap.add_argument("--output-dir", default="/tmp/bitmatch-trl-grpo")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--max-completion-length", type=int, default=None)
    ap.add_argument("--json", help="write the per-step log (reward, bitmatch metrics) to this file")
    a = ap.parse_args(argv)

    import torch
    from trl import GRPOTrainer

    import bitmatch.adapters.trl

    torch.manual_seed(0)
    over = {}
    if a.lr is not None:
        over["learning_rate"] = a.lr
    if a.max_completion_length is not None:
        over["max_completion_length"] = a.max_completion_length
    if a.use_vllm:
        import bitmatch.adapters.vllm
        if not a.no_bitmatch:
            bitmatch.adapters.vllm.enable()   # BITMATCH=1 before GRPOTrainer builds the colocated vLLM
        for k, v in (("VLLM_CPU_KVCACHE_SPACE", "1"), ("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
                     ("VLLM_CPU_OMP_THREADS_BIND", "nobind")):
            os.environ.setdefault(k, v)   # CPU build settings (the README's vLLM block); harmless on GPU
        over.update(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.1,
                    vllm_max_model_length=256)
    if a.model:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(a.model)
        use_cpu = not torch.cuda.is_available()
        # MoE configs (Qwen3-MoE, DeepSeek-V4) carry a router load-balancing loss, which bitmatch's
        # kernels do not compute (attach refuses it); 0.0 is a no-op for a dense model
        args = toy_config(a.output_dir, a.steps, use_cpu=use_cpu, bf16=not use_cpu,
                          **{"learning_rate": 1e-6, "max_completion_length": 256, "router_aux_loss_coef": 0.0, **over})
    elif a.expert_parallel:
        from bitmatch.testing.models import tiny_model
        model = tiny_model("qwen3moe-e8-k2", dtype=torch.float32, seed=0, hidden_size=64).train()
        tokenizer = char_tokenizer()
        args = toy_config(a.output_dir, a.steps, **{"router_aux_loss_coef": 0.0, **over})
    else:
        model, tokenizer = tiny_policy(), char_tokenizer()
        if a.use_vllm:   # vLLM loads the model from a path: save the tiny one (bf16, vLLM's CPU dtype)
            from transformers import AutoModelForCausalLM
            ckpt = os.path.join(a.output_dir, "tiny-qwen3")
            model.to(torch.bfloat16).save_pretrained(ckpt)
            tokenizer.save_pretrained(ckpt)
            model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
        args = toy_config(a.output_dir, a.steps, **over)
    if a.dataset:
        from datasets import load_dataset
        dataset = load_dataset(a.dataset, split="train")
    else:
        dataset = toy_dataset()
    if a.reward == "toy":
        reward = repeat_letter_reward
    elif a.reward == "length":
        def reward(completions, **kw):
            return [-len(c) / 1000.0 for c in completions]
    else:
        raise SystemExit(f"--reward must be 'toy' or 'length', got {a.reward!r}")
    peft_config = None
    if a.lora:
        from peft import LoraConfig
        peft_config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj"])
        if not a.model:
            over_lr = over.get("learning_rate", 2e-2)
            args.learning_rate = over_lr

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=peft_config)
    if a.expert_parallel:   # after the trainer: accelerate has set up torch.distributed
        from bitmatch.parallel import TPGroup, enable_expert_parallel, keep_local_experts
        ep = TPGroup.current()
        enable_expert_parallel(trainer.model, ep)
        keep_local_experts(trainer.model, ddp=True)   # this rank keeps (and trains) only its experts; DDP averages
        print(f"bitmatch: rank {ep.rank} of {ep.world} holds experts {ep.rank * 8 // ep.world}-"
              f"{(ep.rank + 1) * 8 // ep.world - 1} of 8")
    if not a.no_bitmatch:
        trainer = bitmatch.adapters.trl.attach(trainer, on_mismatch=a.on_mismatch)   # the one line

    t0 = time.time()
    trainer.train()
    wall = time.time() - t0
    rows = [h for h in trainer.state.log_history if "reward" in h]
    print(f"\n{'step':>4} {'reward':>8} {'diff_max':>9} {'mismatch':>8} {'kl_k3':>8}")
    for r in rows:
        print(f"{r['step']:>4} {r['reward']:>8.3f} {r.get('bitmatch/diff_max', float('nan')):>9.3g} "
              f"{r.get('bitmatch/mismatch_tokens', float('nan')):>8.0f} {r.get('bitmatch/kl_k3', float('nan')):>8.3g}")
    k = max(1, len(rows) // 5)
    first = sum(r["reward"] for r in rows[:k]) / k
    last = sum(r["reward"] for r in rows[-k:]) / k
    print(f"mean reward, first {k} steps: {first:.3f}; last {k} steps: {last:.3f}; {len(rows)} steps in {wall:.0f} s")
    if not a.no_bitmatch:
        hist = trainer._bitmatch.history
        print(f"bitmatch: {len(hist)} generation steps checked, {sum(h.total for h in hist)} tokens, "
              f"{sum(h.mismatches for h in hist)} mismatches, max diff {max(h.diff_max for h in hist):.3g}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "wall_s": wall, "first_mean": first, "last_mean": last}, f, indent=1)
    return trainer


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():  # under torchrun: tear the process group down before
        dist.barrier()                                # exit (an abandoned one can abort a rank at exit)
        dist.destroy_process_group()
        # and skip the C++ static destructors: under load a rank still aborted in them after the
        # work was done ("terminate called without an active exception", exit status -6)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
