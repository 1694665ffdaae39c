"""Every ```python block of README.md runs (CPU, tiny models built in code, no network).

A block whose first line is ``# needs: PKG`` is skipped, with that reason, where PKG does not import
(``# needs: verl`` blocks carry the ``verl`` mark: scripts/test_verl.sh runs them in verl's environment);
blocks that need vLLM run in a subprocess (vLLM keeps process-wide state and may start processes
that re-import ``__main__``); the others run in this process, each in a fresh namespace named
``__main__``, so a block can use nothing another block defined.
"""
from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _blocks():
    text = README.read_text()
    out = []
    for m in BLOCK.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        code = m.group(1)
        # a verl block runs in the verl job (scripts/test_verl.sh: -m verl), verl's own environment
        marks = [pytest.mark.verl] if code.startswith("# needs: verl") else []
        out.append(pytest.param(code, id=f"README.md:{line}", marks=marks))
    return out


BLOCKS = _blocks()


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 5


@pytest.mark.parametrize("code", BLOCKS)
def test_readme_block_runs(code, tmp_path, monkeypatch):
    first = code.splitlines()[0].strip()
    needs = first[len("# needs:"):].split() if first.startswith("# needs:") else []
    for pkg in needs:
        if importlib.util.find_spec(pkg) is None:
            pytest.skip(f"README block needs {pkg}, which is not installed")
    assert "from_pretrained(\"" not in code and "load_dataset(" not in code, "a README block must not download"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if "vllm" in needs:
        path = tmp_path / "block.py"
        path.write_text(code)
        env = dict(os.environ, VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"), VLLM_CPU_OMP_THREADS_BIND="nobind")
        env.pop("BITMATCH", None)
        p = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, f"README vLLM block failed (rc {p.returncode}):\n{p.stderr[-6000:]}"
        return
    exec(compile(code, "README.md block", "exec"), {"__name__": "__main__"})


def test_readme_says_how_to_run_one_file_and_a_quick_tier():
    """Issue 51: `scripts/test.sh -x -q tests/X.py` collected the whole suite. The README names the
    one-file and quick-tier commands (tests/test_usability_new_user.py runs the script's choice)."""
    text = README.read_text()
    one = re.search(r"`bash scripts/test\.sh (tests/\S+\.py)`", text)
    assert one and (README.parent / one.group(1)).exists(), "README: how to run one test file"
    assert '`bash scripts/test.sh -m "not slow"`' in text, "README: the quick tier"


def test_readme_names_the_router_aux_loss_fix_for_every_family_that_needs_it():
    """Issue 51: the README named ``router_aux_loss_coef=0.0`` for Qwen3-MoE only; DeepSeek-V4's config
    carries a nonzero coefficient too (TRL then computes the loss, which attach refuses)."""
    from bitmatch.models import families

    text = README.read_text()
    rows = {line.split("|")[1].strip(" `"): line for line in text.splitlines() if line.startswith("| ")}
    need = [f.name for f in families()
            if getattr(f.tiny_config().get_text_config(), "router_aux_loss_coef", 0.0)]
    assert need, "no family carries a router aux loss: this test checks nothing"
    missing = [n for n in need if "router_aux_loss_coef=0.0" not in rows.get(n, "")]
    assert missing == [], f"support-matrix rows without router_aux_loss_coef=0.0: {missing}"


def _verl_test_overrides() -> list[str]:
    """The constant ``key=value`` overrides tests/test_verl_ray.py passes to verl's main_ppo."""
    import ast

    src = (README.parent / "tests" / "test_verl_ray.py").read_text()
    fn = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef) and n.name == "_overrides")
    return [c.value for c in ast.walk(fn)
            if isinstance(c, ast.Constant) and isinstance(c.value, str) and "=" in c.value]


def test_readme_verl_command_is_the_tested_one():
    """Issue 51: the README's ``main_ppo`` command ran verl's default V1 trainer, the test the legacy one
    (``trainer.use_v1=False``). The command uses only options the test sets, with the test's trainer,
    algorithm and bitmatch settings, and the README says what differs."""
    text = README.read_text()
    cmd = re.search(r"python -m verl\.trainer\.main_ppo (.*?)\n```", text, re.S).group(1).replace("\\\n", " ")
    readme = dict(o.lstrip("+").split("=", 1) for o in cmd.split())
    tested = dict(o.lstrip("+").split("=", 1) for o in _verl_test_overrides())
    src = (README.parent / "tests" / "test_verl_ray.py").read_text()
    untested = [k for k in readme if k not in tested and f'"{k}=' not in src and f'f"{k}=' not in src]
    assert untested == [], f"README verl options the test does not set: {untested}"
    same = ["trainer.use_v1", "algorithm.adv_estimator", "actor_rollout_ref.rollout.name",
            "actor_rollout_ref.rollout.calculate_log_probs", "actor_rollout_ref.rollout.tensor_model_parallel_size",
            "actor_rollout_ref.actor.strategy", "actor_rollout_ref.ref.strategy"]
    assert {k: readme.get(k) for k in same} == {k: tested[k] for k in same}
    assert "What differs" in text and "VERL_PLATFORM=cpu" in text
