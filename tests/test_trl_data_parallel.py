"""TRL data parallel on CPU: ``torchrun --nproc_per_node 2 examples/trl_grpo.py`` (gloo), the adapter
checking every generation step on every rank (on_mismatch="raise": a mismatch on any rank fails the
run) and gathering its metrics across ranks."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("trl")

_EX = pathlib.Path(__file__).resolve().parents[1] / "examples" / "trl_grpo.py"


def test_two_process_grpo_diff_zero_on_every_rank(tmp_path):
    env = dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(_EX), "--steps", "3", "--max-completion-length", "4", "--output-dir", str(tmp_path / "out")]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    checks = re.findall(r"bitmatch: (\d+) generation steps checked, (\d+) tokens, (\d+) mismatches", p.stdout)
    assert len(checks) == 2, p.stdout[-3000:]            # one summary per rank
    for steps, tokens, mismatches in checks:
        assert int(steps) == 3 and int(tokens) > 0 and int(mismatches) == 0


def test_two_process_grpo_with_data_parallel_experts(tmp_path):
    # a tiny Qwen3-MoE, its 8 experts spread over the 2 ranks (each keeps only its own), each rank its
    # own prompts: the engines step together and every rank's check holds
    env = dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(_EX), "--steps", "2", "--max-completion-length", "4", "--expert-parallel",
           "--output-dir", str(tmp_path / "out")]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    assert sorted(re.findall(r"rank (\d) of 2 holds experts (\d-\d)", p.stdout)) == [("0", "0-3"), ("1", "4-7")]
    checks = re.findall(r"bitmatch: (\d+) generation steps checked, (\d+) tokens, (\d+) mismatches", p.stdout)
    assert len(checks) == 2, p.stdout[-3000:]
    for steps, tokens, mismatches in checks:
        assert int(steps) == 2 and int(tokens) > 0 and int(mismatches) == 0
