"""`bitmatch check`: zero mismatches on the ops, and every control finds one."""
from bitmatch.cli import main
from bitmatch.cli.check import main as check


def test_check_table(capsys):
    rc = check(["--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "all ops bitmatched" in out and "every control found a mismatch" in out
    ops = {line.split()[0] for line in out.splitlines()[1:] if line and not line.startswith(("backends", "control"))}
    assert {"linear", "rms_norm", "fused_add_rms_norm", "apply_rotary", "silu_and_mul", "attention",
            "token_logprobs"} <= ops
    assert out.count("(want >0)") == 3 and "0 (want >0)" not in out


def test_unknown_command(capsys):
    assert main(["nope"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_temperature_control_formulas_differ_at_realistic_scale():
    """The control's two stock formulas (vLLM: x / t, a per-row tensor; TRL's fused head:
    x * (1/t)) are the same math but give other logprob bits in every row at logits ~ N(0, 4)
    over Qwen's 151,936 vocabulary."""
    import torch

    from bitmatch.diagnostics.controls import engine_logprobs, trainer_logprobs
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(4, 151936, generator=g) * 4).bfloat16().float()
    t = torch.tensor([0.6, 0.7, 0.85, 0.95])
    eng, tr = engine_logprobs(x, t), trainer_logprobs(x, t)
    assert torch.allclose(eng, tr, rtol=0, atol=1e-4)      # the same math
    differ = (eng.view(torch.int32) != tr.view(torch.int32)).float().mean(-1)
    assert bool((differ > 0.01).all()), differ


def _control_rows(out):
    return [ln.split("  ")[0] for ln in out.splitlines() if ln.startswith("control:")]


def test_check_runs_the_stock_controls_of_bitmatch_controls(capsys):
    """`bitmatch check` and `check --family` run exactly ``bitmatch.diagnostics.controls.stock_controls(device)``
    (one definition; the family adds its own HF forward), and the CUDA list has every stock
    kernel the contract replaces on the GPU (built lazily: listing them allocates nothing)."""
    from bitmatch.cli.check import _cases
    from bitmatch.diagnostics.controls import stock_controls
    from bitmatch.diagnostics.family_check import family_cases
    names = [c.name for c in stock_controls("cpu")]
    assert [r[0] for r in _cases("cpu") if r[3]] == names
    assert [r[0] for r in family_cases("dense", "cpu", 1) if r[3]] == names + ["control: HF forward"]
    cuda = [c.name for c in stock_controls("cuda")]
    assert {"control: F.linear bf16 4096x4096", "control: F.linear bf16 4096x12288",
            "control: SDPA decode L=2048", "control: x/T vs x*(1/T)"} <= set(cuda)


def test_a_control_that_finds_no_mismatch_fails_the_check(monkeypatch, capsys, tmp_path):
    """A control swapped for an invariant op (bitmatch's own linear) finds no mismatch: the check
    exits 1 and names it, in the table, the verdict and the JSON."""
    import json

    import torch

    import bitmatch.diagnostics.controls as C
    import bitmatch.kernels as K
    from bitmatch.cli import check as cli
    from bitmatch.testing import assert_batch_invariant

    real = C.stock_controls

    def invariant_linear():
        g = torch.Generator().manual_seed(0)
        w, x = torch.randn(64, 96, generator=g).bfloat16(), torch.randn(8, 96, generator=g).bfloat16()
        assert_batch_invariant(lambda r: K.linear(r, w), x, max_batch=64, cases=4)
        return 4
    fake = C.Control("control: fake", "batch", invariant_linear)
    monkeypatch.setattr(C, "stock_controls", lambda d: real(d)[:1] + [fake])
    full = cli._cases
    monkeypatch.setattr(cli, "_cases", lambda d: [r for r in full(d) if r[3] or r[0] == "rms_norm"])
    path = tmp_path / "check.json"
    assert cli.main(["--device", "cpu", "--json", str(path)]) == 1
    out = capsys.readouterr().out
    assert "control: fake" in out and "0 (want >0)" in out
    assert "1 control(s) found NO mismatch" in out and out.rstrip().endswith("control: fake (cpu)"), out
    report = json.loads(path.read_text())
    assert report["exit_code"] == 1 and report["controls_without_mismatch"] == ["control: fake (cpu)"]
    assert report["ops_mismatched"] == [] and {r["op"] for r in report["rows"]} == {
        "rms_norm", "control: F.linear fp32", "control: fake"}
    assert [r["mismatch_found"] for r in report["rows"] if r["control"]] == [True, False]


def test_engine_style_sdpa_same_values():
    """The CUDA SDPA control's engine-style calls (is_causal prefill, unmasked one-token decode)
    compute the same attention as the masked calls (within fp32 rounding)."""
    import torch

    from bitmatch.testing import stock_sdpa_paged, stock_sdpa_prefill
    g = torch.Generator().manual_seed(4)
    n = 40
    q, k, v = (torch.randn(n, h, 32, generator=g) for h in (4, 2, 2))
    cu = torch.tensor([0, n], dtype=torch.int32)
    ref = stock_sdpa_prefill(q, k, v, cu, 0.2)
    assert torch.allclose(stock_sdpa_prefill(q, k, v, cu, 0.2, engine_style=True), ref, atol=1e-5)
    kc, vc = k.view(n // 8, 8, 2, 32), v.view(n // 8, 8, 2, 32)      # block size 8, identity table
    bt = torch.arange(n // 8, dtype=torch.int32)[None]
    for t in (0, 17, n - 1):
        qsl, lens = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([t + 1], dtype=torch.int32)
        got = stock_sdpa_paged(q[t:t + 1], kc, vc, bt, qsl, lens, 0.2, engine_style=True)
        assert torch.allclose(got, ref[t:t + 1], atol=1e-5)


def test_console_entry_answers_help_and_version_without_torch():
    # the console script (pyproject: bitmatch.cli:main) answers these before torch loads
    import subprocess
    import sys
    code = ("import sys; from bitmatch.cli import main; rc = main(['--help']); rc2 = main(['--version']); "
            "rc3 = main(['nope']); print(rc, rc2, rc3, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "0 0 2 False", out.stdout
    assert "replay" in out.stdout and "unknown command 'nope'" in out.stderr
