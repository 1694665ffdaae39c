"""The package's import graph: no cycles, own-package imports at the top, public names across modules.

Built from the sources with ``ast`` (STYLE.md: "Imports at the top, no cycles"; "A leading underscore
means 'this file only'"):

- every module imports first, in a fresh interpreter, whatever the order (``test_imports_first``);
- the graph of module-level imports has no cycle (``test_module_level_graph_is_acyclic``);
- a function-local import of bitmatch's own modules is allowed only where ``LOCAL_IMPORTS`` names
  it with a reason (a cycle broken on purpose, an optional extra loaded lazily, a file owned by
  another change); hoisting one that would close a cycle is refused by the graph test;
- a ``_name`` of one module used by another is allowed only where ``PRIVATE_USES`` names it;
- layers point one way: no module of the core (``CORE``) imports ``bitmatch.adapters``, at its top
  or inside a function, unless ``ADAPTER_IMPORTS`` names it; ``import bitmatch.logprobs`` does not
  load ``torch.distributed.fsdp`` (the parallel layer's handlers reach it through ``bitmatch.wrappers``).

Each allow-list fails on an entry that no longer occurs, so it shrinks as imports move up.
"""
from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from import_allowlist import ADAPTER_IMPORTS, LOCAL_IMPORTS, PRIVATE_USES

REPO = pathlib.Path(__file__).resolve().parents[1]
# source folder -> installed package: one tree, bitmatch/ (kernels and adapters inside it)
ROOTS = {"bitmatch": "bitmatch"}
# the layers below the adapters: none of their modules may import bitmatch.adapters
CORE = ("bitmatch.sync", "bitmatch.engine", "bitmatch.models", "bitmatch.kernels")
# a module whose import fails on one of these missing is an optional extra's, skipped by name
OPTIONAL = {"verl": "verl", "vllm": "vllm", "trl": "trl", "peft": "trl", "triton": "triton"}


def _modules() -> dict[str, tuple[pathlib.Path, bool]]:
    out = {}
    for folder, top in ROOTS.items():
        for p in sorted((REPO / folder).rglob("*.py")):
            rest = list(p.relative_to(REPO / folder).with_suffix("").parts)
            is_pkg = rest[-1:] == ["__init__"]
            out[".".join([top] + (rest[:-1] if is_pkg else rest))] = (p, is_pkg)
    return out


MODULES = _modules()


def _own(name: str | None) -> bool:
    return bool(name) and (name == "bitmatch" or name.startswith("bitmatch."))


def _known(name: str) -> str:
    """The longest prefix of a dotted name that is one of our modules (``bitmatch.x.f`` -> ``bitmatch.x``)."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _base(mod: str, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` reads from (relative levels resolved)."""
    if not node.level:
        return node.module or ""
    pkg = mod if MODULES[mod][1] else mod.rsplit(".", 1)[0]
    for _ in range(node.level - 1):
        pkg = pkg.rsplit(".", 1)[0]
    return f"{pkg}.{node.module}" if node.module else pkg


def _targets(mod: str, node) -> list[tuple[str, str]]:
    """(imported own module, name bound in this file) per alias of an import node."""
    out = []
    if isinstance(node, ast.Import):
        for a in node.names:
            if _own(a.name):
                out.append((_known(a.name), a.asname or a.name.split(".")[0]))
    else:
        base = _base(mod, node)
        if _own(base):
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((sub if sub in MODULES else _known(base), a.asname or a.name))
    return out


def _with_parents(mod: str, target: str) -> set[str]:
    """``target`` and the packages above it that importing it runs first: ``a.b.c`` runs ``a.b``'s
    ``__init__``, unless ``mod`` lives inside ``a.b`` (its own import already started that one)."""
    out, name = {target}, target
    while "." in name:
        name = name.rsplit(".", 1)[0]
        if not (mod == name or mod.startswith(name + ".")):
            out.add(name)
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _walk(tree):
    """(import node, enclosing function name or None) for every import; TYPE_CHECKING blocks skipped."""
    def visit(node, fn):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, fn
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else fn
            inner = "<lambda>" if isinstance(child, ast.Lambda) and fn is None else inner
            yield from visit(child, inner)
    yield from visit(tree, None)


