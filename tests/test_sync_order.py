"""The canonical-order stamp (bitmatch.kernels.order) travels with every weight update: the receiver
refuses a sender whose kernels run another order or backend, and keeps its previous version."""
from __future__ import annotations

import pytest
import torch

import bitmatch.sync as sync
from bitmatch.kernels.order import ORDER, CanonicalOrder
from sync_helpers import tiny_qwen3

TOKEN = "order-test-token"


def test_stamp_names_every_bit_changing_switch():
    ref, tri = ORDER.stamp("reference"), ORDER.stamp("triton")
    assert ref["fingerprint"] != tri["fingerprint"]
    assert {"kv_block", "kv_partition", "rowsum_mma", "linear_split_table"} <= set(tri)
    assert CanonicalOrder(rowsum_mma=False).stamp("triton")["fingerprint"] != tri["fingerprint"]
    assert CanonicalOrder(kv_block=32).stamp("triton")["fingerprint"] != tri["fingerprint"]
    assert CanonicalOrder().stamp("triton") == tri  # a pure function of the order
    with pytest.raises(ValueError, match="backend"):
        ORDER.stamp("cuda")


def test_inprocess_publish_carries_the_stamp_and_a_foreign_order_is_refused(monkeypatch):
    master, engine = tiny_qwen3(seed=0, dtype=torch.float32), tiny_qwen3(seed=1, dtype=torch.bfloat16)
    rx = sync.receive(engine)
    man = sync.publish(master, 1, to=rx)
    assert rx.state.manifest.order == ORDER.stamp("reference") and man.tensors
    before = {k: p.clone() for k, p in engine.named_parameters()}
    # a sender whose kernels run the Triton order (e.g. a CUDA trainer feeding a CPU engine)
    import bitmatch.sync.transport_inprocess as tip
    monkeypatch.setattr(tip, "sender_order", lambda w: ORDER.stamp("triton"))
    with pytest.raises(sync.CanonicalOrderError, match="rowsum_mma"):
        sync.publish(tiny_qwen3(seed=2), 2, to=rx)
    assert rx.version == 1 and all(torch.equal(p, before[k]) for k, p in engine.named_parameters())
    monkeypatch.setattr(tip, "sender_order", lambda w: CanonicalOrder(version=2).stamp("reference"))
    with pytest.raises(sync.CanonicalOrderError, match="version"):
        sync.publish(tiny_qwen3(seed=2), 2, to=rx)
    assert rx.version == 1
    sync.require_ready(engine, 1)


def test_tcp_sends_the_stamp_and_the_receiver_refuses_a_mismatch(monkeypatch):
    master, engine = tiny_qwen3(seed=0), tiny_qwen3(seed=1, dtype=torch.bfloat16)
    rx = sync.receive(engine)
    import bitmatch.sync.transport_tcp as ttcp
    with sync.serve(rx, TOKEN) as srv:
        sync.publish(master, 1, to=sync.TcpSender(*srv.address, TOKEN, bucket_bytes=1 << 16))
        assert rx.state.manifest.order == ORDER.stamp("reference")
        monkeypatch.setattr(ttcp, "sender_order", lambda w: CanonicalOrder(kv_partition=256).stamp("reference"))
        # the reference backend has no KV partition: the stamps agree, the update goes through
        sync.publish(master, 2, to=sync.TcpSender(*srv.address, TOKEN, bucket_bytes=1 << 16))
        monkeypatch.setattr(ttcp, "sender_order", lambda w: ORDER.stamp("triton"))
        with pytest.raises(Exception, match="canonical order"):
            sync.publish(master, 3, to=sync.TcpSender(*srv.address, TOKEN, bucket_bytes=1 << 16))
    assert rx.version == 2
