"""`bitmatch locate` and `bitmatch check --family`: a fault injected at a known op (a perturbed
weight, a stock kernel, the other temperature formula) is named with its layer and op; a healthy
model reports none on every pair; the JSON report's schema; the family check on every registered
family (its controls must find mismatches)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from bitmatch.cli import main
from bitmatch.cli.check import main as check
from bitmatch.diagnostics.verify import locate_pair, parse_inject
from bitmatch.models.registry import families
from bitmatch.testing.models import random_prompts, tiny_model

PROMPTS = random_prompts(3, 4, 16, seed=1)


@pytest.fixture(scope="module")
def moe():
    # layers 0 and 2 MoE, layer 1 dense (mlp_only_layers): every op kind of the family
    return tiny_model("qwen3moe-e8-k2", dtype=torch.bfloat16, seed=0)


def _assert_named(r, name):
    assert r.first_divergent == name, r.summary()
    parts = name.split(".")
    if parts[0] == "layers":
        assert (r.layer, r.op) == (int(parts[1]), ".".join(parts[2:]))
    assert r.position is not None and r.element is not None
    assert r.value_a != r.value_b and r.hex_a != r.hex_b and r.hex_a.startswith("0x")
    rows = {o["name"]: o for o in r.ops}
    assert rows[name]["status"] == "DIFFERS" and rows[name]["fingerprint_a"] != rows[name]["fingerprint_b"]
    before = r.ops[: [o["name"] for o in r.ops].index(name)]
    assert before and all(o["status"] in ("same", "within tol", "not compared") for o in before)


def test_engine_healthy_reports_none(moe):
    (r,) = locate_pair("engine", moe, PROMPTS)
    assert r.bitmatched, r.summary()
    assert r.ops_compared > 40 and r.logprobs["mismatches"] == 0 and r.logprobs["total"] == 24
    assert all(o["status"] == "same" and o["fingerprint_a"] == o["fingerprint_b"] for o in r.ops)


@pytest.mark.parametrize("inject,dtype,want", [
    ("weight:1.mlp.down_proj", torch.bfloat16, "layers.1.mlp.down_proj"),
    ("kernel:moe_experts", torch.bfloat16, "layers.0.mlp.experts"),
    ("kernel:silu_and_mul", torch.float32, "layers.1.mlp.act_fn"),     # bf16: the stock op has the same bits
])
def test_engine_fault_named(inject, dtype, want, moe):
    model = moe if dtype == torch.bfloat16 else tiny_model("qwen3moe-e8-k2", dtype=dtype, seed=0)
    (r,) = locate_pair("engine", model, PROMPTS, inject=inject)
    _assert_named(r, want)
    assert r.logprobs["mismatches"] > 0


def test_engine_temperature_formula_named(moe):
    """logits * (1/T) in the engine's sampler: every op through lm_head agrees, the logprobs differ."""
    (r,) = locate_pair("engine", moe, PROMPTS, inject="temperature", temperature=0.7)
    _assert_named(r, "logprobs")
    assert {o["name"]: o["status"] for o in r.ops}["lm_head"] == "same"


def test_schedule_pair_healthy_and_weight_fault():
    model = tiny_model("qwen2-hd64-gqa1-bias-sw", dtype=torch.bfloat16, seed=0)   # sliding window on layer 1
    prompts = random_prompts(2, 9, 12, seed=2)
    healthy = locate_pair("schedule", model, prompts)
    assert [r.comparison.split(" vs ")[0] for r in healthy] == [
        "packed prefill", "chunk split A", "all sequences in one batch"]
    assert all(r.bitmatched for r in healthy), [r.summary() for r in healthy]
    for r in locate_pair("schedule", model, prompts, inject="weight:1.self_attn.v_proj"):
        _assert_named(r, "layers.1.self_attn.v_proj")


def test_hf_pair_parity_and_fault(moe):
    (r,) = locate_pair("hf", moe, PROMPTS)
    assert r.bitmatched and r.tolerance == 1e-4, r.summary()
    status = {o["name"]: o for o in r.ops}
    assert status["layers.0.mlp.experts"]["status"] == "within tol" and status["lm_head"]["error"] > 0  # not bits
    assert status["layers.0.self_attn.attn"]["ref"] == "HF layers.0.self_attn.o_proj input"
    assert status["layers.0.self_attn.rotary"]["status"] == "not compared"   # no HF module computes it alone
    (f,) = locate_pair("hf", moe, PROMPTS, inject="weight:2.self_attn.k_norm")
    _assert_named(f, "layers.2.self_attn.k_norm")
    assert f.error > 1e-3


def _cli_json(args, tmp_path, env=None):
    out = tmp_path / "report.json"
    res = subprocess.run([sys.executable, "-m", "bitmatch.cli", "locate", *args, "--json", str(out)],
                         capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=300)
    return res, json.loads(out.read_text())


def test_backend_pair_under_interpreter(tmp_path):
    pytest.importorskip("triton")
    res, rep = _cli_json(["--family", "dense", "--pair", "backend", "--prompts", "2", "--max-len", "9"], tmp_path,
                         {"TRITON_INTERPRET": "1"})
    assert res.returncode == 0, res.stdout + res.stderr
    (r,) = rep["results"]
    assert r["bitmatched"] and r["side_b"].startswith("triton") and 0 < r["tolerance"] <= 1e-3
    assert all(o["status"] == "within tol" for o in r["ops"])


