"""publish with a per-tensor dtype (a {name: dtype} map): each tensor is cast by compute_cast into
its own dtype, every fingerprint is still checked, and a map that disagrees with the receiver's
target (a dtype, a missing name) is refused before any byte is written."""
from __future__ import annotations

import pytest
import torch

import bitmatch.sync as sync
from bitmatch.precision import compute_cast

BF16, F32 = torch.bfloat16, torch.float32


def setup():
    g = torch.Generator().manual_seed(0)
    master = {"layers.0.mlp.gate.weight": torch.randn(8, 16, generator=g),
              "layers.0.mlp.up.weight": torch.randn(32, 16, generator=g)}
    dtypes = {"layers.0.mlp.gate.weight": F32, "layers.0.mlp.up.weight": BF16}
    live = {k: torch.zeros(v.shape, dtype=dtypes[k]) for k, v in master.items()}
    return master, dtypes, live, sync.receive(live)


def test_each_tensor_in_its_own_dtype():
    master, dtypes, live, rx = setup()
    m = sync.publish(master, 1, to=rx, dtype=dtypes)
    assert {k: s.dtype for k, s in m.tensors.items()} == dtypes
    for k, v in master.items():
        assert torch.equal(live[k], compute_cast(v, dtypes[k]))
        assert m.tensors[k].fingerprint == sync.fingerprint(compute_cast(v, dtypes[k]))
    assert torch.equal(live["layers.0.mlp.gate.weight"], master["layers.0.mlp.gate.weight"])  # fp32: unrounded
    sync.verify(live, m)
    master["layers.0.mlp.up.weight"] += 0.25
    sync.publish(master, 2, to=rx, dtype=dtypes)
    assert torch.equal(live["layers.0.mlp.up.weight"], compute_cast(master["layers.0.mlp.up.weight"], BF16))
    assert rx.require_ready(2) == 2


def test_map_disagreeing_with_the_target_is_refused():
    master, dtypes, live, rx = setup()
    sync.publish(master, 1, to=rx, dtype=dtypes)
    with pytest.raises(ValueError, match=r"tensor 'layers.0.mlp.gate.weight': dtype bfloat16 does not match the "
                                         r"target's float32"):
        sync.publish(master, 2, to=rx, dtype=BF16)   # one dtype for all: the router would be rounded
    with pytest.raises(ValueError, match=r"tensor 'layers.0.mlp.up.weight': the per-tensor dtype map has no entry"):
        sync.publish(master, 2, to=rx, dtype={"layers.0.mlp.gate.weight": F32})
    assert rx.version == 1 and torch.equal(live["layers.0.mlp.gate.weight"], master["layers.0.mlp.gate.weight"])


def test_corrupted_bytes_are_still_caught():
    master, dtypes, live, rx = setup()
    from bitmatch.sync.transport_inprocess import InProcessSender

    class Flip(InProcessSender):
        def _write(self, name, dst, src_bytes):
            super()._write(name, dst, src_bytes)
            if name == "layers.0.mlp.gate.weight":
                dst.view(torch.uint8)[0] ^= 1

    with pytest.raises(sync.FingerprintMismatchError, match="layers.0.mlp.gate.weight"):
        sync.publish(master, 1, to=Flip(rx), dtype=dtypes)
    assert rx.version is None
