"""The ``BITMATCH`` environment switch: one rule for every adapter (vLLM plugin, verl actor and
check), so no value turns one adapter on and another off."""
from __future__ import annotations

import os

ENV_VAR = "BITMATCH"
_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")


def enabled() -> bool:
    """True for BITMATCH=1/true/yes/on, False when unset or 0/false/no/off (any case, spaces
    ignored); any other value is a ValueError naming the accepted ones."""
    raw = os.environ.get(ENV_VAR, "")
    v = raw.strip().lower()
    if v in _ON:
        return True
    if v in _OFF:
        return False
    raise ValueError(f"{ENV_VAR}={raw!r} is neither on nor off: set {ENV_VAR}=1 (or true/yes/on) to enable bitmatch, "
                     f"{ENV_VAR}=0 (or false/no/off), or unset it, to disable")