def test_json_schema_and_exit_codes(tmp_path, capsys):
    rc = main(["locate", "--family", "qwen3_moe", "--pair", "engine", "--inject", "weight:0.self_attn.o_proj",
               "--format", "json", "--json", str(tmp_path / "r.json")])
    printed = json.loads(capsys.readouterr().out)
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rc == 1 and printed == rep and rep["bitmatched"] is False
    assert {"command", "versions", "model", "dtype", "pair", "inject", "prompts", "results"} <= rep.keys()
    (r,) = rep["results"]
    assert {"first_divergent", "layer", "op", "position", "element", "value_a", "value_b", "hex_a", "hex_b",
            "error", "tolerance", "comparison", "side_a", "side_b", "ops", "logprobs", "bitmatched"} <= r.keys()
    assert (r["first_divergent"], r["layer"], r["op"]) == ("layers.0.self_attn.o_proj", 0, "self_attn.o_proj")
    assert isinstance(r["position"], list) and len(r["position"]) == 2
    assert all({"name", "status", "error", "fingerprint_a", "fingerprint_b"} <= o.keys() for o in r["ops"])
    assert main(["locate", "--family", "dense", "--pair", "schedule", "--prompts", "2", "--max-len", "8"]) == 0
    out = capsys.readouterr().out
    assert out.count("all ") >= 3 and "verdict: no divergent op" in out


def test_engine_pair_at_tp2(tmp_path, capsys):
    """``--tp 2``: both sides on two forked gloo ranks, each on its share of the model (the family's
    own forward and recorder); clean: every op the same; the stock linear planted on the engine's
    side is named (the control). Other pairs at TP > 1 are refused by flag."""
    base = ["locate", "--family", "qwen3_moe", "--pair", "engine", "--tp", "2", "--prompts", "2",
            "--max-tokens", "3", "--format", "json"]
    assert main(base) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["tp"] == 2 and rep["bitmatched"] and len(rep["results"][0]["ops"]) > 20
    assert main(base + ["--inject", "kernel:linear"]) == 1
    (r,) = json.loads(capsys.readouterr().out)["results"]
    assert r["first_divergent"].endswith("_proj") and r["logprobs"]["mismatches"] > 0
    assert main(["locate", "--family", "dense", "--pair", "schedule", "--tp", "2"]) == 2
    assert "--pair engine" in capsys.readouterr().err


def test_bad_input_is_named(capsys):
    with pytest.raises(ValueError, match="kernel:OP"):
        parse_inject("kernel:nope")
    with pytest.raises(ValueError, match="no parameter"):
        locate_pair("schedule", tiny_model("qwen3-hd64-gqa4-tied"), PROMPTS[:1], inject="weight:0.mlp.nope")
    assert main(["locate", "--family", "nope", "--pair", "engine"]) == 2
    assert "unknown family 'nope'" in capsys.readouterr().err
    assert main(["locate", "--pair", "engine"]) == 2
    assert check(["--family", "nope"]) == 2


@pytest.mark.parametrize("family", [f.name for f in families()])
def test_check_family(family, capsys):
    """Every op the family calls, at its tiny shapes, with 0 mismatches; every control mismatches."""
    rc = check(["--device", "cpu", "--family", family, "--cases", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "all ops bitmatched" in out and "every control found a mismatch" in out, out
    ops = {line.split()[0] for line in out.splitlines()[1:] if line and not line.startswith(("backends", "control"))}
    assert {"linear", "token_logprobs", "model"} <= ops, ops
    harnessed = [ln for ln in out.splitlines() if "batch, padding" in ln or "schedule (prefill" in ln]
    assert len(harnessed) >= 5 and all(ln.split()[-2] == "0" for ln in harnessed)
    assert out.count("(want >0)") >= 3 and "0 (want >0)" not in out


@pytest.mark.parametrize("family", [f.name for f in families()])
def test_check_family_at_tp2(family, tmp_path, capsys):
    """``--tp 2``: every op at a rank's shapes on two gloo ranks, the model's schedule row on the
    share, TP 2 == TP 1 bits, and the all-reduce row-parallel layout as the control that differs."""
    rc = check(["--device", "cpu", "--family", family, "--cases", "2", "--tp", "2", "--json", str(tmp_path / "c.json")])
    out = capsys.readouterr().out
    assert rc == 0, out
    rep = json.loads((tmp_path / "c.json").read_text())
    rows = {r["op"]: r for r in rep["rows"]}
    assert rep["tp"] == 2 and not rep["ops_mismatched"] and not rep["controls_without_mismatch"]
    tp_row = rows[f"model ({family}), TP 2 vs TP 1"]
    assert tp_row["cases"] == 1 and not tp_row["mismatch_found"]
    assert rows["control: all-reduce row-parallel"]["mismatch_found"]
    assert sum(1 for r in rep["rows"] if not r["control"] and r["cases"] > 0) >= 5
    assert check(["--family", family, "--tp", "2", "--device", "cuda"]) == 2