def scan():
    """(module-level edges {mod: {target}}, function-local imports {(mod, target): [functions]},
    private uses {(mod, "target._name")})."""
    edges, local, private = {m: set() for m in MODULES}, {}, set()
    for mod, (path, _) in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        bound = {}                      # name in this file -> the own module it names
        for node, fn in _walk(tree):
            for target, name in _targets(mod, node):
                if target == mod:
                    continue
                if fn is None:
                    edges[mod] |= _with_parents(mod, target)
                else:
                    local.setdefault((mod, target), []).append(fn)
                if isinstance(node, ast.ImportFrom) and f"{_base(mod, node)}.{name}" not in MODULES:
                    real = next(a.name for a in node.names if (a.asname or a.name) == name)
                    if real.startswith("_") and not real.startswith("__"):
                        private.add((mod, f"{target}.{real}"))
                elif target in MODULES:
                    bound[name] = target
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                dotted = _dotted(node.value)
                if dotted:
                    head, _, tail = dotted.partition(".")
                    full = _known(".".join(filter(None, [bound.get(head, head), tail])))
                    if full in MODULES and full != mod and f"{full}.{node.attr}" not in MODULES:
                        private.add((mod, f"{full}.{node.attr}"))
    return edges, local, private


def _dotted(node) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id] + parts[::-1])


