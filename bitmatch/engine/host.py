"""Host-to-device helpers the engine's parts share (the runner, the graph runner, the sampler).

Its own module so ``model_runner``, ``graphs`` and ``sampling`` import it at their top without
importing each other.
"""
from __future__ import annotations

import numpy as np
import torch


def upload(arr: np.ndarray, device) -> torch.Tensor:
    """One host array on ``device``: pinned and non-blocking on CUDA (the caching host allocator
    keeps the pinned block until the copy is done), a copy on CPU."""
    t = torch.from_numpy(arr)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.clone()
