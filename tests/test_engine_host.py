"""bitmatch.engine.host.upload: the step inputs reach the device intact, on CPU (a copy) and, on a
GPU machine, through the kept pinned buffers (reused only after their previous copy finished)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from bitmatch.engine.host import upload


def test_upload_cpu_is_a_copy():
    a = np.arange(10, dtype=np.int64)
    t = upload(a, torch.device("cpu"))
    a[:] = -1   # the caller reuses its array: the upload must not see it
    assert t.tolist() == list(range(10)) and t.dtype == torch.int64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned-buffer path needs a CUDA device")
def test_upload_cuda_back_to_back_reuse_keeps_every_value():
    dev = torch.device("cuda")
    rng = np.random.default_rng(0)
    arrs = [rng.integers(-2**40, 2**40, size=int(n), dtype=np.int64) for n in rng.integers(1, 5000, 200)]
    outs = []
    for i, a in enumerate(arrs):   # no sync in between: a buffer is rewritten while copies are queued
        outs.append(upload(a, dev, slot=i % 2))
        torch.cuda._sleep(1000)    # keep the stream busy so copies are still in flight
    f = rng.standard_normal((2, 300)).astype(np.float32)
    g = upload(f, dev)
    assert g.shape == (2, 300) and torch.equal(g.cpu(), torch.from_numpy(f))
    for a, o in zip(arrs, outs):
        assert torch.equal(o.cpu(), torch.from_numpy(a))
