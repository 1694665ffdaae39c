"""What a new user hit (issue 51): imports from the folder above the clone, exit codes, dtype changes
that were silent, messages without a fix, README commands that were not the tested ones. One test per
defect; each asserts what the user reads."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
