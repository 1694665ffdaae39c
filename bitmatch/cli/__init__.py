"""The ``bitmatch`` command: one module per command (``check``, ``locate``, ``replay``, ``demo``),
each with its ``main(argv)``, and this dispatcher, the console script's entry.

Usage, ``--version`` and unknown commands are answered here, before anything imports torch
(``bitmatch --help`` in a fraction of a second); a command's module, which imports torch and the
models at its top, is loaded by name from ``COMMANDS`` only when that command runs (as
``bitmatch/__init__.py`` loads its exports). The command modules import ``bitmatch.cli.common``,
never this module or each other.
"""
from __future__ import annotations

import importlib
import sys
import traceback

from bitmatch.cli.common import EXIT_INTERNAL, EXIT_OK, EXIT_USAGE, version_string

# command -> the module whose main(argv) runs it
COMMANDS = {
    "check": "bitmatch.cli.check",
    "locate": "bitmatch.cli.locate",
    "replay": "bitmatch.cli.replay",
    "demo": "bitmatch.cli.demo",
}

USAGE = """usage: bitmatch {check,locate,replay,demo} [options]   (bitmatch COMMAND --help for its options)

  check      run the invariance self-test of every op and print a table
             (--family NAME: every op that family uses, at its shapes, with controls)
  locate     run the same tokens through two paths (--pair engine|hf|schedule|backend) and
             name the first op whose output bits differ (docs/porting.md)
  replay     rescore a repro bundle (TRL / verl step check) and compare bit for bit
  demo       rollouts with the embedded engine vs trainer logprobs: Diff = 0 with
             bitmatch, the nonzero diff without (tiny model built in code)
  --version  print the versions of bitmatch, torch and transformers

exit codes: 0 ok; 1 a divergence / mismatch found; 2 a usage or load error (one line naming
the problem and the fix); 3 an internal error (a bug: the traceback, please report it)"""


def front(argv: list) -> int | None:
    """The exit code when ``argv`` needs no command run (no arguments, help, version, an unknown
    command), else None."""
    if not argv:  # a bare `bitmatch` did nothing useful: say how to use it, exit as argparse does
        print(USAGE, file=sys.stderr)
        return EXIT_USAGE
    if argv[0] in ("-h", "--help"):
        print(USAGE)
        return EXIT_OK
    if argv[0] in ("-V", "--version"):
        print(version_string())
        return EXIT_OK
    if argv[0] not in COMMANDS:
        *first, last = COMMANDS
        print(f"bitmatch: unknown command {argv[0]!r} (use {', '.join(first)} or {last})\n\n{USAGE}",
              file=sys.stderr)
        return EXIT_USAGE
    return None


def main(argv=None) -> int:
    """The console script: help, version and unknown commands without importing torch; a command
    through its module's ``main``. An exception a command lets out is a bug: exit 3 with the traceback,
    never the code of a divergence found."""
    argv = list(sys.argv[1:] if argv is None else argv)
    early = front(argv)
    if early is not None:
        return early
    cmd, rest = argv[0], argv[1:]
    command = importlib.import_module(COMMANDS[cmd])
    try:
        return command.main(rest) or EXIT_OK
    except Exception:  # a bug, not a user error: the traceback, and a code that is not "divergence found"
        traceback.print_exc()
        print(f"bitmatch {cmd}: internal error (exit {EXIT_INTERNAL}); please report it with the traceback above",
              file=sys.stderr)
        return EXIT_INTERNAL
