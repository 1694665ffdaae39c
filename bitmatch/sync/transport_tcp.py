"""TCP transport for a rollout server in another process or on another host.

Handshake (mutual): the server opens with a random nonce and its receiver's name; the client
refuses a server that serves another receiver than the one it names, answers with its own nonce
and HMAC-SHA256(token, "client" | transcript) (the transcript holds both nonces and the name, so
a publish relayed to another receiver that shares the token fails), the server checks it
(``hmac.compare_digest``) before reading anything else and proves itself with HMAC(token,
"server" | transcript); the client refuses a server that cannot (an impostor that took the port
receives nothing). The token never crosses the wire. Both ends then derive a per-connection key
K = HMAC(token, "key" | transcript).

Frames: a length-prefixed JSON header, then an HMAC(K) over the direction, a sequence number and
the header; a payload (bucket bytes) carries its own HMAC(K). So nothing on the path can rewrite,
drop, reorder or replay a tensor byte, a fingerprint, the version, the canonical-order stamp or
the commit digest: the receiver checks every MAC before it commits, and the sender checks the
MAC'd digest the receiver returns. What this does not give: secrecy (weights travel in clear)
and protection against a peer that holds the token. Run it over TLS or a private network when
the weights are secret; bmh1 fingerprints (``hash.py``) catch accidents, the MACs catch tampering.

Buckets of at most ``bucket_bytes`` are received straight into the receiver's staging
(``recv_into``). Time is bounded by deadlines, never per read: the handshake by ``auth_timeout``
(server) or ``timeout`` (sender), each frame by ``timeout``, so a peer trickling bytes cannot
hold a thread. The server serves each connection on its own thread, at most ``max_pending`` of
them in their handshake, and applies one update at a time (the receiver's lock). If the sender
dies mid-update the receiver aborts: the previous version stays live. docs/sync.md states the
threat model.
"""
from __future__ import annotations

import collections
import hmac
import socket
import threading
import time

import torch

from .channel import (
    LOOPBACK,
    Channel,
    client_handshake,
    error_reply,
    raise_reply,
    receiver_name,
    refuse_client,
    server_handshake,
    token_bytes,
)
from .errors import AuthenticationError, FingerprintMismatchError, SyncError
from .fingerprint import HASH_NAME, Manifest, TensorSpec, check_hash_name
from .receiver import Receiver
from .shared_bucket import BucketAuth, OpenedBucket
from .source import DEFAULT_BUCKET_BYTES, iter_buckets, named_weights, sender_order, wire_specs
from .version import check_version


def _int_field(d: dict, key: str, where: str) -> int:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise SyncError(f"{where}: field {key!r} must be an int >= 0, got {v!r}")
    return v


def _segments(f: dict) -> list[tuple[str, int, int]]:
    segs = f.get("segments")
    if not isinstance(segs, list):
        raise SyncError("bucket frame: 'segments' must be a list")
    out = []
    for s in segs:
        if not (isinstance(s, list) and len(s) == 3 and isinstance(s[0], str)):
            raise SyncError(f"bucket frame: segment {s!r} is not [name, offset, nbytes]")
        out.append((s[0], _int_field({"offset": s[1]}, "offset", "bucket frame"),
                    _int_field({"nbytes": s[2]}, "nbytes", "bucket frame")))
    fin = f.get("finished")
    if not isinstance(fin, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in fin.items()):
        raise SyncError("bucket frame: 'finished' must map tensor names to fingerprints")
    return out


