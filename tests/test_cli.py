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
