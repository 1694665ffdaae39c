"""bitmatch.sync over TCP on loopback: round trip, bit flip in transit, sender killed, wrong token."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import bitmatch.sync as sync
from bitmatch.sync import channel as C
from sync_helpers import FakeVllmQwen3, bf16_target, bits_equal, tiny_qwen3, two_tensor_state

TOKEN = "s3cret-token"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def big_state(seed: int, n: int = 200_000):
    return two_tensor_state(seed, n, 100)


def test_tcp_round_trip_hf_and_vllm_layouts():
    master = tiny_qwen3(seed=0)
    engine = tiny_qwen3(seed=1, dtype=torch.bfloat16)
    rx = sync.receive(engine)
    with sync.serve(rx, TOKEN) as srv:
        assert srv.address[0] == "127.0.0.1"
        tx = sync.TcpSender(*srv.address, TOKEN, bucket_bytes=4096)
        man = sync.publish(master, 1, to=tx)
        sync.verify(engine, man)
        man2 = sync.publish(tiny_qwen3(seed=3), 2, to=tx)  # a second update on a new connection
        assert sync.require_ready(engine, 2) == 2 and man2.digest() == rx.state.manifest.digest()
    fake = FakeVllmQwen3(master)
    rxv = sync.receive(fake, layout="vllm")
    with sync.serve(rxv, TOKEN) as srv:
        man = sync.publish(master, 5, to=sync.TcpSender(*srv.address, TOKEN, bucket_bytes=4096))
    sync.verify(fake, man, layout="vllm")


class FlipProxy:
    """Loopback proxy that flips one bit at byte ``at`` of the client -> server stream."""

    def __init__(self, target, at: int):
        self.target, self.at = target, at
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = self.sock.getsockname()[:2]
        threading.Thread(target=self._run, daemon=True).start()

    def _pipe(self, src, dst, flip):
        # like a real proxy: each direction ends on its own (a half close), so the server's error
        # frame still reaches the client when the other direction fails first (under load the
        # relay thread carrying it can run late; shutting both sockets down here lost it)
        seen, open_ = 0, True
        try:
            while b := bytearray(src.recv(1 << 16)):
                if flip and seen <= self.at < seen + len(b):
                    b[self.at - seen] ^= 0x10
                seen += len(b)
                if open_:
                    try:
                        dst.sendall(b)
                    except OSError:
                        open_ = False  # the far end is gone: keep draining, the near end must not block
        except OSError:
            pass
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def _run(self):
        c, _ = self.sock.accept()
        s = socket.create_connection(self.target)
        threading.Thread(target=self._pipe, args=(s, c, False), daemon=True).start()
        self._pipe(c, s, True)


def test_tcp_bit_flip_in_transit_detected_previous_version_kept():
    m1, m2 = big_state(1), big_state(2)
    live = bf16_target(m1)
    rx = sync.receive(live)
    with sync.serve(rx, TOKEN) as srv:
        sync.publish(m1, 1, to=sync.TcpSender(*srv.address, TOKEN, bucket_bytes=1 << 16))
        proxy = FlipProxy(srv.address, at=500_000)  # inside tensor b's payload
        # the frame MAC catches it before the fingerprint would, and names the bucket's tensor
        with pytest.raises(sync.AuthenticationError, match=r"\['b.weight'\] failed their MAC"):
            sync.publish(m2, 2, to=sync.TcpSender(*proxy.address, TOKEN, bucket_bytes=1 << 16))
        assert rx.version == 1 and bits_equal(live, m1)
        assert "b.weight" in rx.last_error and "previous version 1 kept" in rx.last_error
        with pytest.raises(sync.WeightsNotReadyError):
            rx.require_ready()
        sync.publish(m2, 2, to=sync.TcpSender(*srv.address, TOKEN, bucket_bytes=1 << 16))
        assert rx.require_ready(2) == 2 and bits_equal(live, m2)


def test_tcp_wrong_token_refused_nothing_loaded():
    master = big_state(1)
    live = bf16_target(master)
    before = {k: v.clone() for k, v in live.items()}
    rx = sync.receive(live, initial_version=0)
    with sync.serve(rx, TOKEN) as srv:
        with pytest.raises(sync.AuthenticationError, match="wrong token"):
            sync.publish(master, 1, to=sync.TcpSender(*srv.address, "not-the-token"))
        # an unauthenticated client that just sends bytes; a refusal is counted before it is sent,
        # so reading it is enough (no sleep: the count must not depend on the machine's load)
        with socket.create_connection(srv.address) as s:
            C.recv_exact(s, len(C.MAGIC) + 33)
            s.sendall(b"\x00" * 4 + b'{"type": "begin"}' + b"x" * 64)
            assert C.recv_exact(s, 1) == b"\x00" and "wrong token" in C.recv_plain(s)["error"]
        assert srv.refused == 2
    assert rx.require_ready(0) == 0
    assert all(torch.equal(before[k], live[k]) for k in live)
    with pytest.raises(ValueError, match="token"):
        sync.TcpSender("127.0.0.1", 1, "")


SENDER = textwrap.dedent("""
    import sys, time, torch
    sys.path.insert(0, {tests!r})
    import bitmatch.sync as sync
    from test_sync_tcp import big_state
    class Stalls(sync.TcpSender):  # stops after 3 of its 25 buckets until the test kills it
        sent = 0
        def _send_bucket(self, *a):
            super()._send_bucket(*a)
            Stalls.sent += 1
            if Stalls.sent == 3:
                time.sleep(600)
    print("go", flush=True)
    sync.publish(big_state(2), 2, to=Stalls("127.0.0.1", int(sys.argv[1]), {token!r}, bucket_bytes=1 << 15))
