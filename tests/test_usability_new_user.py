"""What a new user hit (issue 51): imports from the folder above the clone, exit codes, dtype changes
that were silent, messages without a fix, README commands that were not the tested ones. One test per
defect; each asserts what the user reads."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_imports_work_from_the_folder_above_the_clone(tmp_path):
    """A clone in ``bitmatch/`` (no ``__init__.py``) beside the user's script: the installed package
    wins over the clone folder, which Python would otherwise import as an empty namespace package."""
    (tmp_path / "bitmatch").symlink_to(ROOT, target_is_directory=True)
    script = tmp_path / "script.py"
    script.write_text("import bitmatch, bitmatch.kernels, bitmatch.adapters\n"
                      "from bitmatch import is_patched, patch\n"
                      "print(bitmatch.patch.__module__, bitmatch.kernels.__name__, bitmatch.adapters.__name__)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, script.name], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "bitmatch.kernels bitmatch.adapters" in p.stdout, p.stdout


def test_every_test_module_holds_tests():
    """A helper module named ``test_*.py`` is collected and holds no test: pytest on it alone exits 5
    ("no tests ran"). Helpers are named without the prefix (``tests/sync_helpers.py``)."""
    import ast

    empty = []
    for p in sorted((ROOT / "tests").glob("test_*.py")):
        tree = ast.parse(p.read_text(), str(p))
        nodes = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        nodes += [m for c in tree.body if isinstance(c, ast.ClassDef) and c.name.startswith("Test")
                  for m in c.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
        if not any(n.name.startswith("test") for n in nodes):
            empty.append(p.name)
    assert empty == [], f"test modules without a test (rename helpers without the test_ prefix): {empty}"


def _fake_python(tmp_path, installed: bool):
    """A ``python`` on PATH that logs its arguments and succeeds (fails the install probe, read from
    stdin, when ``installed`` is False), so scripts/test.sh's decisions are read without running them."""
    bindir = tmp_path / "bin"
    bindir.mkdir(parents=True)
    log = tmp_path / "calls.log"
    probe = "exit 0" if installed else "exit 1"
    (bindir / "python").write_text(f'#!/usr/bin/env bash\necho "python $*" >> {log}\n'
                                   f'if [ "$1" = "-" ]; then cat > /dev/null; {probe}; fi\nexit 0\n')
    (bindir / "python").chmod(0o755)
    return dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}"), log


