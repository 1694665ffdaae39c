"""verl's own Ray loop on CPU: ``python -m verl.trainer.main_ppo`` -> ``RayPPOTrainer.fit``, bitmatched.

A local Ray with 2 declared GPUs (``ray_kwargs.ray_init.num_gpus=2``: Ray takes them at their word;
inside the workers CUDA is unavailable) and verl's CPU platform from the bitmatch plugin
(``VERL_PLATFORM=cpu``, ``bitmatch.adapters.verl.cpu``). verl 0.9.1's legacy trainer
(``trainer.use_v1=False``: the V1 trainer needs the ``transfer_queue`` package) then runs as on a
GPU node: the resource pool's placement group, one colocated ``WorkerDict`` per GPU (FSDP2 actor and
ref at 2 ranks on gloo, a bitmatch rollout in each), a ``BitmatchReplica`` per worker behind verl's
``LLMServerManager``, the agent loop and reward loop workers, the naive checkpoint engine's weight
sync, and per step ``calculate_debug_metrics`` with the bitmatch check in the trainer process. The
metrics come back through verl's file logger.

- bitmatch: 2 GRPO steps, 0 mismatching tokens of every sampled token, verl's own probs diff 0;
- control: the same loop with the actor left stock (``patch_actor=False``, check policy ``log``):
  mismatching tokens on the first step.
Runs in the verl environment (scripts/test_verl.sh, about 3 minutes on 2 cores).
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("verl")
pytest.importorskip("ray")

from bitmatch.testing.trl import char_tokenizer, tiny_policy  # noqa: E402

RUN_TIMEOUT_S = 300


def _write_task(d: pathlib.Path) -> None:
    """The tiny model (character tokenizer), 8 one-letter prompts, a lowercase-letters reward."""
    import pandas as pd

    tiny_policy().save_pretrained(d / "model")
    tok = char_tokenizer()
    # verl's Qwen token builder (verl/utils/tokenizer/continuous_token.py:560) requires <|im_end|>;
    # the agent loop applies the chat template to each prompt
    tok.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(d / "model")
    rows = [{"data_source": "lowercase", "prompt": [{"role": "user", "content": f"{c}:"}],
             "reward_model": {"style": "rule", "ground_truth": c}, "extra_info": {"index": i}}
            for i, c in enumerate("abcdabcd")]
    pd.DataFrame(rows).to_parquet(d / "train.parquet")
    (d / "reward.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n"
                                 "    return sum('a' <= ch <= 'z' for ch in solution_str) "
                                 "/ max(len(solution_str), 1)\n")


def _overrides(d: pathlib.Path, *, gpus: int, steps: int, bitmatch: bool) -> list[str]:
    over = [
        # what turns bitmatch on (examples/verl_grpo.py VERL_OVERRIDES)
        "actor_rollout_ref.rollout.name=bitmatch", "actor_rollout_ref.rollout.calculate_log_probs=True",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.ref.strategy=fsdp2",
        # the task: GRPO, 2 prompts x 4 samples of 6 tokens per step
        f"actor_rollout_ref.model.path={d}/model", "actor_rollout_ref.model.use_remove_padding=True",
        "+actor_rollout_ref.model.override_config.attn_implementation=eager",
        "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.temperature=0.9",
        "actor_rollout_ref.rollout.response_length=6", "actor_rollout_ref.rollout.prompt_length=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.optim.lr=3e-3", "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.001", "actor_rollout_ref.actor.entropy_coeff=0",
        "algorithm.adv_estimator=grpo", "+algorithm.rollout_correction.rollout_is=token",
        f"data.train_files={d}/train.parquet", f"data.val_files={d}/train.parquet", "data.train_batch_size=2",
        "data.max_prompt_length=4", "data.max_response_length=6", "data.dataloader_num_workers=0",
        f"reward.custom_reward_function.path={d}/reward.py", "reward.custom_reward_function.name=compute_score",
        # verl's Ray trainer on CPU: declared GPUs, one agent loop and one reward worker (2 cores)
        "trainer.use_v1=False", "trainer.device=cpu", "trainer.nnodes=1", f"trainer.n_gpus_per_node={gpus}",
        f"+ray_kwargs.ray_init.num_gpus={gpus}", "ray_kwargs.ray_init.num_cpus=16",
        "+ray_kwargs.ray_init.include_dashboard=False",
        "actor_rollout_ref.rollout.agent.num_workers=1", "reward.num_workers=1",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=naive",
        f"trainer.total_training_steps={steps}", "trainer.total_epochs=1", "trainer.val_before_train=False",
        "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.logger=[console,file]",
        f"trainer.default_local_dir={d}/ckpt",
    ]
    if not bitmatch:
        over.append("+actor_rollout_ref.rollout.engine_kwargs.bitmatch.patch_actor=False")
    return over


def _fit(d: pathlib.Path, *, gpus: int, steps: int, bitmatch: bool, on_mismatch: str) -> list[dict]:
    """``python -m verl.trainer.main_ppo`` in a fresh process; verl's per-step metric dicts."""
    metrics = d / f"metrics_{'bitmatch' if bitmatch else 'stock'}.jsonl"
    env = {**os.environ, "VERL_PLATFORM": "cpu", "VERL_FILE_LOGGER_PATH": str(metrics),
           "BITMATCH_ON_MISMATCH": on_mismatch, "BITMATCH_REPRO_DIR": str(d / "repro"), "OMP_NUM_THREADS": "1",
           "RAY_DEDUP_LOGS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *_overrides(d, gpus=gpus, steps=steps, bitmatch=bitmatch)]
    p = subprocess.run(cmd, env=env, cwd=d, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert p.returncode == 0, f"main_ppo exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return [json.loads(line)["data"] for line in metrics.read_text().splitlines()]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    d = tmp_path_factory.mktemp("verl_ray")
    _write_task(d)
    return d


def test_ray_ppo_fit_diff_zero(task):
    """verl's own loop, 2 steps at 2 (declared) GPUs: every sampled token's rollout logprob equals the
    FSDP2 actor's old_log_prob bit for bit, with an optimizer step (a nonzero gradient) between."""
    steps = _fit(task, gpus=2, steps=2, bitmatch=True, on_mismatch="raise")
    assert len(steps) == 2, steps
    for m in steps:
        assert m["bitmatch/mismatch_tokens"] == 0.0 and m["bitmatch/diff_max"] == 0.0, m
        assert m["bitmatch/compared_tokens"] == 2 * 4 * 6 and m["bitmatch/compared_seqs"] == 8, m
        assert m["training/rollout_probs_diff_max"] == 0.0 and m["rollout_corr/k3_kl"] == 0.0, m
        assert m["actor/grad_norm"] > 0, m             # the weights the next step syncs have moved


def test_ray_ppo_fit_stock_actor_differs(task):
    """The control: verl's stock actor (bf16 autocast logprobs) in the same loop; the check, set to log,
    finds mismatching tokens, and verl's own rollout-correction KL is not 0."""
    (m,) = _fit(task, gpus=1, steps=1, bitmatch=False, on_mismatch="log")
    assert m["bitmatch/mismatch_tokens"] > 0 and m["bitmatch/diff_max"] > 0, m
    assert m["rollout_corr/k3_kl"] != 0.0, m
