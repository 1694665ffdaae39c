"""tests/conftest.py under CI: a skip whose reason is a broken environment fails the run, an
expected skip stays a skip, and the end-of-run section counts skips by reason. Control: the same
files without BITMATCH_CI skip and pass."""
from __future__ import annotations

from pathlib import Path

pytest_plugins = ["pytester"]

FILES = {
    "test_module_skip": 'import pytest\npytest.skip("triton was imported before TRITON_INTERPRET=1 could be set", '
                        'allow_module_level=True)\n',
    "test_body_skips": '''import pytest

def test_not_importable():
    pytest.skip("bitmatch.engine not importable yet: boom")

def test_dev_dependency_missing():
    pytest.importorskip("trl")  # present here: the conftest's check is on the reason text
    pytest.skip("could not import 'trl': No module named 'trl'")

def test_expected():
    pytest.skip("vllm is not installed (pip install bitmatch[vllm])")

@pytest.mark.interpreter
def test_interpreter():
    pass

def test_passes():
    pass
''',
}


def _run(pytester, monkeypatch, ci: bool):
    pytester.makeconftest(Path(__file__).with_name("conftest.py").read_text())
    pytester.makeini("[pytest]\nmarkers =\n    interpreter: test\n")
    pytester.makepyfile(**FILES)
    monkeypatch.setenv("TRITON_INTERPRET", "0")   # the interpreter test's environment is broken too
    if ci:
        monkeypatch.setenv("BITMATCH_CI", "1")
    else:
        monkeypatch.delenv("BITMATCH_CI", raising=False)
    return pytester.runpytest_subprocess("-p", "no:xdist", "-p", "no:cacheprovider", "--continue-on-collection-errors")


def test_broken_environment_skips_fail_under_ci(pytester, monkeypatch):
    r = _run(pytester, monkeypatch, ci=True)
    r.assert_outcomes(passed=1, skipped=1, failed=2, errors=2)
    out = r.stdout.str()
    assert out.count("a failure under BITMATCH_CI=1") >= 4, out
    assert "skipped    1: vllm is not installed" in out, out          # the expected skip stays one
    assert r.ret != 0


def test_control_without_ci_the_same_files_skip(pytester, monkeypatch):
    r = _run(pytester, monkeypatch, ci=False)
    r.assert_outcomes(passed=1, skipped=5)
    out = r.stdout.str()
    assert "a failure under BITMATCH_CI=1" not in out and r.ret == 0, out
    assert "passed 1  skipped 5" in out, out
    assert "skipped    1: needs TRITON_INTERPRET=1 (set to '0' in this environment)" in out, out
