"""``python -m bitmatch.cli COMMAND ...``: the ``bitmatch`` console script without its launcher."""
import sys

from bitmatch.cli import main

if __name__ == "__main__":
    sys.exit(main())
