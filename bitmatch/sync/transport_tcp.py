"""TCP transport for a rollout server in another process (loopback by default).

Wire: length-prefixed JSON headers, raw payload bytes. The server opens with a random nonce;
the client answers HMAC-SHA256(token, nonce) (the token never crosses the wire) and the server
checks it with ``hmac.compare_digest`` before reading anything else, so a wrong-token client is
refused with nothing loaded. Weights then travel in buckets of at most ``bucket_bytes`` that the
server receives straight into the receiver's staging buffers (``recv_into``): the extra memory
of an update is one bucket on the sender and none on the receiver beyond its staging. If the
sender dies mid-update the receiver aborts: the previous version stays live.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import socket
import struct
import threading

import torch

from .fingerprint import HASH_NAME, Manifest, TensorSpec, check_hash_name
from .receiver import AuthenticationError, FingerprintMismatchError, Receiver, SyncError
from .shared_bucket import OpenedBucket
from .source import DEFAULT_BUCKET_BYTES, iter_buckets, named_weights, sender_order, wire_specs

_MAGIC = b"BMSYNC1\n"
_MAX_HEADER = 64 << 20
_LOOPBACK = ("127.0.0.1", "::1", "localhost")


def _token_bytes(token) -> bytes:
    b = token.encode() if isinstance(token, str) else bytes(token or b"")
    if not b:
        raise ValueError("a non-empty shared token is required")
    return b


def _mac(token: bytes, nonce: bytes) -> bytes:
    return hmac.new(token, _MAGIC + nonce, hashlib.sha256).digest()


def _recv_into(sock, mv) -> None:
    got = 0
    while got < len(mv):
        n = sock.recv_into(mv[got:])
        if n == 0:
            raise ConnectionError("peer closed the connection")
        got += n


def _recv_exact(sock, n: int) -> bytes:
    b = bytearray(n)
    _recv_into(sock, memoryview(b))
    return bytes(b)


def _send_frame(sock, header: dict, payload=None) -> None:
    h = json.dumps(header).encode()
    head = struct.pack(">I", len(h)) + h
    if payload is not None and 0 < len(payload) <= (1 << 16):
        sock.sendall(head + bytes(payload))  # one segment: no Nagle / delayed-ACK stall
        return
    sock.sendall(head)
    if payload is not None and len(payload):
        sock.sendall(payload)


def _recv_header(sock) -> dict:
    (n,) = struct.unpack(">I", _recv_exact(sock, 4))
    if n > _MAX_HEADER:
        raise SyncError(f"frame header of {n} bytes exceeds the limit")
    return json.loads(_recv_exact(sock, n))


def _error_reply(e: BaseException) -> dict:
    r = {"ok": False, "error": str(e), "kind": type(e).__name__}
    if isinstance(e, FingerprintMismatchError):
        r.update(name=e.name, expected=e.expected, got=e.got)
    return r


def _raise_reply(r: dict):
    if r.get("ok"):
        return r
    kind, msg = r.get("kind"), r.get("error", "unknown error")
    if kind == "FingerprintMismatchError":
        raise FingerprintMismatchError(r["name"], r["expected"], r["got"], " (reported by the receiver)")
    if kind == "AuthenticationError":
        raise AuthenticationError(msg)
    if kind == "ValueError":
        raise ValueError(msg)
    raise SyncError(f"receiver refused the update: {msg}")


class TcpReceiverServer:
    """Serve ``receiver`` on host:port (port 0 picks one; see ``address``). One update at a time."""

    def __init__(self, receiver: Receiver, token, host: str = "127.0.0.1", port: int = 0,
                 timeout: float = 60.0):
        if host not in _LOOPBACK and not host.startswith("127."):
            import warnings
            warnings.warn(f"bitmatch.sync TCP server listening on non-loopback {host}; the token "
                          "authenticates peers but the stream is not encrypted", stacklevel=2)
        self.receiver, self.token, self.timeout = receiver, _token_bytes(token), timeout
        self.sock = socket.create_server((host, port))
        self.address = self.sock.getsockname()[:2]
        self.refused = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="bitmatch-sync-server", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        try:
            socket.create_connection(self.address, timeout=1).close()
        except OSError:
            pass
        self._thread.join(timeout=5)
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if self._stop.is_set():
                conn.close()
                return
            with conn:
                conn.settimeout(self.timeout)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                try:
                    self._handle(conn)
                except Exception as e:  # the connection's problem, never the server's
                    self.errors.append(repr(e))

    def _handle(self, conn) -> None:
        nonce = secrets.token_bytes(32)
        conn.sendall(_MAGIC + nonce)
        try:
            answer = _recv_exact(conn, 32)
        except (ConnectionError, OSError):
            self.refused += 1
            return
        if not hmac.compare_digest(answer, _mac(self.token, nonce)):
            self.refused += 1
            _send_frame(conn, _error_reply(AuthenticationError("authentication failed: wrong token")))
            return
        _send_frame(conn, {"ok": True})
        while True:
            try:
                h = _recv_header(conn)
            except ConnectionError:
                return
            if h.get("type") != "begin":
                _send_frame(conn, _error_reply(SyncError(f"expected a 'begin' frame, got {h.get('type')!r}")))
                return
            self._update(conn, h)

    def _update(self, conn, h: dict) -> None:
        rx = self.receiver
        try:
            check_hash_name(h.get("hash"), f"weight update to version {h.get('version')}")
            specs = {k: TensorSpec.from_json(v) for k, v in h["tensors"].items()}
            upd = rx.begin(int(h["version"]), specs, order=h.get("order"))
        except Exception as e:
            _send_frame(conn, _error_reply(e))
            raise
        _send_frame(conn, {"ok": True})
        shared = None
        with upd:
            try:
                if h.get("bucket") is not None:
                    if conn.getpeername()[0] not in _LOOPBACK and not conn.getpeername()[0].startswith("127."):
                        raise SyncError("a shared (IPC) bucket is only accepted from this host")
                    shared = OpenedBucket(h["bucket"])
                while True:
                    f = _recv_header(conn)
                    if f["type"] == "bucket":
                        pos = 0
                        for name, off, n in f["segments"]:
                            buf = upd.buffer(name)
                            if not (isinstance(off, int) and isinstance(n, int)) or off < 0 or n < 0 \
                                    or off + n > buf.numel():
                                raise ValueError(f"tensor {name!r}: bytes [{off}, {off}+{n}) outside its "
                                                 f"{buf.numel()} bytes")
                            if f.get("shared"):
                                if shared is None or pos + n > shared.nbytes:
                                    raise SyncError("bucket frame refers to a shared bucket that was not announced "
                                                    "or is too small")
                                buf[off:off + n].copy_(shared.tensor[pos:pos + n])
                                pos += n
                            else:
                                _recv_into(conn, memoryview(buf[off:off + n].numpy()))
                            upd.received_bytes += n
                        for name, fp in f["finished"].items():
                            upd.finish(name, fp)
                        if f.get("shared"):
                            _send_frame(conn, {"ok": True})  # the sender may refill the bucket
                    elif f["type"] == "commit":
                        man = upd.commit(f.get("digest"))
                        _send_frame(conn, {"ok": True, "version": man.version, "digest": man.digest()})
                        return
                    else:
                        raise SyncError(f"unexpected frame {f['type']!r} during an update")
            except (ConnectionError, socket.timeout, OSError) as e:
                upd.abort(f"sender disconnected mid-update to version {upd.version} after "
                          f"{upd.received_bytes} of {sum(s.nbytes for s in specs.values())} bytes ({e})")
                raise
            except Exception as e:
                upd.abort(f"update to version {upd.version} failed: {e}")
                try:
                    _send_frame(conn, _error_reply(e))
                except OSError:
                    pass
                raise
            finally:
                if shared is not None:
                    shared.close()


class TcpSender:
    """Publish to a TcpReceiverServer; ``bucket_bytes`` bounds the sender's extra memory."""

    def __init__(self, host: str, port: int, token, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 timeout: float = 60.0):
        self.host, self.port, self.token = host, port, _token_bytes(token)
        self.bucket_bytes, self.timeout = bucket_bytes, timeout

    def _connect(self):
        sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello = _recv_exact(sock, len(_MAGIC) + 32)
        if not hello.startswith(_MAGIC):
            sock.close()
            raise SyncError("peer is not a bitmatch sync server")
        sock.sendall(_mac(self.token, hello[len(_MAGIC):]))
        try:
            _raise_reply(_recv_header(sock))
        except BaseException:
            sock.close()
            raise
        return sock

    def _send_bucket(self, sock, buf, segs, finished) -> None:
        _send_frame(sock, {"type": "bucket", "segments": segs, "finished": finished},
                    memoryview(buf.numpy()))

    def _buckets(self, weights, dtype):
        return iter_buckets(weights, dtype, self.bucket_bytes)

    def _begin_extra(self, weights) -> dict:
        return {}

    def send(self, model, version: int, dtype: torch.dtype = torch.bfloat16) -> Manifest:
        weights = named_weights(model)
        specs = wire_specs(weights, dtype)
        with self._connect() as sock:
            _send_frame(sock, {"type": "begin", "version": int(version), "hash": HASH_NAME,
                               "order": sender_order(weights),
                               "tensors": {k: v.to_json() for k, v in specs.items()}, **self._begin_extra(weights)})
            _raise_reply(_recv_header(sock))
            fps, man = {}, None
            try:
                for buf, segs, finished in self._buckets(weights, dtype):
                    self._send_bucket(sock, buf, segs, finished)
                    fps.update(finished)
                man = Manifest(int(version), {k: TensorSpec(s.shape, dtype, fps[k]) for k, s in specs.items()})
                _send_frame(sock, {"type": "commit", "digest": man.digest()})
            except OSError:
                pass  # the receiver hung up: its error frame says why
            _raise_reply(_recv_header(sock))
            if man is None:
                raise SyncError("receiver hung up during the update without saying why")
            return man