def _test_sh(tmp_path, *args, installed=True):
    env, log = _fake_python(tmp_path, installed)
    p = subprocess.run(["bash", str(ROOT / "scripts" / "test.sh"), *args], env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    calls = log.read_text().splitlines()
    return [c for c in calls if " pytest " in c], [c for c in calls if "pip install" in c]


def test_test_sh_runs_one_file_without_reinstalling(tmp_path):
    """``scripts/test.sh tests/X.py`` runs that file, not the whole folder beside it, and an install
    already in place is not redone (it reinstalled vLLM on every run)."""
    runs, pips = _test_sh(tmp_path, "-x", "-q", "tests/test_switch.py")
    assert len(runs) == 1 and runs[0].split()[-3:] == ["-x", "-q", "tests/test_switch.py"], runs
    assert " tests " not in runs[0] + " ", runs
    assert pips == [], pips
    runs, _ = _test_sh(tmp_path / "b", "tests/test_switch.py::test_unknown_value_names_the_fix")
    assert " tests " not in runs[0] + " ", runs
    runs, _ = _test_sh(tmp_path / "c", "-m", "not slow")  # the quick tier: the whole folder
    assert " tests -m not slow" in runs[0], runs


def test_test_sh_installs_when_missing(tmp_path):
    runs, pips = _test_sh(tmp_path, installed=False)
    assert any("torch==2.13.0" in c for c in pips) and any(".[dev]" in c for c in pips), pips
    assert runs and runs[0].endswith(" tests"), runs


@pytest.mark.slow
def test_trl_example_trains_an_moe_checkpoint(tmp_path):
    """``examples/trl_grpo.py --model <MoE checkpoint>``: Qwen3-MoE and DeepSeek-V4 configs carry a
    nonzero router_aux_loss_coef, which attach refuses; the example sets it to 0.0 for --model."""
    pytest.importorskip("trl")
    import torch

    from bitmatch.testing.models import tiny_model
    from bitmatch.testing.trl import char_tokenizer, load_example

    ckpt = tmp_path / "moe"
    tiny_model("qwen3moe-e4-k1-step2", dtype=torch.float32, seed=0).save_pretrained(ckpt)
    char_tokenizer().save_pretrained(ckpt)
    trainer = load_example("trl_grpo").main(["--model", str(ckpt), "--steps", "1", "--max-completion-length", "3",
                                             "--output-dir", str(tmp_path / "out")])
    assert trainer.args.router_aux_loss_coef == 0.0
    assert trainer._bitmatch.history and all(h.mismatches == 0 for h in trainer._bitmatch.history)


def test_demo_model_without_a_tokenizer_runs_on_token_ids(tmp_path, capsys):
    """A checkpoint saved without a tokenizer: transformers 5 builds an empty one from config.json
    (every prompt encoded to nothing), which reached the engine as an internal error (exit 3). The
    demo runs on token-id prompts, as for a checkpoint whose tokenizer does not load, and says so."""
    import torch

    from bitmatch.cli.demo import main
    from bitmatch.testing.models import tiny_model

    ckpt = tmp_path / "ckpt"
    tiny_model("qwen3-hd64-gqa4-tied", dtype=torch.bfloat16, seed=0, num_hidden_layers=1).save_pretrained(ckpt)
    rc = main(["--model", str(ckpt), "--out", str(tmp_path / "out"), "--num-prompts", "3", "--max-tokens", "2",
               "--no-plot"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "no tokenizer" in out and "token ids" in out and "tokenizer.save_pretrained" in out, out


def test_demo_dtype_without_model_is_refused(tmp_path, capsys):
    """``--dtype float32`` without ``--model`` was ignored (the tiny model is bf16): exit 2, named."""
    from bitmatch.cli.demo import main

    with pytest.raises(SystemExit) as e:
        main(["--dtype", "float32", "--out", str(tmp_path / "out"), "--num-prompts", "1", "--max-tokens", "1",
              "--no-plot"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--dtype float32" in err and "--model" in err, err


def _saved(tmp_path, dtype, name="ckpt"):
    import torch

    from bitmatch.testing.models import tiny_model

    path = tmp_path / name
    tiny_model("qwen3-hd64-gqa4-tied", dtype=torch.float32, seed=0, num_hidden_layers=1).to(dtype).save_pretrained(path)
    return path


def test_load_model_says_what_it_converted(tmp_path):
    """fp32 and fp16 checkpoints became bf16 without a word (load_model's default, and Engine(path))."""
    import warnings

    import torch

    from bitmatch.engine import Engine
    from bitmatch.models import load_model

    for stored in (torch.float32, torch.float16):
        path = _saved(tmp_path, stored, str(stored))
        with pytest.warns(UserWarning, match=rf"stored in {stored}; loaded as torch.bfloat16.*dtype=torch.float32"):
            model = load_model(str(path))
        assert model.lm_head.weight.dtype == torch.bfloat16
    with pytest.warns(UserWarning, match="stored in torch.float32; loaded as torch.bfloat16"):
        Engine(str(tmp_path / "torch.float32"), num_gpu_blocks=8)
    bf16 = _saved(tmp_path, torch.bfloat16, "bf16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing converted, nothing said
        load_model(str(bf16))
        load_model(str(tmp_path / "torch.float32"), dtype=torch.float32)


def test_load_model_refuses_fp16_at_the_call(tmp_path):
    """``load_model(p, dtype=torch.float16)`` was accepted and refused only at the first forward."""
    import torch

    from bitmatch.models import load_model

    path = _saved(tmp_path, torch.bfloat16)
    for dtype in (torch.float16, "float16"):
        with pytest.raises(ValueError, match=r"load_model: dtype=.*float16.*bf16 or fp32.*dtype=torch.bfloat16"):
            load_model(str(path), dtype=dtype)


def _tiny(dtype):
    import torch

    from bitmatch.testing.models import tiny_model

    return tiny_model("qwen3-hd64-gqa4-tied", dtype=torch.float32, seed=0, num_hidden_layers=1).to(dtype)


def test_publish_refuses_fp16_weights_and_names_to():
    """An fp16 trainer's publish was accepted (its forward is refused anyway); ``to=<a model>`` gave
    AttributeError ``... has no attribute 'send'``."""
    import torch

    from bitmatch import sync

    engine_model = _tiny(torch.bfloat16)
    receiver = sync.receive(engine_model)
    with pytest.raises(ValueError, match=r"publish: .*torch.float16.*bf16 or fp32"):
        sync.publish(_tiny(torch.float16), 1, to=receiver)
    with pytest.raises(TypeError, match=r"publish: to= takes a Receiver .*sync.receive\(model\).*Qwen3ForCausalLM"):
        sync.publish(_tiny(torch.float32), 1, to=engine_model)
    assert sync.publish(_tiny(torch.float32), 1, to=receiver).version == 1  # the control


def test_token_logprobs_on_fp16_names_the_fix():
    """``token_logprobs`` on an fp16 model failed inside a norm (``rms_norm: x has dtype torch.float16``)."""
    import torch

    from bitmatch import token_logprobs

    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError,
                       match=r"token_logprobs: .*torch.float16.*bf16 or fp32.*compute_dtype=torch.bfloat16"):
        token_logprobs(_tiny(torch.float16), ids)
    assert token_logprobs(_tiny(torch.float16), ids, compute_dtype=torch.bfloat16).shape == (1, 2)


def test_trl_attach_on_fp16_names_the_fix(tmp_path):
    """TRL with an fp16 model: ``patch: compute_dtype must be ...`` with no how-to."""
    pytest.importorskip("trl")
    import torch

    import bitmatch.adapters.trl
    from bitmatch.testing.trl import grpo_trainer

    trainer = grpo_trainer(_tiny(torch.float16), tmp_path, 1)
    with pytest.raises(ValueError, match=r"attach: .*torch.float16.*bf16 or fp32.*compute_dtype=torch.bfloat16"):
        bitmatch.adapters.trl.attach(trainer)


def test_tiny_model_takes_a_family_name():
    """``tiny_model("dense")`` (the family name the README and CLI use) gave a bare KeyError."""
    from bitmatch.models import family_of
    from bitmatch.testing.models import tiny_config, tiny_model

    assert family_of(tiny_model("dense", num_hidden_layers=1)).name == "dense"
    assert type(tiny_config("dense")).__name__ == type(tiny_config("qwen3-hd64-gqa4-tied")).__name__
    with pytest.raises(ValueError, match=r"no registered family's tiny config.*'dense'"):
        tiny_model("densest")
