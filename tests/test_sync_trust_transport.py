"""The sync transports against the second adversarial review (issue 53, items 9, 11-16): a publish
redirected to another receiver that shares the token, peers that trickle bytes, floods of
half-open connections, a shared-memory bucket truncated or rewritten by another process of the
same user, a receiver that hangs up mid-update, a server closed with connections open.

Every test has a control (the same attack without the fix succeeds, or the same relay to the
right receiver goes through) and none depends on how fast the machine is: clocks are counted in
bytes a trickling peer got to send, and waits poll for a condition with a generous bound."""
from __future__ import annotations

import os
import socket
import struct
import threading
import time

import numpy as np
import pytest
import torch

import bitmatch.sync as sync
from bitmatch.precision import compute_cast
from bitmatch.sync import channel as C, hash as H
from bitmatch.sync.shared_bucket import BucketAuth
from bitmatch.sync.transport_tcp import TcpReceiverServer
from sync_helpers import bf16_target, bits_equal, two_tensor_state

TOKEN = "shared-by-policy-and-reference"


def state(seed, n=4000):
    return two_tensor_state(seed, n, 10)


def wait_for(cond, what: str, limit: float = 30.0) -> None:
    """Poll ``cond`` until it holds; the bound only matters when it never does."""
    end = time.monotonic() + limit
    while not cond():
        if time.monotonic() > end:
            pytest.fail(f"{what}: not within {limit} s")
        time.sleep(0.01)


def closed_by_peer(sock, limit: float = 30.0) -> bool:
    """True once the peer closed ``sock`` (EOF or reset), False if it is still open after ``limit``."""
    sock.settimeout(limit)
    try:
        while sock.recv(1 << 16):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


# ---- 9. a publish redirected to another receiver that shares the token ------------------------------

class Relay:
    """An on-path attacker without the token: relays each connection to ``to`` byte for byte,
    optionally rewriting the receiver name in the server's hello to ``claim``."""

    def __init__(self, to, claim: str | None = None):
        self.to, self.claim = to, claim
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = self.sock.getsockname()[:2]
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        c, _ = self.sock.accept()
        s = socket.create_connection(self.to)
        if self.claim is not None:
            hello = C.recv_exact(s, len(C.MAGIC) + 33)
            C.recv_exact(s, hello[-1])
            c.sendall(hello[:-1] + C.receiver_name(self.claim))
        for src, dst in ((c, s), (s, c)):
            threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pipe(src, dst):
        try:
            while b := src.recv(1 << 16):
                dst.sendall(b)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


@pytest.mark.parametrize("claim", [None, "policy"])
def test_publish_redirected_to_another_receiver_is_refused(claim):
    m1, m2 = state(1), state(2)
    policy, reference = bf16_target(m1), bf16_target(m1)
    rx_p, rx_r = sync.receive(policy), sync.receive(reference)
    with TcpReceiverServer(rx_p, TOKEN, name="policy") as sp, TcpReceiverServer(rx_r, TOKEN, name="reference") as sr:
        sync.publish(m1, 1, to=sync.TcpSender(*sp.address, TOKEN, receiver="policy"))
        sync.publish(m1, 1, to=sync.TcpSender(*sr.address, TOKEN, receiver="reference"))
        # relayed to the reference as is, its hello names it; with the name rewritten, the
        # transcripts differ and the reference refuses the sender's proof
        match = "serves receiver 'reference'" if claim is None else "addressed another receiver"
        with pytest.raises(sync.AuthenticationError, match=match):
            sync.publish(m2, 2, to=sync.TcpSender(*Relay(sr.address, claim).address, TOKEN, receiver="policy"))
        assert rx_r.require_ready(1) == 1 and bits_equal(reference, m1)
        # control: the same relay to the receiver the sender names is transparent
        sync.publish(m2, 2, to=sync.TcpSender(*Relay(sp.address, claim).address, TOKEN, receiver="policy"))
        assert rx_p.require_ready(2) == 2 and bits_equal(policy, m2)


def test_receiver_names_are_validated():
    with pytest.raises(TypeError, match="receiver name must be a str"):
        sync.TcpSender("127.0.0.1", 1, TOKEN, receiver=3)
    with pytest.raises(ValueError, match="at most 255 bytes"):
        TcpReceiverServer(sync.receive(bf16_target(state(1))), TOKEN, name="x" * 256)


# ---- 11. deadlines, not per-read timeouts ------------------------------------------------------------

