"""Moved to ``bitmatch.models.lora`` (LoRA is forward-path code); this name stays for imports."""
from bitmatch.models.lora import *  # noqa: F401,F403
from bitmatch.models.lora import __all__  # noqa: F401
