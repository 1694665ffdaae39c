"""What every ``bitmatch`` command shares: exit codes, one-line usage errors, path checks, versions.

Light (no torch): the dispatcher (``bitmatch.cli``) imports it to answer ``--help`` and ``--version``,
and each command module imports it at its top.
"""
from __future__ import annotations

import os
import sys
import tempfile
from importlib import metadata

import bitmatch

EXIT_OK, EXIT_DIVERGED, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3


def usage_error(prog: str, problem: str) -> int:
    """Print ONE line naming the problem and its fix (no traceback: a user error) and return 2."""
    print(f"{prog}: {problem}", file=sys.stderr)
    return EXIT_USAGE


def seed_problem(seed: int) -> str | None:
    """``--seed`` outside [0, 2**32), in one line: the commands derive the weights' and each
    request's sampling seed from it, and those must stay in [0, 2**64)."""
    if not 0 <= seed < 2 ** 32:
        return f"--seed must be an int in [0, 2**32), got {seed}"
    return None


def one_line(e: BaseException) -> str:
    """An exception's message on one line (transformers' load errors span paragraphs)."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 400 else text[:397] + "..."


def load_error(what: str, e: BaseException) -> str:
    """The sentence for an exception raised while loading ``what``: bitmatch's own messages
    (``bitmatch.models.hub``: missing folder, bad config.json, no or truncated weights, hub name not
    cached) already name the fix; anything else from transformers is named as such."""
    if isinstance(e, (FileNotFoundError, ConnectionError, ValueError)) and str(e).startswith(
            ("load_model:", "Engine:", "check_supported", "bitmatch")):
        return one_line(e)
    return (f"could not load {what!r} ({type(e).__name__}: {one_line(e)}); check that it is an HF causal LM "
            "checkpoint of a supported family (bitmatch.models.check_supported) and that transformers can read it")


def can_write_in(folder: str) -> bool:
    """A file can be created in ``folder`` (tried, not guessed: permission bits say yes to root on a
    read-only file system)."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def writable_file_problem(flag: str, path: str) -> str | None:
    """None if ``path`` can be written (its folder exists and is writable), else the sentence
    naming ``flag`` and the fix: checked before a run, so the run's result is never lost."""
    path = os.path.abspath(os.path.expanduser(path))
    folder = os.path.dirname(path)
    if os.path.isdir(path):
        return f"{flag} {path!r} is a folder; give a file path (e.g. {os.path.join(path, 'report.json')!r})"
    if not os.path.isdir(folder):
        return f"{flag}: the folder {folder!r} does not exist; create it first (mkdir -p) or give another path"
    if not can_write_in(folder) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return f"{flag}: {path!r} is not writable; give a path in a folder you can write to"
    return None


def writable_folder_problem(flag: str, path: str, files=()) -> str | None:
    """None if the folder ``path`` exists and is writable or can be created (its nearest existing
    ancestor is a writable folder), and each of ``files`` in it can be written; else the sentence
    naming ``flag`` and the fix. Creates nothing."""
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{flag} {path!r} is a file, not a folder; give a folder path"
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        return f"{flag}: {probe!r} is a file, so the folder {path!r} cannot be created; give another path"
    if not can_write_in(probe):
        return f"{flag}: {probe!r} is not writable, so nothing can be written under {path!r}; give a folder you own"
    for name in files:
        f = os.path.join(path, name)
        if os.path.exists(f) and (os.path.isdir(f) or not os.access(f, os.W_OK)):
            return f"{flag}: {f!r} exists and cannot be overwritten; remove it or give another folder"
    return None


def version_string() -> str:
    """'bitmatch X (torch Y, transformers Z)' from the installed distributions (no heavy import)."""
    def v(dist):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"
    return f"bitmatch {bitmatch.__version__} (torch {v('torch')}, transformers {v('transformers')})"