""")


def test_tcp_sender_killed_mid_bucketed_update_keeps_old_version():
    # the sender stalls mid-update instead of sleeping per bucket: on a loaded machine a sleeping
    # sender could finish before the test looked, and the kill came after the commit
    m1 = big_state(1)
    live = bf16_target(m1)
    rx = sync.receive(live, staging="double_buffer")
    with sync.serve(rx, TOKEN, timeout=20) as srv:
        sync.publish(m1, 1, to=sync.TcpSender(*srv.address, TOKEN))
        code = SENDER.format(tests=os.path.join(ROOT, "tests"), token=TOKEN)
        p = subprocess.Popen([sys.executable, "-c", code, str(srv.address[1])], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.time() + 60
            while time.time() < deadline:
                upd = rx.update_in_progress
                if upd is not None and upd.received_bytes > (1 << 16):
                    break
                if p.poll() is not None:
                    pytest.fail(f"sender exited early: {p.stderr.read()}")
                time.sleep(0.01)
            else:
                pytest.fail("update never started")
            with pytest.raises(sync.WeightsNotReadyError, match="in progress"):
                rx.require_ready()
            p.kill()
        finally:
            p.wait()
        deadline = time.time() + 20
        while rx.update_in_progress is not None and time.time() < deadline:
            time.sleep(0.01)
        assert rx.version == 1 and bits_equal(live, m1)
        assert "sender disconnected" in rx.last_error and "previous version 1 kept" in rx.last_error
        with pytest.raises(sync.WeightsNotReadyError, match="sender disconnected"):
            rx.require_ready()
        m2 = big_state(2)
        sync.publish(m2, 2, to=sync.TcpSender(*srv.address, TOKEN, bucket_bytes=1 << 15))
        assert rx.require_ready(2) == 2 and bits_equal(live, m2)


def test_tcp_odd_sizes_zero_size_and_tensor_split_across_buckets():
    st = {"z": torch.zeros(0, 4), "o": torch.randn(3), "big": torch.randn(1000, 7), "s": torch.randn(()),
          "bf": torch.randn(3000).to(torch.bfloat16)}  # already bf16: sent from its own memory
    live = {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in st.items()}
    rx = sync.receive(live)
    with sync.serve(rx, TOKEN) as srv:
        man = sync.publish(st, 1, to=sync.TcpSender(*srv.address, TOKEN, bucket_bytes=1024))
    sync.verify(live, man)
    assert bits_equal(live, st)
