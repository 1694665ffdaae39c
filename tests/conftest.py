"""Test session setup: the Triton interpreter, seeding, and skips that hide a broken environment.

TRITON_INTERPRET=1 is set here, before pytest imports any test module: Triton reads it when a
kernel is decorated (``@triton.jit``, at the import of each kernel module) and
``bitmatch.kernels.triton`` patches the interpreter at its import. The per-file guards this
replaces skipped whenever triton was already imported, which in the full collection it always
was (the first module importing transformers imports it through torch._dynamo). It changes
nothing for CPU tests on the reference backend: ``backend_for`` sends CPU tensors to the reference
unless a test forces ``use_backend("triton")``.

Under CI (``BITMATCH_CI=1``, set by scripts/test.sh) a skip whose reason says the environment is
broken (the interpreter not set, triton imported first, a module "not importable", a [dev]
dependency missing) is a failure: such a skip hides tests that would otherwise never run.
Expected skips (vllm or verl not installed) stay skips. scripts/test.sh prints the skips by reason.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("VLLM_CACHE_ROOT", "/tmp/bitmatch-vllm-cache")

import re  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# reasons that mean "this environment cannot run the test", never "the test does not apply here"
BROKEN_ENVIRONMENT = re.compile(
    r"TRITON_INTERPRET"                                      # interpreter not set / triton imported first
    r"|not importable"                                       # a package module that fails to import
    r"|could not import '(triton|transformers|trl|peft|hypothesis)\b",  # a [dev] dependency missing
    re.IGNORECASE)


def in_ci() -> bool:
    return os.environ.get("BITMATCH_CI") == "1"


def skip_reason(longrepr) -> str:
    """The reason text of a skipped report (pytest stores (path, line, "Skipped: reason"))."""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def broken_environment(reason: str) -> bool:
    return bool(BROKEN_ENVIRONMENT.search(reason))


def _fail_if_broken(report) -> None:
    if not (report.skipped and in_ci()):
        return
    reason = skip_reason(report.longrepr)
    if broken_environment(reason):
        report.outcome = "failed"
        report.longrepr = (f"skipped for a broken environment, a failure under BITMATCH_CI=1: {reason}\n"
                           "(tests/conftest.py: BROKEN_ENVIRONMENT; run without BITMATCH_CI to see it as a skip)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_if_broken(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    # a module-level skip (pytest.skip(allow_module_level=True), importorskip at the top) drops the
    # whole file from the collection; under CI a broken-environment one becomes a collection error
    outcome = yield
    _fail_if_broken(outcome.get_result())


def pytest_runtest_setup(item):
    if item.get_closest_marker("interpreter") and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip(f"needs TRITON_INTERPRET=1 (set to {os.environ.get('TRITON_INTERPRET')!r} in this environment)")


@pytest.hookimpl(trylast=True)  # after --durations, before pytest's short summary
def pytest_terminal_summary(terminalreporter):
    """One line per outcome and one per skip reason: a run that skipped what it should have run
    reads differently from a run that passed it."""
    if terminalreporter.config.option.collectonly:
        return
    stats = terminalreporter.stats
    counts = {k: len(stats.get(k, [])) for k in ("passed", "failed", "error", "skipped", "xfailed", "xpassed")}
    by_reason = {}
    for r in stats.get("skipped", []):
        reason = skip_reason(r.longrepr)
        by_reason[reason] = by_reason.get(reason, 0) + 1
    terminalreporter.section("bitmatch: outcomes, skips by reason")
    terminalreporter.line("  ".join(f"{k} {n}" for k, n in counts.items() if n or k in ("passed", "skipped")))
    for reason, n in sorted(by_reason.items(), key=lambda kv: -kv[1]):
        terminalreporter.line(f"skipped {n:4d}: {reason}")


@pytest.fixture(autouse=True)
def _seeded():
    # every test draws the same random inputs whichever xdist worker runs it, so a control
    # that finds a mismatch finds it on every run
    torch.manual_seed(1234)
    yield