def test_client_trickling_its_proof_is_dropped_at_auth_timeout():
    rx = sync.receive(bf16_target(state(1)))
    with sync.serve(rx, TOKEN, auth_timeout=0.5) as srv:
        c = socket.create_connection(srv.address)
        C.recv_exact(c, len(C.MAGIC) + 33)
        sent = 0
        c.settimeout(0.1)  # one byte per 0.1 s: each read of the server gets a byte long before 0.5 s
        while sent < 63:
            try:
                if not c.recv(1):
                    break  # dropped
            except socket.timeout:
                pass
            except ConnectionResetError:
                break
            c.sendall(b"x")
            sent += 1
        c.close()
        # at 0.1 s a byte the deadline passes near byte 5; per-read timeouts let all 64 through
        assert sent < 40, f"the server read {sent} trickled bytes, past its 0.5 s handshake deadline"
        wait_for(lambda: srv.refused == 1, "the trickling client counted as refused")


def test_impostor_trickling_its_hello_does_not_hold_the_sender():
    lst = socket.create_server(("127.0.0.1", 0))
    hello = C.MAGIC + bytes(32) + C.receiver_name("")
    sent = [0]

    def impostor():
        c, _ = lst.accept()
        try:
            for i in range(len(hello)):
                c.sendall(hello[i:i + 1])
                sent[0] += 1
                time.sleep(0.2)
        except OSError:
            pass
        c.close()
    threading.Thread(target=impostor, daemon=True).start()
    with pytest.raises(sync.SyncError, match="did not answer within 1.0 s"):
        sync.publish(state(1), 1, to=sync.TcpSender(*lst.getsockname()[:2], TOKEN, timeout=1.0))
    got = sent[0]
    lst.close()
    assert got < len(hello), f"the sender waited for the whole trickled hello ({got} bytes at 0.2 s each)"


def test_authenticated_frame_trickled_is_dropped_at_the_frame_deadline():
    m = state(1)
    rx = sync.receive(bf16_target(m))
    with sync.serve(rx, TOKEN, timeout=0.5) as srv:
        ch = sync.TcpSender(*srv.address, TOKEN)._connect()
        sock, frame = ch.sock, bytearray()

        class Capture:
            def sendall(self, b):
                frame.extend(b)

            def settimeout(self, t):
                pass
        ch.sock = Capture()
        ch.send({"type": "begin", "version": 2, "hash": "bmh1", "order": None, "tensors": {}, "pad": "x" * 200})
        sock.settimeout(0.1)
        sent = 0
        for i in range(len(frame)):
            try:
                if not sock.recv(1):
                    break
            except socket.timeout:
                pass
            except ConnectionResetError:
                break
            try:
                sock.sendall(frame[i:i + 1])
            except OSError:
                break
            sent += 1
        sock.close()
        assert sent < len(frame) // 2, f"the server read {sent} of {len(frame)} trickled bytes of one frame"
    assert rx.version is None and rx.update_in_progress is None


# ---- 12. a cap on connections in their handshake, bounded error counters -----------------------------

def test_half_open_connections_are_capped():
    m = state(1)
    live = bf16_target(m)
    rx = sync.receive(live)
    with sync.serve(rx, TOKEN, auth_timeout=60, max_pending=4) as srv:
        idle = [socket.create_connection(srv.address) for _ in range(20)]
        helloed = 0
        for s in idle:
            s.settimeout(30)
            got = s.recv(64)
            helloed += bool(got)
            if got:
                assert not closed_by_peer(s, 0.05)
        # the first four hold the handshake slots (and a thread each); the rest got no thread
        assert helloed == 4 and srv.refused == 16
        with pytest.raises(sync.SyncError, match="closed the connection"):
            sync.publish(m, 1, to=sync.TcpSender(*srv.address, TOKEN, timeout=5))
        for s in idle:
            s.close()
        wait_for(lambda: srv.refused == 21, "the closed half-open connections give their slots back")
        sync.publish(m, 1, to=sync.TcpSender(*srv.address, TOKEN, timeout=5))
        assert rx.require_ready(1) == 1 and bits_equal(live, m)


