"""The one check of a weight-version number: ``publish``, every transport, the receiver and the
trainer's ``check_weight_version`` use it, so a version is the same int on every path."""
from __future__ import annotations

import numbers

import numpy as np

# versions travel as JSON ints and are stamped on outputs next to int64 metrics: a bound that every
# end can hold exactly (a version of 2**70 would also lock out every later, ordinary one)
MAX_VERSION = 2 ** 63 - 1


def check_version(version, where: str, name: str = "version") -> int:
    """``version`` as an int: an integer (not a bool, a float or a string) in [0, 2**63);
    ValueError naming ``where``, the argument and the fix otherwise."""
    if isinstance(version, (bool, np.bool_)) or not isinstance(version, numbers.Integral) \
            or not 0 <= version <= MAX_VERSION:
        raise ValueError(f"{where}: {name} must be an int in [0, 2**63) (the trainer's step number, which must "
                         f"increase), got {version!r} ({type(version).__name__}); pass int(step)")
    return int(version)
