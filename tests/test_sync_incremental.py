"""Publishing only what changed (bitmatch.sync in process): a tensor whose cast bytes already have
the live version's fingerprint is not copied; the receiver re-checks those live tensors at commit,
so a live tensor changed after it was verified is caught instead of carried into the new version."""
from __future__ import annotations

import pytest
import torch

import bitmatch.sync as sync
from bitmatch.sync.transport_inprocess import InProcessSender
from sync_helpers import bits_equal as bits


def master_state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(33, 17, generator=g) for i in range(4)} | \
        {"norm.weight": torch.randn(17, generator=g)}


class CountingSender(InProcessSender):
    def __init__(self, rx, **kw):
        super().__init__(rx, **kw)
        self.written: list[str] = []

    def _write(self, name, dst, src_bytes):
        self.written.append(name)
        super()._write(name, dst, src_bytes)


def setup():
    master = master_state()
    live = {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in master.items()}
    rx = sync.receive(live)
    return master, live, rx


def test_only_changed_tensors_are_written():
    master, live, rx = setup()
    tx = CountingSender(rx)
    m1 = sync.publish(master, 1, to=tx)
    assert sorted(tx.written) == sorted(master)  # the first version: everything
    tx.written.clear()
    master["layers.2.weight"] += 0.5  # what a LoRA merge or an optimizer step changes
    m2 = sync.publish(master, 2, to=tx)
    assert tx.written == ["layers.2.weight"]
    assert bits(live, master) and rx.require_ready(2) == 2
    sync.verify(live, m2)
    same = [k for k in master if k != "layers.2.weight"]
    assert all(m2.tensors[k].fingerprint == m1.tensors[k].fingerprint for k in same)
    assert m2.tensors["layers.2.weight"].fingerprint != m1.tensors["layers.2.weight"].fingerprint


def test_control_non_incremental_writes_everything():
    master, live, rx = setup()
    tx = CountingSender(rx, incremental=False)
    sync.publish(master, 1, to=tx)
    tx.written.clear()
    sync.publish(master, 2, to=tx)
    assert sorted(tx.written) == sorted(master)


def test_live_tensor_changed_after_verify_is_caught():
    master, live, rx = setup()
    sync.publish(master, 1, to=rx)
    live["layers.1.weight"].view(torch.int16)[3, 4] ^= 1  # a stray write into the live weights
    with pytest.raises(sync.FingerprintMismatchError, match="layers.1.weight.*changed after it was verified"):
        sync.publish(master, 2, to=rx)
    with pytest.raises(sync.WeightsNotReadyError):
        rx.require_ready()
    sync.publish(master, 3, to=InProcessSender(rx, incremental=False))  # the named fix
    assert bits(live, master) and rx.require_ready(3) == 3


def test_keep_refuses_a_fingerprint_the_live_version_does_not_hold():
    master, live, rx = setup()
    sync.publish(master, 1, to=rx)
    specs = {k: sync.TensorSpec(tuple(v.shape), torch.bfloat16) for k, v in master.items()}
    with pytest.raises(sync.SyncError, match="sent as unchanged"):
        with rx.begin(2, specs, order=rx.order()) as upd:
            upd.keep("norm.weight", "0" * 32)
    assert rx.version == 1 and bits(live, master)