def test_failed_handshakes_are_all_refused_and_errors_stay_bounded(monkeypatch):
    monkeypatch.setattr(TcpReceiverServer, "ERRORS_KEPT", 8, raising=False)
    rx = sync.receive(bf16_target(state(1)))
    with sync.serve(rx, TOKEN, max_pending=64) as srv:  # never capped here, however late the threads run
        for _ in range(40):  # a wrong proof, then a reset: the refusal cannot be sent
            c = socket.create_connection(srv.address)
            C.recv_exact(c, len(C.MAGIC) + 33)
            c.sendall(bytes(64))
            c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            c.close()
        wait_for(lambda: srv.refused == 40, "40 failed handshakes counted as refused")
        assert len(srv.errors) == 8


# ---- 13, 15. the shared-memory bucket: truncated, or rewritten with bmh1 kept ------------------------

class ThirdProcess(sync.IpcSender):
    """Another process of the same user acts on the bucket after the sender wrote it and before
    the receiver copies it (``attack(path)`` runs right before each bucket frame goes out)."""

    attack = None

    def _send_bucket(self, ch, buf, segs, finished):
        send = ch.send

        def send_after_attack(header, *a, **k):
            if header.get("type") == "bucket":
                type(self).attack(f"/dev/shm/{self._bucket.descriptor['name']}")
            return send(header, *a, **k)
        ch.send = send_after_attack
        try:
            super()._send_bucket(ch, buf, segs, finished)
        finally:
            ch.send = send


def test_truncated_bucket_is_a_sync_error_not_sigbus():
    m1, m2 = state(1), state(2)
    live = bf16_target(m1)
    rx = sync.receive(live)
    ThirdProcess.attack = staticmethod(lambda path: os.truncate(path, 0))
    with sync.serve(rx, TOKEN) as srv:
        sync.publish(m1, 1, to=sync.IpcSender(*srv.address, TOKEN))
        with pytest.raises(sync.SyncError, match="truncated by another process"):
            sync.publish(m2, 2, to=ThirdProcess(*srv.address, TOKEN))
    assert rx.version == 1 and bits_equal(live, m1)


def inv_fmix32(h: np.ndarray) -> np.ndarray:
    h = h.astype(np.uint64)
    m = np.uint64(0xFFFFFFFF)
    h ^= h >> np.uint64(16)
    h = (h * np.uint64(pow(0xC2B2AE35, -1, 1 << 32))) & m
    h ^= (h >> np.uint64(13)) ^ (h >> np.uint64(26))
    h = (h * np.uint64(pow(0x85EBCA6B, -1, 1 << 32))) & m
    h ^= h >> np.uint64(16)
    return h.astype(np.uint32)


def bmh1_forgery(words: np.ndarray, seed: int = 0) -> np.ndarray:
    """Other values for words 0-3 of ``words`` (uint32, a tensor's first bytes) with the same bmh1
    sums: word 1 cancels word 0's change of A exactly (fmix32 is invertible), and a birthday search
    over the pairs (0, 1) and (2, 3) cancels the change of B. What a process that can write the
    bucket does in a fraction of a second."""
    rng = np.random.default_rng(seed)
    s = (np.arange(4, dtype=np.uint64) * np.uint64(H.POS_MUL) + np.uint64(H.region_key(0))).astype(np.uint32)

    def fm(x):  # fmix32, as int64
        x = x.astype(np.uint64)
        for shift, mul in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
            x = ((x ^ (x >> np.uint64(shift))) * np.uint64(mul)) & np.uint64(0xFFFFFFFF)
        return (x ^ (x >> np.uint64(16))).astype(np.int64)

    def a(w, i):
        return fm(w ^ s[i])

    def b(w, i):
        return fm((w + (s[i] ^ np.uint32(H.B_SALT))) * np.uint32(H.B_MUL))

    def pair(i, n=1 << 18):
        w0 = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
        target = a(words[i + 1:i + 2], i + 1) - (a(w0, i) - a(words[i:i + 1], i))
        ok = (target >= 0) & (target < (1 << 32))
        w0, w1 = w0[ok], inv_fmix32(target[ok]) ^ s[i + 1]
        db = (b(w0, i) - b(words[i:i + 1], i)) + (b(w1, i + 1) - b(words[i + 1:i + 2], i + 1))
        return w0, w1, db
    p, q = pair(0), pair(2)
    common, ip, iq = np.intersect1d(p[2], -q[2], return_indices=True)
    assert common.size, "no collision in this draw"
    return np.array([p[0][ip[0]], p[1][ip[0]], q[0][iq[0]], q[1][iq[0]]], dtype=np.uint32)


