"""A bucket of bytes two processes on one node both see: CUDA IPC memory on a GPU, POSIX shared
memory on the CPU. The IPC transport (``transport_ipc.py``) casts weights into it on the sender's
device; the receiver copies them from it into its staging on its own device. Only a descriptor
(plain JSON: numbers and hex strings) crosses the authenticated control channel; the receiver
rebuilds the mapping from it with fixed classes, never by unpickling what the peer sent.

The bucket is not trusted: any process of the same user can open /dev/shm, and bmh1 (an unkeyed
sum) can be forged. So the sender tags the bucket's bytes with a key derived from the session key
(``BucketAuth``) before it copies them into the bucket, the tag travels in the MAC'd frame, and the
receiver copies the bytes out into private memory first (``OpenedBucket.read_into``: pread on the
CPU, so a truncated segment is a short read, never a SIGBUS) and checks the tag on that copy.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import struct
from multiprocessing import shared_memory

import torch

from .channel import chunk_digests
from .errors import SyncError

_SHM_NAME = re.compile(r"^bitmatch_[0-9a-f]{16}$")

P = (1 << 31) - 1   # the Mersenne prime of the universal hash
ROW, GROUP, LANES = 64, 4096, 4
PIECE = 32 << 20    # bytes hashed at a time: bounds the temporaries (4x the piece, as float64)


class BucketAuth:
    """A MAC over a bucket's bytes with the session key, computed where the bytes are.

    On the CPU: HMAC-SHA256 over SHA-256 chunk digests (the TCP payload MAC). On a GPU: two
    levels of a keyed universal hash, then HMAC-SHA256. The bytes are read as int16 halfwords h
    in rows of 64; level 1 takes y = sum_i k1_i h_i per row and lane, level 2 takes
    z = sum_j k2_j y_j mod p over groups of 4096 rows (p = 2^31 - 1), and the host HMACs the z's
    (4 lanes x 8 bytes per 512 KiB) with the session key, the frame's label and the length.
    Keys: SHAKE-256 of the session key, so unknown to whoever can write the bucket. For fixed
    other bytes each level collides with probability 1/p per lane, so a forgery passes with
    probability <= (2/p)^4 ~ 2^-120 (the bound of an epsilon-universal hash under a PRF, as in
    UMAC). Why not SHA over the bytes: on a GPU that is a copy to the host and a hash on a few
    cores, several times the cost of the IPC update itself; this is a float64 matmul (exact:
    |h k1| < 2^46, 64 terms < 2^53) and a few int64 passes, at memory speed on the device.
    """

    def __init__(self, key: bytes):
        self.key = key
        raw = hashlib.shake_256(b"bitmatch bucket auth" + key).digest(8 * LANES * (ROW + GROUP))
        k = torch.frombuffer(bytearray(raw), dtype=torch.int64).remainder(P)
        self._host = (k[:ROW * LANES].view(ROW, LANES).to(torch.float64), k[ROW * LANES:].view(GROUP, LANES))
        self._keys: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def universal(self, data: torch.Tensor) -> bytes:
        """The two universal-hash levels of ``data`` (any device; the same bytes on every device)."""
        dev = data.device
        if dev not in self._keys:
            self._keys[dev] = tuple(k.to(dev) for k in self._host)
        k1, k2 = self._keys[dev]
        out = []
        for a in range(0, data.numel(), PIECE):
            piece = data[a:a + PIECE]
            pad = (-piece.numel()) % (2 * ROW)  # zeros: the length is in the HMAC
            if pad:
                piece = torch.cat([piece, piece.new_zeros(pad)])
            y = (piece.view(torch.int16).to(torch.float64).view(-1, ROW) @ k1).to(torch.int64).remainder_(P)
            pad = (-y.shape[0]) % GROUP
            if pad:
                y = torch.cat([y, y.new_zeros(pad, LANES)])
            t = y.view(-1, GROUP, LANES) * k2  # < 2^62
            t = (t & P) + (t >> 31)            # = t mod p, up to one p: < 2^32
            out.append(t.sum(1).remainder_(P))
        return b"" if not out else torch.cat(out).cpu().numpy().tobytes()

    def tag(self, data: torch.Tensor, label: bytes) -> str:
        """The MAC (hex) of the flat uint8 ``data`` for the frame named by ``label``. On the CPU the
        bytes are SHA-256'd in chunks on threads (several times faster there than the matmul)."""
        digest = chunk_digests([data.numpy()]) if data.device.type == "cpu" else self.universal(data)
        return hmac.new(self.key, b"bucket" + label + data.device.type.encode() + struct.pack(">Q", data.numel())
                        + digest, hashlib.sha256).hexdigest()