def _cycle(edges) -> list[str] | None:
    """One cycle of the graph as a path (first == last), or None."""
    state, stack = {}, []

    def dfs(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state and (c := dfs(t)):
                return c
        stack.pop()
        state[m] = 2
        return None
    for m in sorted(edges):
        if m not in state and (c := dfs(m)):
            return c
    return None


EDGES, LOCAL, PRIVATE = scan()


def test_module_level_graph_is_acyclic():
    cycle = _cycle(EDGES)
    assert cycle is None, ("module-level import cycle: " + " -> ".join(cycle) + "\nmove the shared piece into "
                           "a module both import (an engine helper, kernels/triton/_jit.py), never a local import")


def test_function_local_own_imports_are_allow_listed():
    unlisted = sorted(f"{m} imports {t} inside {', '.join(sorted(set(f)))}()"
                      for (m, t), f in LOCAL.items() if (m, t) not in LOCAL_IMPORTS)
    assert not unlisted, ("function-local imports of bitmatch's own modules (move them to the module top; "
                          "if that closes a cycle, move the shared piece instead; a real exception goes in "
                          "tests/import_allowlist.py LOCAL_IMPORTS with its reason):\n  " + "\n  ".join(unlisted))
    # a module absent from this checkout (another change's new file) is not stale
    stale = sorted(f"{m} -> {t}" for (m, t) in LOCAL_IMPORTS if (m, t) not in LOCAL and m in MODULES)
    assert not stale, "LOCAL_IMPORTS entries that no longer occur (remove them):\n  " + "\n  ".join(stale)


def test_allow_listed_local_imports_say_why():
    for key, why in {**LOCAL_IMPORTS, **PRIVATE_USES}.items():
        assert isinstance(why, str) and len(why) > 15, f"{key}: give the reason in a sentence, got {why!r}"


def test_private_names_stay_in_their_module():
    unlisted = sorted(f"{m} uses {name}" for m, name in PRIVATE if (m, name) not in PRIVATE_USES)
    assert not unlisted, ("a module uses another's _private name (make it public in its module, or add it to "
                          "tests/import_allowlist.py PRIVATE_USES with the reason):\n  " + "\n  ".join(unlisted))
    stale = sorted(f"{m} -> {n}" for (m, n) in PRIVATE_USES if (m, n) not in PRIVATE and m in MODULES)
    assert not stale, "PRIVATE_USES entries that no longer occur (remove them):\n  " + "\n  ".join(stale)


def test_scanner_sees_the_cases_it_polices(tmp_path):
    """Control: the scanner finds a cycle, a local import and a private use where they are."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    tree = ast.parse(textwrap.dedent("""
        import bitmatch.kernels as K
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from bitmatch.engine import Engine
        def f():
            from bitmatch.diagnostics.verify import paged_trace
            return K._exact
    """))
    found = [(fn, t) for node, fn in _walk(tree) for t, _ in _targets("bitmatch.cli", node)]
    assert found == [(None, "bitmatch.kernels"), ("f", "bitmatch.diagnostics.verify")]


def _in(mod: str, packages) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in packages)


def upward_imports(edges, local, lower, upper) -> list[tuple[str, str]]:
    """(module of ``lower``, module of ``upper`` it imports), at its top or inside a function."""
    pairs = {(m, t) for m, ts in edges.items() for t in ts} | set(local)
    return sorted((m, t) for m, t in pairs if _in(m, lower) and _in(t, upper))


def test_core_does_not_import_adapters():
    found = upward_imports(EDGES, LOCAL, CORE, ("bitmatch.adapters",))
    unlisted = [f"{m} imports {t}" for m, t in found if (m, t) not in ADAPTER_IMPORTS]
    assert not unlisted, ("the core imports an adapter (layers point one way: move the piece into the core, or "
                          "have the adapter register it; a real exception goes in tests/import_allowlist.py "
                          "ADAPTER_IMPORTS with its reason):\n  " + "\n  ".join(unlisted))
    stale = sorted(f"{m} -> {t}" for (m, t) in ADAPTER_IMPORTS if (m, t) not in found and m in MODULES)
    assert not stale, "ADAPTER_IMPORTS entries that no longer occur (remove them):\n  " + "\n  ".join(stale)
    # control: the check sees an upward import at a module's top, one inside a function, and no other
    assert upward_imports({"bitmatch.sync.x": {"bitmatch.adapters", "bitmatch.adapters.vllm", "bitmatch.kernels"},
                           "bitmatch.adapters.vllm": {"bitmatch.sync"}},
                          {("bitmatch.models.y", "bitmatch.adapters.trl"): ["f"]}, CORE, ("bitmatch.adapters",)) == [
        ("bitmatch.models.y", "bitmatch.adapters.trl"), ("bitmatch.sync.x", "bitmatch.adapters"),
        ("bitmatch.sync.x", "bitmatch.adapters.vllm")]


_FSDP_PROBE = r"""
import json, sys
loaded = lambda: {"fsdp": "torch.distributed.fsdp" in sys.modules,
                  "parallel": sorted(m for m in sys.modules if m.startswith("bitmatch.parallel"))}
out = {}
import bitmatch
out["bitmatch"] = loaded()
import bitmatch.logprobs
out["logprobs"] = loaded()
import torch
from bitmatch.wrappers import runner_for
out["runner"] = runner_for(torch.nn.Linear(2, 2)) is None
out["first_call"] = loaded()
import torch.distributed.fsdp
out["runner_fsdp"] = runner_for(torch.nn.Linear(2, 2)) is None
out["after_fsdp"] = loaded()
print("RESULT " + json.dumps(out))
"""


def test_logprobs_does_not_import_fsdp():
    """``import bitmatch`` / ``bitmatch.logprobs`` in a fresh interpreter leave ``torch.distributed.fsdp``
    (~0.7 s) unloaded; the FSDP2 handler loads once torch.distributed.fsdp is imported (the control:
    no FSDP model can exist before, and none is missed after)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-c", _FSDP_PROBE], capture_output=True, text=True, env=env, timeout=300,
                       cwd=REPO)
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert p.returncode == 0 and line, f"the probe failed (rc {p.returncode}):\n{p.stderr[-4000:]}"
    r = json.loads(line[-1][len("RESULT "):])
    assert r["bitmatch"] == {"fsdp": False, "parallel": []}, r
    assert r["logprobs"] == {"fsdp": False, "parallel": []}, ("importing bitmatch.logprobs loads "
                                                              f"torch.distributed.fsdp or bitmatch.parallel: {r}")
    assert r["runner"] and r["first_call"]["fsdp"] is False, r  # a plain model: DDP's handler only
    assert r["runner_fsdp"] and r["after_fsdp"]["fsdp"] and "bitmatch.parallel.fsdp" in r["after_fsdp"]["parallel"], r


# the module paths published before 0.2 -> where they live now (issue 49); bitmatch/__init__.py aliases them
MOVED = {**{f"bitmatch.{m}": f"bitmatch.diagnostics.{m}"
            for m in ("verify", "tracing", "replay", "stepcheck", "family_check", "controls", "faults")},
         "bitmatch.testing_models": "bitmatch.testing.models", "bitmatch.testing_trl": "bitmatch.testing.trl",
         "bitmatch.hub": "bitmatch.models.hub"}

