"""What a new user hits first (issue 15): install surface, clear errors, CLI basics. One test per
defect; each asserts the message a user reads."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import tomllib
import warnings
from pathlib import Path

import pytest
import torch

import bitmatch
from bitmatch.engine import Engine, SamplingParams
from bitmatch.testing.models import tiny_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def small():
    return tiny_model("qwen3-hd64-gqa4-tied", dtype=torch.bfloat16, seed=0, num_hidden_layers=1,
                      max_position_embeddings=32)


@pytest.fixture()
def no_network(monkeypatch):
    """Every hub request is counted; ``fail`` decides what it raises (default: the network is down).
    Hub access on: huggingface_hub reads HF_HUB_OFFLINE once, at import, and a test that imported it
    first under HF_HUB_OFFLINE=1 (tests/test_readme.py's blocks) would leave it off for the worker."""
    import huggingface_hub
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    class Calls(list):
        fail = staticmethod(lambda name: OSError("[Errno -2] Name or service not known"))
    calls = Calls()

    def model_info(self, name, **kw):
        calls.append(name)
        raise calls.fail(name)
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", model_info)
    return calls


# ------------------------------------------------------------------------------ checkpoints

@pytest.mark.parametrize("path", ["./missing-model", "../nowhere/model", "/no/such/checkpoint", "~/nope-bitmatch"])
def test_missing_local_path_is_file_not_found_before_any_network(path, no_network):
    from bitmatch.models import load_model

    with pytest.raises(FileNotFoundError, match=f"Engine: no checkpoint folder at {path!r}"):
        Engine(path)
    with pytest.raises(FileNotFoundError, match=f"load_model: no checkpoint folder at {path!r}.*check the path"):
        load_model(path)
    assert no_network == []


def test_demo_with_missing_model_exits_2_with_the_message(capsys, no_network):
    from bitmatch.cli.demo import main

    with pytest.raises(SystemExit) as e:
        main(["--model", "./missing-model"])
    assert e.value.code == 2
    assert "--model: load_model: no checkpoint folder at './missing-model'" in capsys.readouterr().err


def test_missing_pathlike_is_file_not_found(tmp_path, no_network):
    from bitmatch.models import load_model

    with pytest.raises(FileNotFoundError, match="no checkpoint folder"):
        load_model(tmp_path / "model")  # a Path is always meant as a folder, even "org/name"-shaped
    assert no_network == []


def test_unreachable_hub_fails_after_one_request_with_the_fix(no_network):
    from bitmatch.models.hub import resolve_checkpoint

    t0 = time.time()
    with pytest.raises(ConnectionError, match="'no-org-bm/no-model-bm' is not a local folder .* the hub could not be "
                                              "reached .*HF_HUB_OFFLINE=1"):
        resolve_checkpoint("no-org-bm/no-model-bm", who="load_model")
    assert no_network == ["no-org-bm/no-model-bm"] and time.time() - t0 < 5  # no retry loop


def test_unknown_hub_name_is_value_error(no_network):
    from huggingface_hub.errors import RepositoryNotFoundError

    from bitmatch.models.hub import resolve_checkpoint

    def not_found(name):
        err = RepositoryNotFoundError.__new__(RepositoryNotFoundError)
        Exception.__init__(err, "404 Repository Not Found")
        return err
    no_network.fail = not_found
    with pytest.raises(ValueError, match="Engine: no model 'no-org-bm/typo' on the hub .*hf auth login"):
        resolve_checkpoint("no-org-bm/typo", who="Engine")
    with pytest.raises(ValueError, match="neither an existing folder nor a valid hub name"):
        resolve_checkpoint("bad name!!")
    assert no_network == ["no-org-bm/typo"]


def test_offline_hub_name_not_in_cache(monkeypatch, no_network):
    from huggingface_hub import constants

    from bitmatch.models.hub import resolve_checkpoint

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match="not in the hub cache, and hub access is off .*hf download"):
        resolve_checkpoint("no-org-bm/no-model-bm")
    assert no_network == []


