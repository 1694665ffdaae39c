"""`bitmatch check`: zero mismatches on the ops, and every control finds one."""
from bitmatch.cli import check, main


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
    """The control's two stock formulas (vLLM: x / T tensor; trainer: x * (1/T)) give other
    logprob bits in every row at logits ~ N(0, 5) over Qwen's 151,936 vocabulary, T = 0.7."""
    import torch

    from bitmatch.cli import _stock_logprob_rows
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 151936, generator=g) * 5
    alone = torch.cat([_stock_logprob_rows(x[i:i + 1]) for i in range(4)])
    batch = _stock_logprob_rows(x)
    assert torch.allclose(alone, batch, rtol=0, atol=1e-4)      # the same math
    differ = (alone.view(torch.int32) != batch.view(torch.int32)).float().mean(-1)
    assert bool((differ > 0.01).all()), differ


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
