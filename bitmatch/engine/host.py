"""Host-to-device helpers the engine's parts share (the runner, the graph runner, the sampler).

Its own module so ``model_runner``, ``graphs`` and ``sampling`` import it at their top without
importing each other.
"""
from __future__ import annotations

import numpy as np
import torch

# (device, dtype, slot) -> [pinned host buffer, CUDA event of its last copy or None]. Pinning a
# fresh tensor every step (``Tensor.pin_memory``) was the largest own host time of a graphed decode
# step in the V4 decode profile (benchmarks/deepseek_v4_layer.py --profile); a kept buffer costs a
# memcpy. The event makes reuse safe: a buffer is overwritten only after its previous copy to the
# device has finished.
_STAGING: dict = {}


def upload(arr: np.ndarray, device, slot: int = 0) -> torch.Tensor:
    """One host array on ``device``: on CUDA through a kept pinned buffer per (device, dtype,
    ``slot``), non-blocking (uploads of one step in flight together take different slots); a
    copy on CPU."""
    t = torch.from_numpy(np.ascontiguousarray(arr))
    if device.type != "cuda":
        return t.clone()
    key = (device, t.dtype, slot)
    entry = _STAGING.get(key)
    n = t.numel()
    if entry is None or entry[0].numel() < n:
        entry = _STAGING[key] = [torch.empty(max(n, 1024, 2 * (entry[0].numel() if entry else 0)), dtype=t.dtype,
                                             pin_memory=True), None]
    buf, done = entry
    if done is not None:
        done.synchronize()   # the previous copy out of this buffer has finished (normally long ago)
    staged = buf[:n]
    staged.copy_(t.reshape(-1))
    out = staged.view(t.shape).to(device, non_blocking=True)
    entry[1] = torch.cuda.Event()
    entry[1].record(torch.cuda.current_stream(device))
    return out
