"""GRPO with verl 0.9.1, bitmatched: rollout_log_probs equal the actor's old_log_probs on every step.

The one config line is ``actor_rollout_ref.rollout.name=bitmatch`` (plus
``rollout.calculate_log_probs=True``; see ``VERL_OVERRIDES``); the ``verl.plugins`` entry point does
the rest. With verl's Ray trainer on GPUs:

    python -m verl.trainer.main_ppo actor_rollout_ref.model.path=Qwen/Qwen3-0.6B \\
        actor_rollout_ref.rollout.name=bitmatch actor_rollout_ref.rollout.calculate_log_probs=True \\
        actor_rollout_ref.rollout.tensor_model_parallel_size=1 actor_rollout_ref.actor.strategy=fsdp2 \\
        actor_rollout_ref.ref.strategy=fsdp2 algorithm.adv_estimator=grpo trainer.use_v1=False ...

verl's own Ray loop (``main_ppo`` -> ``RayPPOTrainer.fit``) runs on CPU with a local Ray and declared
GPUs (tests/test_verl_ray.py; docs/scaling.md says what verl 0.9.1 still assumes). This script stays
in one process and runs verl's own worker and trainer code directly: ``ActorRolloutRefWorker``
(FSDP2 actor and ref on gloo, the ``bitmatch`` rollout built through verl's ``_ROLLOUT_REGISTRY``),
``update_weights`` (naive mode) every step, and the trainer's own ``_compute_old_log_prob`` /
``_compute_ref_log_prob`` / ``compute_advantage`` (GRPO) / ``_update_actor``,
``calculate_debug_metrics`` and ``compute_rollout_correction_and_add_to_batch``.
The task: a tiny Qwen3 built in code (character tokenizer) learns to answer in lowercase letters.

    python examples/verl_grpo.py                 # tiny model, CPU, 4 steps
    python examples/verl_grpo.py --no-bitmatch   # the stock actor (bf16 logprobs): bitmatch/mismatch_tokens > 0
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import pathlib
import types
import uuid

VERL_OVERRIDES = [   # what turns bitmatch on, on top of any verl GRPO config
    "actor_rollout_ref.rollout.name=bitmatch",
    "actor_rollout_ref.rollout.calculate_log_probs=True",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.actor.strategy=fsdp2",
    "actor_rollout_ref.ref.strategy=fsdp2",
]


def _trl_example():
    """The toy task's tokenizer and model (shared with examples/trl_grpo.py, which imports no TRL at load)."""
    path = pathlib.Path(__file__).with_name("trl_grpo.py")
    spec = importlib.util.spec_from_file_location("bitmatch_example_trl_grpo", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ----------------------------------------------------------------------------- verl on CPU

def cpu_setup(port: int = 29533):
    """Let verl's FSDP2 workers run in this process on CPU: verl's ``cpu`` platform and FSDP engine
    from ``bitmatch.adapters.verl.cpu`` (``VERL_PLATFORM=cpu``; no pinned memory), a one-rank gloo
    process group on 127.0.0.1."""
    import torch

    os.environ.setdefault("VERL_PLATFORM", "cpu")
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
        os.environ.setdefault(k, v)
    from bitmatch.adapters.verl import cpu
    cpu.register_platform()
    cpu.register_engine()
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")


def save_tiny_model(path: str, seed: int = 0) -> str:
    ex = _trl_example()
    if not os.path.exists(os.path.join(path, "config.json")):
        ex.tiny_policy(seed=seed).save_pretrained(path)
        ex.char_tokenizer().save_pretrained(path)
    return path


def make_config(model_path: str, *, bitmatch: bool = True, steps: int = 4, prompts: int = 2, n: int = 4,
                response_length: int = 6, temperature: float = 0.9, extra=()):
    """verl's own ``ppo_trainer`` config (hydra), GRPO, tiny batch, with VERL_OVERRIDES."""
    import verl.trainer.config as tc
    from hydra import compose, initialize_config_dir

    over = [
        f"actor_rollout_ref.model.path={model_path}", "actor_rollout_ref.model.use_remove_padding=True",
        "+actor_rollout_ref.model.override_config.attn_implementation=eager",
        f"actor_rollout_ref.rollout.n={n}", f"actor_rollout_ref.rollout.temperature={temperature}",
        f"actor_rollout_ref.rollout.response_length={response_length}", "actor_rollout_ref.rollout.prompt_length=4",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.optim.lr=3e-3", "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.001", "actor_rollout_ref.actor.entropy_coeff=0",
        f"data.train_batch_size={prompts}", "data.max_prompt_length=4", f"data.max_response_length={response_length}",
        "algorithm.adv_estimator=grpo", "+algorithm.rollout_correction.rollout_is=token",
        f"trainer.total_training_steps={steps}", "trainer.n_gpus_per_node=1",
        *VERL_OVERRIDES,
    ]
    if not bitmatch:
        over.append("+actor_rollout_ref.rollout.engine_kwargs.bitmatch.patch_actor=False")
    with initialize_config_dir(config_dir=os.path.dirname(tc.__file__), version_base=None):
        return compose("ppo_trainer", overrides=over + list(extra))


def build_worker(cfg):
    """verl's hybrid worker, as the Ray trainer builds it (``init_model``: ref, actor, rollout)."""
    from verl.workers.engine_workers import ActorRolloutRefWorker

    w = ActorRolloutRefWorker(cfg.actor_rollout_ref, role="actor_rollout_ref")
    w.init_model()
    return w


# ----------------------------------------------------------------------------- one GRPO step

def prompt_batch(tokenizer, cfg, step: int, seed: int = 0):
    """``data.train_batch_size`` prompts "x:", left-padded, with uids; repeated rollout.n times (interleaved)."""
    import random

    import numpy as np
    import torch
    from verl import DataProto

    rng = random.Random(seed * 1000 + step)
    letters = [rng.choice("abcd") for _ in range(cfg.data.train_batch_size)]
    ids = torch.tensor([tokenizer(f"{c}:")["input_ids"] for c in letters])
    b = DataProto.from_single_dict({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    b.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in letters], dtype=object)
    b.meta_info.update(temperature=cfg.actor_rollout_ref.rollout.temperature, global_steps=step)
    return b.repeat(repeat_times=cfg.actor_rollout_ref.rollout.n, interleave=True)


def lowercase_scores(batch, tokenizer):
    """token_level_scores: the fraction of the response's characters that are lowercase letters, on its
    last token (the tiny random model starts near 0.2: every group of rollout.n has a spread)."""
    import torch

    resp, mask = batch.batch["responses"], batch.batch["response_mask"]
    scores = torch.zeros(resp.shape, dtype=torch.float32)
    for i in range(resp.size(0)):
        n = int(mask[i].sum())
        text = tokenizer.decode(resp[i, :n].tolist(), skip_special_tokens=True)
        scores[i, max(n - 1, 0)] = sum("a" <= ch <= "z" for ch in text) / resp.size(1)
    return scores


def grpo_step(worker, cfg, step: int, after_sync=None) -> dict:
    """One step of RayPPOTrainer.fit (decoupled mode) on verl's own code: weight sync, rollout,
    old / ref logprobs, debug metrics (+ bitmatch/*), rollout_corr/*, GRPO advantages, actor update."""
    import verl.utils.debug.metrics as debug_metrics
    from verl.trainer.ppo.core_algos import AdvantageEstimator
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, compute_advantage
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

    trainer = types.SimpleNamespace(config=cfg, actor_rollout_wg=worker, ref_policy_wg=worker,
                                    distillation_config=None, use_reference_policy=True,
                                    ref_in_actor=False)
    asyncio.run(worker.update_weights(global_steps=step, mode="naive"))   # checkpoint_manager.update_weights
    if after_sync is not None:
        after_sync(worker, step)
    tok = worker.rollout.tokenizer
    gen = prompt_batch(tok, cfg, step)
    batch = worker.rollout.generate_sequences(gen)
    batch.meta_info["global_token_num"] = batch.batch["attention_mask"].sum(-1).tolist()
    batch.meta_info["images_seqlens"] = []
    metrics = {}
    old, _ = RayPPOTrainer._compute_old_log_prob(trainer, batch)
    old.batch.pop("entropys")
    batch = batch.union(old)
    metrics.update(debug_metrics.calculate_debug_metrics(batch))   # the trainer's call; bitmatch/* ride along
    ref = RayPPOTrainer._compute_ref_log_prob(trainer, batch)
    batch = batch.union(ref)
    batch.batch["token_level_scores"] = lowercase_scores(batch, tok)
    batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
    # the trainer hands its DictConfig section over as it is
    batch, is_metrics = compute_rollout_correction_and_add_to_batch(batch, cfg.algorithm.rollout_correction)
    metrics.update(is_metrics)
    batch = compute_advantage(batch, adv_estimator=AdvantageEstimator.GRPO, num_repeat=cfg.actor_rollout_ref.rollout.n,
                              config=cfg.algorithm)
    out = RayPPOTrainer._update_actor(trainer, batch)
    metrics.update(out.meta_info["metrics"])
    metrics["reward/mean"] = float(batch.batch["token_level_scores"].sum(-1).mean())
    return metrics


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--no-bitmatch", action="store_true", help="stock actor (the rollout stays bitmatch's)")
    ap.add_argument("--workdir", default="/tmp/bitmatch-verl-example")
    ap.add_argument("--on-mismatch", default=None, choices=["raise", "warn", "log"])
    a = ap.parse_args(argv)
    cpu_setup()
    import bitmatch.adapters.verl as bv
    bv.require_plugin()
    bv.configure(on_mismatch=a.on_mismatch or ("log" if a.no_bitmatch else "raise"),
                 repro_dir=os.path.join(a.workdir, "bitmatch_repro"))
    cfg = make_config(save_tiny_model(os.path.join(a.workdir, "model")), bitmatch=not a.no_bitmatch, steps=a.steps)
    worker = build_worker(cfg)
    keys = ("bitmatch/mismatch_tokens", "bitmatch/diff_max", "rollout_corr/k3_kl",
            "training/rollout_probs_diff_max", "actor/pg_loss", "reward/mean")
    for step in range(1, a.steps + 1):
        m = grpo_step(worker, cfg, step)
        print(json.dumps({"step": step, **{k: m.get(k) for k in keys}}), flush=True)


if __name__ == "__main__":
    main()
