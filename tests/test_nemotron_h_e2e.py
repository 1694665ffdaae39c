"""benchmarks/families/nemotron_h_e2e.py's logic on CPU (tiny widths, reference kernels): the whole-model diff
with its stock control, the per-block-type diffs and the op locator that bisect a GPU mismatch
(they found the H200's engine != trainer on this benchmark's hybrid config: every op equal when
eager, only Mamba blocks differing with graphs: a capture's warm-up advancing the Mamba state)."""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from families import nemotron_h_e2e  # noqa: E402


def test_diff_per_block_type_and_locate(tmp_path):
    nemotron_h_e2e.main(["--out", str(tmp_path), "--device", "cpu", "--smoke", "--sections", "diff,diff_blocks,locate"])
    d = json.load(open(tmp_path / "nemotron_h_e2e.json"))
    assert d["errors"] == {}
    sec = d["sections"]
    for row in sec["diff"]:
        assert row["tokens"] > 0 and row["mismatches"] == 0
        assert row["control_stock_hf_mismatches"] > 0  # HF's own forward differs
    assert sorted(sec["diff_blocks"]) == sorted("M,E,*,-".split(","))
    for rows in sec["diff_blocks"].values():
        assert all(r["tokens"] > 0 and r["mismatches"] == 0 for r in rows)
    assert "all" in sec["locate"] and "bit-identical" in sec["locate"]