class SharedBucket:
    """The sender's side: ``tensor`` (flat uint8, bucket_bytes) and ``descriptor`` for the peer."""

    def __init__(self, nbytes: int, device: torch.device):
        self.device = torch.device(device)
        self._shm = None
        if self.device.type == "cuda":
            from torch.multiprocessing.reductions import reduce_tensor

            self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            _, args = reduce_tensor(self.tensor)
            (_cls, size, _stride, offset, _scls, _dtype, dev, handle, st_bytes, st_off, _rg, rc_handle, rc_off,
             ev_handle, ev_sync) = args
            self.descriptor = {"kind": "cuda_ipc", "nbytes": nbytes, "device": int(dev), "offset": int(offset),
                               "handle": bytes(handle).hex(), "storage_bytes": int(st_bytes),
                               "storage_offset": int(st_off), "ref_counter": bytes(rc_handle).hex(),
                               "ref_counter_offset": int(rc_off),
                               "event": None if ev_handle is None else bytes(ev_handle).hex(),
                               "event_sync": bool(ev_sync)}
        elif self.device.type == "cpu":
            name = "bitmatch_" + secrets.token_hex(8)
            self._shm = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
            self.tensor = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=nbytes)
            self.descriptor = {"kind": "shm", "nbytes": nbytes, "name": name}
        else:
            raise ValueError(f"shared bucket: device {self.device} is neither cuda nor cpu")

    def ready(self) -> None:
        """Everything written into the bucket is visible to the peer once this returns."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self.tensor = None
        if self._shm is not None:
            self._shm.close()
            self._shm.unlink()
            self._shm = None


def _hex(d: dict, key: str) -> bytes:
    v = d.get(key)
    if not isinstance(v, str) or not re.fullmatch(r"[0-9a-f]*", v):
        raise SyncError(f"shared bucket descriptor: field {key!r} must be a hex string")
    return bytes.fromhex(v)


def _int(d: dict, key: str) -> int:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise SyncError(f"shared bucket descriptor: field {key!r} must be an int >= 0, got {v!r}")
    return v


class OpenedBucket:
    """The receiver's side: the peer's bucket mapped into this process (``tensor``, flat uint8)."""

    def __init__(self, d: dict):
        if not isinstance(d, dict):
            raise SyncError("shared bucket descriptor must be an object")
        kind, self.nbytes = d.get("kind"), _int(d, "nbytes")
        self._fd = None
        if kind == "cuda_ipc":
            if not torch.cuda.is_available():
                raise SyncError("the sender offers a CUDA IPC bucket but this receiver has no CUDA device; "
                                "publish with TcpSender instead")
            from torch.multiprocessing.reductions import rebuild_cuda_tensor

            ev = d.get("event")
            self.tensor = rebuild_cuda_tensor(
                torch.Tensor, (self.nbytes,), (1,), _int(d, "offset"), torch.UntypedStorage, torch.uint8,
                _int(d, "device"), _hex(d, "handle"), _int(d, "storage_bytes"), _int(d, "storage_offset"), False,
                _hex(d, "ref_counter"), _int(d, "ref_counter_offset"), None if ev is None else _hex(d, "event"),
                bool(d.get("event_sync")))
        elif kind == "shm":
            name = d.get("name")
            if not isinstance(name, str) or not _SHM_NAME.match(name):
                raise SyncError(f"shared bucket descriptor: shared-memory name {name!r} is not a bitmatch bucket")
            # read from /dev/shm with pread, never mapped: a segment truncated by another process
            # would kill a reader of the mapping with SIGBUS; pread gives a short read instead.
            # (The sender owns and unlinks the segment; SharedMemory(create=False) would register
            # it with this process's resource tracker, which unlinks it at exit.)
            self.name = name
            try:
                self._fd = os.open(f"/dev/shm/{name}", os.O_RDONLY)
            except FileNotFoundError as e:
                raise SyncError(f"shared bucket {name!r} does not exist on this host (is the sender on "
                                f"another machine? publish with TcpSender there)") from e
            if self.nbytes == 0:
                self.close()
                raise SyncError(f"shared bucket {name!r}: the descriptor says 0 bytes")
            try:
                self._check_size()
            except SyncError:
                self.close()
                raise
            self.tensor = None
        else:
            raise SyncError(f"shared bucket descriptor: unknown kind {kind!r} (expected 'cuda_ipc' or 'shm')")

    def _check_size(self) -> None:
        size = os.fstat(self._fd).st_size
        if size < self.nbytes:
            raise SyncError(f"shared bucket {self.name!r} holds {size} bytes, the sender's descriptor says "
                            f"{self.nbytes}: it was truncated by another process; the update is aborted and the "
                            "previous version kept")

    def read_into(self, dst: torch.Tensor, pos: int) -> None:
        """Copy bytes [pos, pos + dst.numel()) of the bucket into ``dst`` (flat uint8; on the CPU for a
        shared-memory bucket): a short segment raises SyncError."""
        n = dst.numel()
        if pos + n > self.nbytes:
            raise SyncError(f"bucket frame refers to bytes [{pos}, {pos + n}) of a shared bucket of {self.nbytes}")
        if self._fd is None:
            dst.copy_(self.tensor[pos:pos + n])
            return
        self._check_size()
        mv, got = memoryview(dst.numpy()), 0
        while got < n:
            k = os.preadv(self._fd, [mv[got:]], pos + got)
            if k == 0:
                raise SyncError(f"shared bucket {self.name!r} ended at byte {pos + got}, the sender's descriptor "
                                f"says {self.nbytes}: it was truncated by another process; the update is aborted "
                                "and the previous version kept")
            got += k

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self._fd is not None else self.tensor.device

    def close(self) -> None:
        self.tensor = None
        if self._fd is not None:
            os.close(self._fd)  # the segment stays the sender's
            self._fd = None