def test_local_checkpoint_folder_loads(tmp_path, small):
    small.save_pretrained(tmp_path / "ckpt")
    eng = Engine(str(tmp_path / "ckpt"), num_gpu_blocks=8)
    out = eng.generate([[1, 5, 9]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


# ------------------------------------------------------------------------------ model / prompt

def test_patch_refuses_fp16_at_patch_time():
    m = tiny_model("qwen3-hd64-gqa4-tied", dtype=torch.float16, seed=0, num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"patch: the model's parameters are torch\.float16, but bitmatch computes "
                                         r"in bf16 or fp32: load it with dtype=torch\.bfloat16"):
        bitmatch.patch(m)
    bitmatch.patch(m, compute_dtype=torch.bfloat16)  # the fix the message names works


def test_prompt_longer_than_max_position_embeddings(small):
    eng = Engine(small, num_gpu_blocks=16)
    with pytest.raises(ValueError, match="prompt of 40 tokens leaves no room under the model's "
                                         "max_position_embeddings=32"):
        eng.add_request(list(range(3, 43)), SamplingParams(max_tokens=1))
    # a request that reaches the limit stops there ("length"), as vLLM's max_model_len does
    out = eng.generate([list(range(3, 31))], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 32
    assert out.outputs[0].finish_reason == "length"


# ------------------------------------------------------------------------------ CLI

def test_version_and_bare_command(capsys):
    from bitmatch.cli import main

    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"bitmatch {bitmatch.__version__} (torch ") and "transformers" in out
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: bitmatch {check,locate,replay,demo}") and "--version" in err


def test_every_demo_option_has_help(monkeypatch):
    from bitmatch.cli import demo

    class Got(Exception):
        pass

    def capture(self, argv=None):
        raise Got(self)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(Got) as e:
        demo.main([])
    parser = e.value.args[0]
    missing = [a.option_strings for a in parser._actions if not a.help]
    assert missing == [] and len(parser._actions) >= 9


def test_demo_passes_the_cache_by_the_name_the_forward_declares():
    """transformers 5.2x renamed forward's past_key_values to cache (the old name warns)."""
    from bitmatch.demo import _stock_decode_logprobs

    inner = tiny_model("qwen3-hd64-gqa4-tied", dtype=torch.float32, seed=0, num_hidden_layers=1)
    seen = []

    class NewStyle(torch.nn.Module):  # the 5.2x signature
        def __init__(self):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, use_cache=None):
            seen.append(cache is not None)
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              past_key_values=cache, use_cache=use_cache)
    seqs = [[1, 5, 9, 20, 21], [1, 7, 30]]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        new = _stock_decode_logprobs(NewStyle(), [[0, 1]], seqs, [3, 2], 0.9)
        old = _stock_decode_logprobs(inner, [[0, 1]], seqs, [3, 2], 0.9)
    assert seen and all(seen) and new == old


# ------------------------------------------------------------------------------ install surface

_EXTRA_ONLY = ["pytest", "xdist", "matplotlib", "triton", "trl", "peft", "vllm", "verl"]


def test_check_runs_on_the_base_install():
    """`bitmatch check` imports nothing that only an extra installs (hypothesis is a base dependency)."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.startswith("hypothesis") for d in deps)
    child = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {_EXTRA_ONLY!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked: an extra)")
sys.meta_path.insert(0, Block())
try:
    import triton
    sys.exit("the blocker does not block")
except ModuleNotFoundError:
    pass
import bitmatch.cli.check as check
full = check._cases
check._cases = lambda device: [r for r in full(device) if r[0] in ("rms_norm", "control: F.linear fp32")]
sys.exit(check.main(["--device", "cpu"]))
"""
    p = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=600,
                       cwd=str(ROOT), env=dict(os.environ, TRITON_INTERPRET="0"))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "all ops bitmatched" in p.stdout and "every control found a mismatch" in p.stdout


def test_no_reference_to_a_design_file_outside_the_repository():
    name = "DESIGN" + ".md"
    files = [ROOT / "README.md", ROOT / "pyproject.toml"] + [
        p for d in ("bitmatch", "examples", "scripts", "tests", "benchmarks", "docs")
        for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".md", ".sh", ".toml")]
    hits = [str(p.relative_to(ROOT)) for p in files if name in p.read_text(errors="ignore")]
    assert hits == [], f"{name} is not in the repository; point to docs/design.md: {hits}"
    assert "## 2. The invariance contract" in (ROOT / "docs" / "design.md").read_text()
    assert "docs/design.md" in (ROOT / "README.md").read_text()


def test_readme_install_lines_work_from_a_clone():
    readme = (ROOT / "README.md").read_text()
    for bad in ("pip install bitmatch[", 'pip install "bitmatch[', "pip install 'bitmatch["):
        assert bad not in readme  # bitmatch is not on the package index
    for line in ('pip install -e ".[trl]"', "bash scripts/install_vllm.sh", "pip wheel . -w dist"):
        assert line in readme, line
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"trl", "vllm", "plot", "dev"} <= set(extras)


def test_every_package_folder_ships():
    """pyproject's explicit package list names every folder with an __init__.py under bitmatch/ (a
    non-editable install, as on the GPU machine, ships only those), and nothing outside it."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    found = {".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "bitmatch").rglob("__init__.py")}
    assert all(p == "bitmatch" or p.startswith("bitmatch.") for p in listed), sorted(listed)
    assert found <= listed, f"packages missing from pyproject's list: {sorted(found - listed)}"