def forge_in_place(path: str) -> None:
    """Rewrite the bucket's first four words (tensor a.weight's first bytes) keeping bmh1."""
    with open(path, "r+b") as f:
        words = np.frombuffer(f.read(16), dtype="<u4")
        f.seek(0)
        f.write(bmh1_forgery(words).astype("<u4").tobytes())


def test_bucket_rewritten_with_the_fingerprint_kept_is_refused():
    m1, m2 = state(1), state(2)
    w = compute_cast(m2["a.weight"], torch.bfloat16).view(torch.uint8).numpy()
    forged = bytearray(w.tobytes())
    forged[:16] = bmh1_forgery(np.frombuffer(w[:16].tobytes(), dtype="<u4")).tobytes()
    # the forgery is real: other bytes, the same bmh1 fingerprint
    assert bytes(forged) != w.tobytes()
    assert H.fingerprint(torch.frombuffer(forged, dtype=torch.uint8)) == H.fingerprint(torch.from_numpy(w))
    live = bf16_target(m1)
    rx = sync.receive(live)
    ThirdProcess.attack = staticmethod(forge_in_place)
    with sync.serve(rx, TOKEN) as srv:
        sync.publish(m1, 1, to=sync.IpcSender(*srv.address, TOKEN))
        with pytest.raises(sync.AuthenticationError, match="shared bucket .* failed its MAC"):
            sync.publish(m2, 2, to=ThirdProcess(*srv.address, TOKEN))
        assert rx.version == 1 and bits_equal(live, m1)
        sync.publish(m2, 2, to=sync.IpcSender(*srv.address, TOKEN))  # control: untouched, it goes through
        assert rx.require_ready(2) == 2 and bits_equal(live, m2)


def test_device_bucket_mac_catches_the_forgery_and_every_single_change():
    """The MAC a CUDA IPC bucket gets (the universal-hash levels), run here on CPU tensors: the same
    integer arithmetic, the same digest on every device."""
    auth = BucketAuth(b"k" * 32)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (3 * (128 << 10) + 1234,), dtype=torch.uint8, generator=g)
    ref = auth.universal(data)
    forged = data.clone()
    forged[:16] = torch.from_numpy(bmh1_forgery(data[:16].numpy().view("<u4")).view(np.uint8))
    assert H.fingerprint(forged) == H.fingerprint(data) and auth.universal(forged) != ref
    for at in (0, 1, 127, 128, 1 << 17, data.numel() - 1):
        d = data.clone()
        d[at] ^= 0x80
        assert auth.universal(d) != ref, at
    assert BucketAuth(b"other key" * 4).universal(data) != ref
    if torch.cuda.is_available():
        assert auth.universal(data.cuda()) == ref


# ---- 14. the receiver hangs up mid-update --------------------------------------------------------------

class HangsUp(TcpReceiverServer):
    """A receiver whose process goes away in the middle of an update: no error frame."""

    @staticmethod
    def _bucket(ch, upd, f, *a):
        ch.sock.shutdown(socket.SHUT_RDWR)
        raise ConnectionError("receiver went away")


def test_receiver_hanging_up_mid_update_is_a_sync_error():
    m1, m2 = state(1, 200_000), state(2, 200_000)
    live = bf16_target(m1)
    rx = sync.receive(live)
    sync.publish(m1, 1, to=rx)
    with HangsUp(rx, TOKEN) as srv:
        with pytest.raises(sync.SyncError, match="closed the connection"):
            sync.publish(m2, 2, to=sync.TcpSender(*srv.address, TOKEN, bucket_bytes=1 << 16))
    assert rx.version == 1 and bits_equal(live, m1)


# ---- 16. close() joins the connection threads ----------------------------------------------------------

def test_close_ends_and_joins_every_connection_thread():
    rx = sync.receive(bf16_target(state(1)))
    before = set(threading.enumerate())
    srv = sync.serve(rx, TOKEN, auth_timeout=60)
    idle = socket.create_connection(srv.address)
    C.recv_exact(idle, len(C.MAGIC) + 33)  # its thread is in the handshake
    authed = sync.TcpSender(*srv.address, TOKEN)._connect()  # its thread waits for a frame
    srv.close()
    left = [t.name for t in set(threading.enumerate()) - before if t.name.startswith("bitmatch-sync")]
    assert left == [], f"threads still running after close(): {left}"
    assert closed_by_peer(idle, 5) and closed_by_peer(authed.sock, 5)
    idle.close()
    authed.sock.close()
