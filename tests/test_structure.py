"""The layers' shape, held by the sources (``ast``): one model path at every tensor-parallel degree.

- ``bitmatch/parallel/`` keeps mechanisms only (collectives, the gathered linear, the ``Sharder``,
  expert dispatch, FSDP, DDP): no module of it tests a registered family's name or imports a
  family's module; each family declares its layout next to its forward (``Family.shard``).
  ``UNMOVED`` lists the layouts still built in ``parallel/``; it fails on an entry that no longer
  occurs, so it only shrinks.
- the engine imports nothing from ``bitmatch.parallel``: it reads what the parallel layer sets on the
  model (``registry.tp_shard`` / ``tp_step``); ``ENGINE_PARALLEL_IMPORTS`` would say why otherwise.
- ``bitmatch/``'s top level holds only the modules ``TOP_LEVEL`` names: a new module goes into the
  package that says what it is for (``diagnostics/``, ``testing/``, ``engine/``, ...), so loose modules
  do not grow back (issue 49); the core imports neither the diagnostics nor the test helpers above it.

The import graph itself (cycles, local imports, adapters) is tests/test_imports.py's.
"""
from __future__ import annotations

import ast
import pathlib

from bitmatch.models.registry import FAMILY_MODULES, Family, families
from test_imports import CORE, EDGES, LOCAL, upward_imports

REPO = pathlib.Path(__file__).resolve().parents[1]
PARALLEL = REPO / "bitmatch" / "parallel"

# family name -> the parallel/ files that still name it: a layout to move next to its family's forward
UNMOVED: dict[str, set[str]] = {}

# (engine module, parallel module): why the engine imports the parallel layer directly
ENGINE_PARALLEL_IMPORTS: dict = {}

# the modules bitmatch/ may hold outside a package; grow it only for a module no package fits
TOP_LEVEL = {"__init__", "context", "demo", "logprobs", "patching", "precision", "switch", "wrappers"}


def family_words() -> set[str]:
    """Every registered family's name and its module's name (``dense``, ``qwen3_moe``, ...)."""
    return {f.name for f in families()} | {m.rsplit(".", 1)[1] for m in FAMILY_MODULES}


def family_mentions(source: str, words: set[str]) -> set[str]:
    """The family words a module's code uses: a string constant equal to one (``fam.name == "dense"``,
    a table key) or an import of a family module (``from bitmatch.models import dense``)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in words:
            found.add(node.value)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bitmatch.models"):
            mod = node.module.rsplit(".", 1)[1]
            found |= {mod} & words | {a.name for a in node.names} & words
        elif isinstance(node, ast.Import):
            found |= {a.name.rsplit(".", 1)[1] for a in node.names if a.name.startswith("bitmatch.models.")} & words
    return found


def test_parallel_names_no_family():
    words = family_words()
    bad, seen = [], set()
    for path in sorted(PARALLEL.glob("*.py")):
        for word in sorted(family_mentions(path.read_text(), words)):
            seen.add((word, path.name))
            if path.name not in UNMOVED.get(word, ()):
                bad.append(f"bitmatch/parallel/{path.name} names the family {word!r}")
    assert not bad, ("parallel/ holds mechanisms only: declare the layout in the family's Family.shard (on the "
                     "Sharder), not by its name here:\n  " + "\n  ".join(bad))
    stale = sorted(f"{w}: {f}" for w, files in UNMOVED.items() for f in files if (w, f) not in seen)
    assert not stale, "UNMOVED entries that no longer occur (remove them):\n  " + "\n  ".join(stale)


def test_family_scan_sees_what_it_polices():
    """Control: a name test, a table key and both import forms are found; prose is not."""
    words = {"dense", "qwen3_moe", "nemotron_h"}
    src = ('"""the dense family"""\nimport bitmatch.models.nemotron_h\nfrom bitmatch.models import dense\n'
           'def f(fam):\n    return fam.name == "qwen3_moe"\n')
    assert family_mentions(src, words) == words
    assert family_mentions('"""dense and qwen3_moe layouts"""\nx = "a dense model"\n', words) == set()


def test_every_tensor_parallel_family_declares_its_layout():
    """A family with a layout built outside ``parallel/`` declares it as ``Family.shard``."""
    for fam in families():
        if fam.name not in UNMOVED:
            assert type(fam).shard is not Family.shard, f"{fam.name}: no Family.shard"


def test_engine_reaches_parallel_only_where_listed():
    found = upward_imports(EDGES, LOCAL, ("bitmatch.engine",), ("bitmatch.parallel",))
    # a module's import names it, not the packages above it that importing it runs
    found = [(m, t) for m, t in found if not any(m == m2 and t2.startswith(t + ".") for m2, t2 in found)]
    unlisted = [f"{m} imports {t}" for m, t in found if (m, t) not in ENGINE_PARALLEL_IMPORTS]
    assert not unlisted, ("the engine imports bitmatch.parallel (reach it through what the parallel layer sets on "
                          "the model, e.g. its shard):\n  " + "\n  ".join(unlisted))
    stale = sorted(f"{m} -> {t}" for m, t in ENGINE_PARALLEL_IMPORTS if (m, t) not in found)
    assert not stale, "ENGINE_PARALLEL_IMPORTS entries that no longer occur (remove them):\n  " + "\n  ".join(stale)


def test_top_level_holds_only_listed_modules():
    found = {p.stem for p in (REPO / "bitmatch").glob("*.py")}
    loose = sorted(found - TOP_LEVEL)
    assert not loose, ("modules at bitmatch/'s top level outside TOP_LEVEL: put each in the package that says what "
                       "it is for (bitmatch/diagnostics/, bitmatch/testing/, ...):\n  " + "\n  ".join(loose))
    stale = sorted(TOP_LEVEL - found)
    assert not stale, "TOP_LEVEL entries with no module (remove them):\n  " + "\n  ".join(stale)


def test_core_imports_no_diagnostics():
    """The diagnostics and the test helpers observe the core from above: the core never imports them."""
    found = upward_imports(EDGES, LOCAL, CORE, ("bitmatch.diagnostics", "bitmatch.testing", "bitmatch.cli"))
    assert not found, ("the core imports a diagnostic or a test helper (move the piece it needs into the core):\n  "
                       + "\n  ".join(f"{m} imports {t}" for m, t in found))