_MOVED_PROBE = r"""
import importlib, json, sys
import bitmatch
out = {}
for old, new in json.loads(sys.argv[1]).items():
    first = importlib.import_module(old)          # the old path first, as a script written for 0.1 does
    out[old] = [first is importlib.import_module(new), first.__name__, first.__spec__.name, sys.modules[old] is first]
from bitmatch.verify import compare
out["from"] = compare.__module__
out["attr"] = bitmatch.verify is sys.modules["bitmatch.diagnostics.verify"]
try:
    importlib.import_module("bitmatch.no_such_module")
except ModuleNotFoundError:
    out["unknown"] = "ModuleNotFoundError"
print("RESULT " + json.dumps(out))
"""


def test_moved_paths_import_the_same_modules():
    """The paths published before 0.2 (``bitmatch.verify``, ``bitmatch.testing_models``, ...), imported first
    in a fresh interpreter, are the moved modules themselves (same object, name and spec), and no file of
    theirs is back at the top level; an unknown name still fails (the control)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-c", _MOVED_PROBE, json.dumps(MOVED)], capture_output=True, text=True,
                       env=env, timeout=300, cwd=REPO)
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert p.returncode == 0 and line, f"the probe failed (rc {p.returncode}):\n{p.stderr[-4000:]}"
    r = json.loads(line[-1][len("RESULT "):])
    for old, new in MOVED.items():
        assert old not in MODULES and new in MODULES, f"{old} is a file again, or {new} is gone"
        assert r[old] == [True, new, new, True], f"{old}: [same object, __name__, __spec__.name, sys.modules] {r[old]}"
    assert r["from"] == "bitmatch.diagnostics.verify" and r["attr"] and r["unknown"] == "ModuleNotFoundError", r


# ----------------------------------------------------------------------------- each module first

# Imports every third-party module the package pulls in, then forks one child per module: each child
# imports its module first, with no other bitmatch module loaded (what a fresh interpreter sees,
# minus the seconds of torch/transformers each fresh start would cost).
_FORKER = r"""
import importlib, json, os, sys, traceback
mods, pre = json.load(open(sys.argv[1]))
for m in pre:
    try:
        importlib.import_module(m)
    except BaseException:
        pass
assert not [k for k in sys.modules if k == "bitmatch" or k.startswith("bitmatch.")]
out = {}
for m in mods:
    r, w = os.pipe()
    if os.fork() == 0:
        os.close(r)
        try:
            importlib.import_module(m)
            res = {"ok": True}
        except BaseException as e:
            res = {"ok": False, "missing": getattr(e, "name", None) if isinstance(e, ImportError) else None,
                   "error": traceback.format_exc()[-3000:]}
        os.write(w, json.dumps(res).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 1 << 16):
        data += chunk
    os.wait()
    out[m] = json.loads(data) if data else {"ok": False, "missing": None, "error": "the child died"}
print("RESULT " + json.dumps(out))
"""
_THIRD_PARTY = r"""
import importlib, json, sys
for m in json.load(open(sys.argv[1]))[0]:
    try:
        importlib.import_module(m)
    except BaseException:
        pass
# vLLM, Ray and verl start threads as they import; a fork with their locks held could hang a child
skip = ("bitmatch", "__main__", "vllm", "ray", "verl")
print("RESULT " + json.dumps(sorted(k for k in sys.modules if k.split(".")[0] not in skip)))
"""


def _run(code: str, arg: pathlib.Path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-c", code, str(arg)], capture_output=True, text=True, env=env,
                       timeout=300, cwd=REPO)
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert p.returncode == 0 and line, f"the import runner failed (rc {p.returncode}):\n{p.stderr[-4000:]}"
    return json.loads(line[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def first_imports(tmp_path_factory):
    if not hasattr(os, "fork"):
        pytest.skip("needs os.fork (POSIX) to import each module first cheaply")
    arg = tmp_path_factory.mktemp("imports") / "args.json"
    mods = sorted(MODULES)
    arg.write_text(json.dumps([mods, []]))
    third_party = _run(_THIRD_PARTY, arg)
    arg.write_text(json.dumps([mods, third_party]))
    return _run(_FORKER, arg)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_first(module, first_imports):
    r = first_imports[module]
    if not r["ok"] and (r["missing"] or "").split(".")[0] in OPTIONAL:
        extra = OPTIONAL[r["missing"].split(".")[0]]
        pytest.skip(f"{module} needs the optional package {r['missing']!r} (pip install bitmatch[{extra}])")
    assert r["ok"], f"importing {module} first, in a fresh interpreter, fails:\n{r['error']}"
