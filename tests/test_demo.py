"""`bitmatch demo` end to end: Diff = 0 with bitmatch, a nonzero diff without."""
import json
import os

from bitmatch.cli.demo import main


def test_demo_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo"
    rc = main(["--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    rep = json.load(open(out / "report.json"))
    on, off = rep["bitmatch_on"], rep["bitmatch_off"]
    assert on["total"] >= 90 and on["mismatches"] == 0 and on["max_abs_diff"] == 0 and on["k3_kl"] == 0
    assert off["total"] == on["total"] and off["mismatches"] > 0 and off["max_abs_diff"] > 0
    assert os.path.getsize(out / "diff.png") > 1000
    assert "Diff = 0, KL = 0" in text and "BITMATCHED" in text


def test_demo_model_path(tmp_path):
    """--model with a saved checkpoint (no tokenizer there: token-id prompts)."""
    import torch

    from bitmatch.testing.models import tiny_model

    ckpt = tmp_path / "ckpt"
    tiny_model("llama-hd128-gqa8-llama3rope", dtype=torch.bfloat16, seed=1).save_pretrained(ckpt)
    out = tmp_path / "out"
    rc = main(["--model", str(ckpt), "--out", str(out), "--num-prompts", "5", "--max-tokens", "4", "--no-plot"])
    assert rc == 0
    rep = json.load(open(out / "report.json"))
    assert rep["bitmatch_on"]["mismatches"] == 0 and rep["bitmatch_on"]["total"] == 20