class TcpReceiverServer:
    """Serve ``receiver`` on host:port (port 0 picks one; see ``address``) under the name ``name``
    (senders name the receiver they publish to; give each receiver that shares a token its own):
    a thread per connection, at most ``max_pending`` connections still in their handshake (more
    are closed at once), each handshake done within ``auth_timeout`` seconds and each frame within
    ``timeout`` seconds (deadlines, not per-read timeouts), one update at a time. ``refused``
    counts connections that did not authenticate; ``errors`` keeps the last ``ERRORS_KEPT``."""

    ERRORS_KEPT = 64

    def __init__(self, receiver: Receiver, token, host: str = "127.0.0.1", port: int = 0,
                 timeout: float = 60.0, auth_timeout: float = 5.0, *, name: str = "", max_pending: int = 32):
        self.token = token_bytes(token)
        receiver_name(name)  # validated before anything listens
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending must be an int >= 1 (connections allowed in their handshake), "
                             f"got {max_pending!r}")
        if host not in LOOPBACK and not host.startswith("127."):
            import warnings
            warnings.warn(f"bitmatch.sync TCP server listening on non-loopback {host}: frames are authenticated "
                          "but not encrypted (run it over TLS or a private network if the weights are secret)",
                          stacklevel=2)
        self.receiver, self.timeout, self.auth_timeout = receiver, timeout, auth_timeout
        self.name, self.max_pending = name, max_pending
        self.sock = socket.create_server((host, port))
        self.address = self.sock.getsockname()[:2]
        self.refused = 0
        self.errors: collections.deque[str] = collections.deque(maxlen=self.ERRORS_KEPT)
        self._lock = threading.Lock()
        self._pending = 0
        self._conns: dict[threading.Thread, socket.socket] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="bitmatch-sync-server", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop accepting, end every connection (an update in flight aborts: the previous version
        stays) and join every thread this server started."""
        self._stop.set()
        try:
            socket.create_connection(self.address, timeout=1).close()
        except OSError:
            pass
        self._thread.join(timeout=5)
        self.sock.close()
        with self._lock:
            conns = list(self._conns.items())
        for _, conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv / send
            except OSError:
                pass
        for th, _ in conns:
            th.join(timeout=10)

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
            with self._lock:
                full = self._pending >= self.max_pending
                if full:
                    self.refused += 1
                else:
                    self._pending += 1
            if full:  # the handshake slots are taken: a flood of half-open connections costs no thread
                conn.close()
                continue
            th = threading.Thread(target=self._connection, args=(conn,), name="bitmatch-sync-conn", daemon=True)
            with self._lock:
                self._conns[th] = conn
            th.start()

    def _connection(self, conn) -> None:
        deadline = time.monotonic() + self.auth_timeout
        try:
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                ch = self._handshake(conn, deadline)
                if ch is not None:
                    try:
                        self._frames(ch)
                    except Exception as e:  # the connection's problem, never the server's
                        with self._lock:
                            self.errors.append(repr(e))
        finally:
            with self._lock:
                self._conns.pop(threading.current_thread(), None)

    def _handshake(self, conn, deadline: float) -> Channel | None:
        """The channel, or None for a client that did not authenticate by the deadline (counted
        in ``refused`` before it is told: a sender that reads its refusal sees the count)."""
        try:
            try:
                return server_handshake(conn, self.token, self.name, deadline, self.timeout)
            except AuthenticationError as e:
                self._refuse(e)
                refuse_client(conn, e, deadline)
            except Exception as e:  # closed, silent or slow past the deadline, or not a client of ours
                self._refuse(e)
        except OSError:
            pass
        finally:
            with self._lock:
                self._pending -= 1
        return None

    def _refuse(self, e: BaseException) -> None:
        with self._lock:
            self.refused += 1
            self.errors.append(f"refused: {e!r}")

    def _frames(self, ch: Channel) -> None:
        while True:
            try:
                h = ch.recv()
            except (ConnectionError, socket.timeout):  # the sender is done (or went idle between updates)
                return
            if h.get("type") != "begin":
                ch.send(error_reply(SyncError(f"expected a 'begin' frame, got {h.get('type')!r}")))
                return
            self._update(ch, h)

    def _update(self, ch: Channel, h: dict) -> None:
        rx = self.receiver
        try:
            version = _int_field(h, "version", "begin frame")
            check_hash_name(h.get("hash"), f"weight update to version {version}")
            if not isinstance(h.get("tensors"), dict):
                raise SyncError("begin frame: 'tensors' must be an object")
            specs = {k: TensorSpec.from_json(v) for k, v in h["tensors"].items()}
            upd = rx.begin(version, specs, order=h.get("order"), quantization=h.get("quantization"))
        except Exception as e:
            ch.send(error_reply(e))
            raise
        ch.send({"ok": True})
        shared = auth = None
        with upd:
            try:
                if h.get("bucket") is not None:
                    peer = ch.sock.getpeername()[0]
                    if peer not in LOOPBACK and not peer.startswith("127."):
                        raise SyncError("a shared (IPC) bucket is only accepted from this host")
                    shared, auth = OpenedBucket(h["bucket"]), BucketAuth(ch.key)
                while True:
                    f = ch.recv()
                    if f.get("type") == "bucket":
                        self._bucket(ch, upd, f, shared, auth, specs)
                    elif f.get("type") == "commit":
                        if f.get("version") != version or f.get("order") != h.get("order"):
                            raise SyncError("commit frame: version or canonical-order stamp differ from the begin "
                                            "frame")
                        man = upd.commit(f.get("digest"))
                        ch.send({"ok": True, "version": man.version, "digest": man.digest()})
                        return
                    else:
                        raise SyncError(f"unexpected frame {f.get('type')!r} during an update")
            except (ConnectionError, socket.timeout, OSError) as e:
                upd.abort(f"sender disconnected mid-update to version {upd.version} after "
                          f"{upd.received_bytes} of {sum(s.nbytes for s in specs.values())} bytes ({e})")
                raise
            except Exception as e:
                upd.abort(f"update to version {upd.version} failed: {e}")
                try:
                    ch.send(error_reply(e))
                except OSError:
                    pass
                raise
            finally:
                if shared is not None:
                    shared.close()

    @staticmethod
    def _pinned(upd, n: int) -> torch.Tensor:
        """A pinned host buffer of at least n bytes, kept for the update (grows by doubling)."""
        host = getattr(upd, "host_bucket", None)
        if host is None or host.numel() < n:
            host = torch.empty(max(n, 2 * (0 if host is None else host.numel())), dtype=torch.uint8, pin_memory=True)
            upd.host_bucket = host
        return host

    @staticmethod
    def _from_shared(ch: Channel, upd, f: dict, shared, auth, segs) -> torch.Tensor:
        """The bucket's bytes, copied out into this process's memory and authenticated there: what
        another process writes into the bucket after this copy cannot reach the staging."""
        if shared is None:
            raise SyncError("bucket frame refers to a shared bucket that was not announced")
        total = sum(n for _, _, n in segs)
        if total > shared.nbytes:
            raise SyncError(f"bucket frame names {total} bytes of a shared bucket of {shared.nbytes}")
        # a CUDA IPC bucket is copied to the staging's own GPU (a shared-memory one is read on the CPU)
        dev = shared.device if shared.device.type == "cpu" or not segs else upd.buffer(segs[0][0]).device
        copy = getattr(upd, "shared_copy", None)
        if copy is None or copy.numel() < total or copy.device != dev:
            copy = upd.shared_copy = torch.empty(shared.nbytes, dtype=torch.uint8, device=dev)
        shared.read_into(copy[:total], 0)
        tag = f.get("mac")
        if not isinstance(tag, str) or not hmac.compare_digest(tag, auth.tag(copy[:total], ch.current_label())):
            raise AuthenticationError(
                f"the shared bucket holding {sorted({s[0] for s in segs})} failed its MAC: another process on this "
                "host rewrote it after the sender wrote it (or the sender's key differs); nothing of it was staged")
        return copy

    @staticmethod
    def _bucket(ch: Channel, upd, f: dict, shared, auth, specs) -> None:
        segs = _segments(f)
        pos, to_device = 0, []
        copy = TcpReceiverServer._from_shared(ch, upd, f, shared, auth, segs) if f.get("shared") else None
        for name, off, n in segs:
            buf = upd.buffer(name)
            if off + n > buf.numel():
                raise ValueError(f"tensor {name!r}: bytes [{off}, {off + n}) outside its {buf.numel()} bytes")
            if copy is not None:
                buf[off:off + n].copy_(copy[pos:pos + n])
            elif buf.device.type == "cpu":
                ch.recv_payload_into(memoryview(buf[off:off + n].numpy()))
            else:  # device staging: into a pinned host bucket first, copied once the MAC holds
                host = TcpReceiverServer._pinned(upd, sum(x[2] for x in segs))[pos:pos + n]
                ch.recv_payload_into(memoryview(host.numpy()))
                to_device.append((buf[off:off + n], host))
            pos += n
            upd.received_bytes += n
        if not f.get("shared") and segs:
            ch.end_payload(f"the bucket holding {sorted({s[0] for s in segs})}")
        for dst, src in to_device:
            dst.copy_(src)
        for name, fp in f["finished"].items():
            announced = specs.get(name).fingerprint if name in specs else None
            if announced is not None and announced != fp:
                raise FingerprintMismatchError(name, announced, fp, " (announced in 'begin', sent otherwise)")
            upd.finish(name, fp)
        if f.get("shared"):
            ch.send({"ok": True})  # copied out: the sender may refill the bucket


class TcpSender:
    """Publish to a TcpReceiverServer serving the receiver named ``receiver``; ``bucket_bytes``
    bounds the sender's extra memory; ``timeout``: seconds for the handshake, and for each frame
    (deadlines: a peer that trickles bytes cannot stretch them)."""

    def __init__(self, host: str, port: int, token, *, receiver: str = "", bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 timeout: float = 60.0):
        self.host, self.port, self.token = host, port, token_bytes(token)
        receiver_name(receiver)
        self.receiver, self.bucket_bytes, self.timeout = receiver, bucket_bytes, timeout

    def _connect(self) -> Channel:
        deadline = time.monotonic() + self.timeout
        sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return client_handshake(sock, self.token, f"{self.host}:{self.port}", self.receiver, deadline, self.timeout)
        except BaseException:
            sock.close()
            raise

    def _send_bucket(self, ch: Channel, buf, segs, finished) -> None:
        ch.send({"type": "bucket", "segments": segs, "finished": finished}, memoryview(buf.numpy()))

    def _buckets(self, weights, dtype):
        return iter_buckets(weights, dtype, self.bucket_bytes)

    def _begin_extra(self, weights) -> dict:
        return {}

    def send(self, model, version: int, dtype: torch.dtype = torch.bfloat16,
             quantization: str | None = None) -> Manifest:
        """``quantization``: the trainer's mode, announced in the begin frame; the receiver refuses
        another than its own (docs/fp8.md, FP8 mode)."""
        version = check_version(version, "TcpSender.send")
        where = f"weight update to version {version}: {self.host}:{self.port}"
        try:
            return self._send(model, version, dtype, quantization)
        except (socket.timeout, TimeoutError) as e:
            raise SyncError(f"{where} did not answer within {self.timeout} s ({e}); the receiver keeps its "
                            "previous version") from e
        except ConnectionRefusedError as e:
            raise SyncError(f"{where}: nothing listens there (start the receiver with bitmatch.sync.serve)") from e
        except OSError as e:  # ConnectionError included: the documented types only
            raise SyncError(f"{where} closed the connection ({e}) without saying why (the receiver was "
                            "closed, or it has no free handshake slot); it keeps its previous version") from e

    def _send(self, model, version: int, dtype: torch.dtype, quantization: str | None = None) -> Manifest:
        weights = named_weights(model)
        specs = wire_specs(weights, dtype)
        order = sender_order(weights)
        ch = self._connect()
        with ch.sock:
            mode = {} if quantization is None else {"quantization": quantization}
            ch.send({"type": "begin", "version": int(version), "hash": HASH_NAME, "order": order, **mode,
                     "tensors": {k: v.to_json() for k, v in specs.items()}, **self._begin_extra(weights)})
            raise_reply(ch.recv())
            fps, man = {}, None
            try:
                for buf, segs, finished in self._buckets(weights, dtype):
                    self._send_bucket(ch, buf, segs, finished)
                    fps.update(finished)
                man = Manifest(int(version), {k: TensorSpec(s.shape, s.dtype, fps[k]) for k, s in specs.items()},
                               quantization=quantization)
                ch.send({"type": "commit", "version": int(version), "order": order, "digest": man.digest()})
            except OSError:
                pass  # the receiver hung up: its error frame says why
            r = raise_reply(ch.recv())
            if man is None:
                raise SyncError("receiver hung up during the update without saying why")
            if r.get("version") != int(version) or r.get("digest") != man.digest():
                raise SyncError(f"the receiver committed version {r.get('version')} with digest {r.get('digest')}, "
                                f"the sender published version {version} with digest {man.digest()}")
            return man
