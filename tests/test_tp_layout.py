"""benchmarks/parallel/tp_layout.py's logic on CPU (gloo, 2 ranks, tiny widths): the whole model at TP = 2 in the
gather-only layout gives TP = 1's trainer logprobs and rollout bit for bit, and the stock layout
(o_proj / down_proj partials all-reduced, ``row_parallel="allreduce"``) is the control that differs.
The same script measures both layouts' cost on GPUs (NCCL)."""
from __future__ import annotations

import json
import os
import sys

# spawned ranks unpickle parallel.tp_layout.worker by module name: benchmarks/ goes on sys.path
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from parallel import tp_layout  # noqa: E402


def test_tp2_gather_layout_equals_tp1_and_stock_layout_differs(tmp_path):
    tp_layout.main(["--out", str(tmp_path), "--device", "cpu", "--smoke", "--world", "2"])
    res = json.load(open(tmp_path / "tp_layout.json"))["sections"]["tp_layout"]
    g, s = res["tp2_gather"], res["tp2_allreduce"]
    assert g["of"] > 20
    assert g["mismatches_per_rank"] == [0, 0]
    assert g["rollout"]["token_mismatches"] == 0 and g["rollout"]["logprob_mismatches_on_equal_tokens"] == 0
    assert res["tp1_rollout_eager"]["token_mismatches"] == 0
    assert res["tp1_rollout_eager"]["logprob_mismatches_on_equal_tokens"] == 0
    # the control: the stock row-parallel layer's all-reduce changes the trainer's bits on every rank
    assert all(m > 0 for m in s["mismatches_per_rank"])


def test_shard_linear_section_runs_both_layouts(tmp_path):
    # --world 1: a rank's row-parallel linear in each layout, timed on one device (the smoke: CPU)
    tp_layout.main(["--out", str(tmp_path), "--device", "cpu", "--smoke", "--world", "1"])
    rows = json.load(open(tmp_path / "tp_shard_linear.json"))["sections"]["shard_linear"]
    assert [(r["tokens"], r["tp"]) for r in rows] == [(t, tp) for t in (1, 8) for tp in (2, 4, 8)]
    assert all(r["gather_rows_ms"] > 0 and r["stock_cols_cublas_ms"] > 0 for r in rows)


def test_dp_ep_layout_equals_one_process_and_stock_ep_differs(tmp_path):
    # --layout dp_ep: each rank its own batch and prompts through data-parallel attention + EP = 2
    tp_layout.main(["--out", str(tmp_path), "--device", "cpu", "--smoke", "--world", "2", "--layout", "dp_ep"])
    res = json.load(open(tmp_path / "tp_dp_ep.json"))["sections"]["dp_ep"]
    assert res["slot_order"]["of"] > 20
    assert res["slot_order"]["mismatches_per_rank"] == [[0, 0, 0], [0, 0, 0]]
    assert all(m[0] > 0 for m in res["stock_allreduce"]["mismatches_per_rank"])  # the control
