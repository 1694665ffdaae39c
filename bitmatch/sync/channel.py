"""The authenticated channel under the TCP and IPC sync transports (transport_tcp.py states the
protocol): the mutual HMAC handshake, MAC'd JSON frames with per-direction sequence numbers,
payload MACs over chunk digests hashed on a thread pool, and the error replies both ends share.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
import struct
import time
from concurrent.futures import ThreadPoolExecutor

from .errors import AuthenticationError, FingerprintMismatchError, SyncError

MAGIC = b"BMSYNC3\n"  # 3: the receiver's name in the hello and the transcript
MAX_HEADER = 64 << 20
LOOPBACK = ("127.0.0.1", "::1", "localhost")
MAC_BYTES = 32


def token_bytes(token) -> bytes:
    if isinstance(token, str):
        b = token.encode()
    elif isinstance(token, (bytes, bytearray)):
        b = bytes(token)
    else:
        raise TypeError(f"token must be str or bytes (the shared secret), got {type(token).__name__}")
    if not b:
        raise ValueError("a non-empty shared token is required")
    return b


def hmac_sha256(key: bytes, *parts: bytes) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        h.update(p)
    return h.digest()


CHUNK_BYTES = 4 << 20
_POOL: ThreadPoolExecutor | None = None


def chunk_digests(pieces) -> bytes:
    """SHA-256 of each 4 MiB chunk of the concatenated byte pieces, hashed on threads (hashlib
    releases the GIL): a payload MAC at several GB/s where one core gives 0.4-1.2."""
    global _POOL
    plan, cur, room = [], [], CHUNK_BYTES
    for mv in pieces:
        mv = memoryview(mv).cast("B")
        while len(mv):
            take = min(room, len(mv))
            cur.append(mv[:take])
            mv, room = mv[take:], room - take
            if room == 0:
                plan.append(cur)
                cur, room = [], CHUNK_BYTES
    if cur:
        plan.append(cur)

    def digest(parts):
        h = hashlib.sha256()
        for p in parts:
            h.update(p)
        return h.digest()
    if len(plan) <= 1:
        return b"".join(digest(p) for p in plan)
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="bitmatch-mac")
    return b"".join(_POOL.map(digest, plan))


def payload_mac(key: bytes, direction: bytes, seq: bytes, pieces, nbytes: int) -> bytes:
    return hmac_sha256(key, direction, seq, b"payload", struct.pack(">Q", nbytes), chunk_digests(pieces))


def recv_into(sock, mv, deadline: float | None = None) -> None:
    """Fill ``mv`` from ``sock`` by ``deadline`` (time.monotonic()): a deadline, not a per-recv
    timeout, so a peer trickling a byte at a time cannot hold the connection past it."""
    got = 0
    while got < len(mv):
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("deadline passed")
            sock.settimeout(left)
        n = sock.recv_into(mv[got:])
        if n == 0:
            raise ConnectionError("peer closed the connection")
        got += n


def recv_exact(sock, n: int, deadline: float | None = None) -> bytes:
    b = bytearray(n)
    recv_into(sock, memoryview(b), deadline)
    return bytes(b)


def send_all(sock, data, deadline: float | None) -> None:
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("deadline passed")
        sock.settimeout(left)  # sendall's timeout bounds the whole call (Python >= 3.5)
    sock.sendall(data)


def send_plain(sock, header: dict, deadline: float | None = None) -> None:
    """An unauthenticated frame: only the refusal of a client that failed the handshake."""
    h = json.dumps(header).encode()
    send_all(sock, struct.pack(">I", len(h)) + h, deadline)


def recv_plain(sock, deadline: float | None = None) -> dict:
    (n,) = struct.unpack(">I", recv_exact(sock, 4, deadline))
    if n > 1 << 16:
        raise SyncError(f"refusal frame of {n} bytes exceeds the limit")
    return json.loads(recv_exact(sock, n, deadline))


class Channel:
    """MAC'd frames over an authenticated socket: header HMACs bind a per-direction sequence
    number, payload HMACs bind the header's number. ``timeout``: seconds each frame (header,
    payload and MACs) may take from the moment it is awaited or sent: a deadline per frame."""

    def __init__(self, sock, key: bytes, out_dir: bytes, in_dir: bytes, timeout: float | None = None):
        self.sock, self.key, self.out_dir, self.in_dir = sock, key, out_dir, in_dir
        self.timeout = timeout
        if timeout is None:
            sock.settimeout(None)  # blocking: no leftover of the handshake's deadline
        self.sent = self.received = 0
        self._seq, self._pieces, self._deadline = b"", [], None

    def _frame_deadline(self) -> float | None:
        return None if self.timeout is None else time.monotonic() + self.timeout

    def next_label(self) -> bytes:
        """Direction and sequence number of the next frame this end sends (binds a bucket's MAC)."""
        return self.out_dir + struct.pack(">Q", self.sent)

    def current_label(self) -> bytes:
        """Direction and sequence number of the frame received last."""
        return self.in_dir + self._seq

    def send(self, header: dict, payload=None, deadline: float | None = None) -> None:
        deadline = deadline or self._frame_deadline()
        h = json.dumps(header).encode()
        seq = struct.pack(">Q", self.sent)
        head = struct.pack(">I", len(h)) + h + hmac_sha256(self.key, self.out_dir, seq, h)
        if payload is not None and len(payload):
            mac = payload_mac(self.key, self.out_dir, seq, [payload], len(payload))
            if len(payload) <= (1 << 16):
                send_all(self.sock, head + bytes(payload) + mac, deadline)  # one segment: no Nagle stall
            else:
                for part in (head, payload, mac):
                    send_all(self.sock, part, deadline)
        else:
            send_all(self.sock, head, deadline)
        self.sent += 1

    def recv(self, deadline: float | None = None) -> dict:
        self._deadline = deadline = deadline or self._frame_deadline()
        (n,) = struct.unpack(">I", recv_exact(self.sock, 4, deadline))
        if n > MAX_HEADER:
            raise SyncError(f"frame header of {n} bytes exceeds the limit")
        h = recv_exact(self.sock, n, deadline)
        seq = struct.pack(">Q", self.received)
        if not hmac.compare_digest(recv_exact(self.sock, MAC_BYTES, deadline),
                                   hmac_sha256(self.key, self.in_dir, seq, h)):
            raise AuthenticationError("a frame from the peer failed its MAC: it was changed in transit or does not "
                                      "come from a holder of the token")
        self._seq, self._pieces = seq, []
        self.received += 1
        d = json.loads(h)
        if not isinstance(d, dict):
            raise SyncError("frame header must be a JSON object")
        return d

    def recv_payload_into(self, mv) -> None:
        """Receive the next piece of the current frame's payload into ``mv`` (it must stay unchanged
        until ``end_payload`` has checked the MAC), within the frame's deadline."""
        recv_into(self.sock, mv, self._deadline)
        self._pieces.append(mv)

    def end_payload(self, what: str) -> None:
        pieces, self._pieces = self._pieces, []
        want = payload_mac(self.key, self.in_dir, self._seq, pieces, sum(len(p) for p in pieces))
        if not hmac.compare_digest(recv_exact(self.sock, MAC_BYTES, self._deadline), want):
            raise AuthenticationError(f"the bytes of {what} failed their MAC: changed in transit")


def error_reply(e: BaseException) -> dict:
    r = {"ok": False, "error": str(e), "kind": type(e).__name__}
    if isinstance(e, FingerprintMismatchError):
        r.update(name=e.name, expected=e.expected, got=e.got)
    return r


def raise_reply(r: dict):
    if r.get("ok"):
        return r
    kind, msg = r.get("kind"), r.get("error", "unknown error")
    if kind == "FingerprintMismatchError":
        raise FingerprintMismatchError(r["name"], r["expected"], r["got"], " (reported by the receiver)")
    if kind == "AuthenticationError":
        raise AuthenticationError(msg)
    if kind in ("ValueError", "TypeError"):
        raise ValueError(msg)
    raise SyncError(f"receiver refused the update: {msg}")


def receiver_name(name) -> bytes:
    """The receiver's name as it goes into the hello and the transcript: one length byte + UTF-8."""
    if not isinstance(name, str):
        raise TypeError(f"a receiver name must be a str, got {type(name).__name__}")
    b = name.encode()
    if len(b) > 255:
        raise ValueError(f"a receiver name must be at most 255 bytes, got {len(b)}")
    return bytes([len(b)]) + b


def server_handshake(conn, token: bytes, name: str, deadline: float, timeout: float | None) -> Channel:
    """The server's half, all of it by ``deadline``: send the nonce and this receiver's name,
    check the client's proof (nothing else is read before it), prove the server knows the token.
    Raises AuthenticationError for a wrong proof (the caller counts it, then sends
    ``refuse_client``), ConnectionError / socket.timeout for a client that closed or went slow."""
    nonce_s = secrets.token_bytes(32)
    hello = MAGIC + nonce_s + receiver_name(name)
    send_all(conn, hello, deadline)
    msg = recv_exact(conn, 32 + MAC_BYTES, deadline)
    # the name is in the transcript: a proof made for another receiver that shares the token fails
    transcript = hello + msg[:32]
    if not hmac.compare_digest(msg[32:], hmac_sha256(token, b"client", transcript)):
        raise AuthenticationError(f"authentication failed: wrong token, or the sender addressed another receiver "
                                  f"than this one ({name!r})")
    send_all(conn, b"\x01" + hmac_sha256(token, b"server", transcript), deadline)
    ch = Channel(conn, hmac_sha256(token, b"key", transcript), b"S", b"C", timeout)
    ch.send({"ok": True}, deadline=deadline)
    return ch


def refuse_client(conn, e: AuthenticationError, deadline: float) -> None:
    """Tell a client that failed the handshake why (unauthenticated: a status byte and one frame)."""
    send_all(conn, b"\x00", deadline)
    send_plain(conn, error_reply(e), deadline)


def client_handshake(sock, token: bytes, where: str, receiver: str, deadline: float,
                     timeout: float | None) -> Channel:
    """The client's half on a connected ``sock``, all of it by ``deadline``: refuse a peer that is
    not a bitmatch sync server of this version, serves another receiver than ``receiver``, or
    cannot prove it knows the token (nothing is sent to it)."""
    want = receiver_name(receiver)
    hello = recv_exact(sock, len(MAGIC) + 32 + 1, deadline)
    if not hello.startswith(MAGIC):
        raise SyncError(f"{where} is not a bitmatch sync server of this version")
    got = recv_exact(sock, hello[-1], deadline)
    if got != want[1:]:
        raise AuthenticationError(
            f"the server at {where} serves receiver {got.decode(errors='replace')!r}, this sender publishes to "
            f"{receiver!r}: nothing was sent (a wrong address, or a connection redirected to another receiver; "
            "name the receiver with TcpSender(..., receiver=...) and serve(..., name=...))")
    nonce_c = secrets.token_bytes(32)
    transcript = hello + got + nonce_c
    send_all(sock, nonce_c + hmac_sha256(token, b"client", transcript), deadline)
    status = recv_exact(sock, 1, deadline)
    if status != b"\x01":
        raise_reply(recv_plain(sock, deadline))
        raise AuthenticationError("the server refused the handshake")
    if not hmac.compare_digest(recv_exact(sock, MAC_BYTES, deadline), hmac_sha256(token, b"server", transcript)):
        raise AuthenticationError(f"the server at {where} did not prove it knows the token "
                                  "(an impostor on that port, or another token); nothing was sent")
    ch = Channel(sock, hmac_sha256(token, b"key", transcript), b"C", b"S", timeout)
    raise_reply(ch.recv(deadline))
    return ch
