"""bitmatch.sync across processes on one node: the IPC transport (TCP control channel, weight bytes
through a shared bucket). On the CPU the bucket is POSIX shared memory; the CUDA IPC bucket runs
the same code with a device buffer and is exercised in benchmarks/sync/sync.py on the GPU."""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import bitmatch.sync as sync
from bitmatch.sync.shared_bucket import OpenedBucket
from sync_helpers import FakeVllmQwen3, bits_equal, tiny_qwen3

TOKEN = "ipc-token"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _shm_left():
    return sorted(glob.glob("/dev/shm/bitmatch_*"))


def odd_state(seed):
    g = torch.Generator().manual_seed(seed)
    # odd element counts: tensors split across buckets on word boundaries, last words padded
    return {"a.weight": torch.randn(1001, 7, generator=g), "b.bias": torch.randn(3, generator=g),
            "c.weight": torch.randn(2049, generator=g)}


@pytest.mark.parametrize("bucket", [1024, 4096, 1 << 20])
def test_ipc_round_trip_equals_tcp(bucket):
    before = _shm_left()
    master = odd_state(0)
    live = {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in master.items()}
    rx = sync.receive(live)
    with sync.serve(rx, TOKEN) as srv:
        man = sync.publish(master, 1, to=sync.IpcSender(*srv.address, TOKEN, bucket_bytes=bucket))
        assert bits_equal(live, master) and rx.require_ready(1) == 1
        sync.verify(live, man)
        tcp = sync.publish(master, 2, to=sync.TcpSender(*srv.address, TOKEN, bucket_bytes=bucket))
    assert {k: s.fingerprint for k, s in man.tensors.items()} == {k: s.fingerprint for k, s in tcp.tensors.items()}
    assert _shm_left() == before, "the sender must unlink its bucket after the update"


def test_ipc_vllm_layout():
    master = tiny_qwen3(seed=0)
    fake = FakeVllmQwen3(master)
    rx = sync.receive(fake, layout="vllm")
    with sync.serve(rx, TOKEN) as srv:
        man = sync.publish(master, 4, to=sync.IpcSender(*srv.address, TOKEN, bucket_bytes=8192))
    sync.verify(fake, man, layout="vllm")


class CorruptingSender(sync.IpcSender):
    """Flips one bit in the shared bucket after the sender hashed it: what a stray write by a
    third process, or a copy that raced the sender, would do."""

    def _send_bucket(self, sock, buf, segs, finished):
        buf[len(buf) // 2] ^= 1
        super()._send_bucket(sock, buf, segs, finished)


def test_corrupted_bucket_is_refused_and_previous_version_kept():
    master, new = odd_state(0), odd_state(1)
    live = {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in master.items()}
    rx = sync.receive(live)
    with sync.serve(rx, TOKEN) as srv:
        sync.publish(master, 1, to=sync.IpcSender(*srv.address, TOKEN))
        with pytest.raises(sync.FingerprintMismatchError, match="reported by the receiver"):
            sync.publish(new, 2, to=CorruptingSender(*srv.address, TOKEN, bucket_bytes=4096))
    assert bits_equal(live, master), "the previous version must stay live"
    with pytest.raises(sync.WeightsNotReadyError, match="refusing to generate"):
        rx.require_ready()
    assert _shm_left() == []


@pytest.mark.parametrize("desc, match", [
    ({"kind": "shm", "nbytes": 16, "name": "/etc/passwd"}, "not a bitmatch bucket"),
    ({"kind": "shm", "nbytes": -1, "name": "bitmatch_0000000000000000"}, "'nbytes' must be an int >= 0"),
    ({"kind": "tcp", "nbytes": 16}, "unknown kind"),
    ({"kind": "cuda_ipc", "nbytes": 16, "handle": "zz"}, "CUDA|hex"),
])
def test_bad_descriptors_are_named(desc, match):
    if desc["kind"] == "cuda_ipc" and torch.cuda.is_available():
        pytest.skip("a CUDA machine would try to open the handle")
    with pytest.raises(sync.SyncError, match=match):
        OpenedBucket(desc)


RECEIVER = textwrap.dedent("""
    import sys, torch, bitmatch.sync as sync
    live = {"a.weight": torch.zeros(1001, 7, dtype=torch.bfloat16), "b.bias": torch.zeros(3, dtype=torch.bfloat16),
            "c.weight": torch.zeros(2049, dtype=torch.bfloat16)}
    rx = sync.receive(live)
    srv = sync.serve(rx, sys.argv[1])
    print(srv.address[1], flush=True)
    sys.stdin.readline()                      # the parent published: report what this process holds
    print(rx.require_ready(), sync.fingerprints_of(live.values()), flush=True)
    srv.close()
""")


def test_ipc_into_another_process():
    master = odd_state(2)
    p = subprocess.Popen([sys.executable, "-c", RECEIVER, TOKEN], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    try:
        port = int(p.stdout.readline())
        man = sync.publish(master, 7, to=sync.IpcSender("127.0.0.1", port, TOKEN, bucket_bytes=2048))
        p.stdin.write("\n")
        p.stdin.flush()
        line = p.stdout.readline().split(" ", 1)
        assert int(line[0]) == 7
        assert eval(line[1]) == [man.tensors[k].fingerprint for k in ("a.weight", "b.bias", "c.weight")]
    finally:
        p.stdin.close()
        p.wait(timeout=30)
    assert p.returncode == 0
    assert not any(os.path.basename(x).startswith("bitmatch_") for x in _shm_left())
