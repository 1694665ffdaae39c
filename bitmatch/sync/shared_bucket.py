"""A bucket of bytes two processes on one node both see: CUDA IPC memory on a GPU, POSIX shared
memory on the CPU. The IPC transport (``transport_ipc.py``) casts weights into it on the sender's
device; the receiver copies them from it into its staging on its own device. Only a descriptor
(plain JSON: numbers and hex strings) crosses the authenticated control channel; the receiver
rebuilds the mapping from it with fixed classes, never by unpickling what the peer sent.
"""
from __future__ import annotations

import mmap
import os
import re
import secrets
from multiprocessing import shared_memory

import torch

from .errors import SyncError

_SHM_NAME = re.compile(r"^bitmatch_[0-9a-f]{16}$")


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
        self._shm = None
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
            # mapped from /dev/shm directly: the sender owns (and unlinks) the segment, and
            # SharedMemory(create=False) would register it with this process's resource
            # tracker, which unlinks it at exit (Python 3.11)
            try:
                with open(f"/dev/shm/{name}", "r+b") as f:
                    size = os.fstat(f.fileno()).st_size
                    if size < self.nbytes or self.nbytes == 0:
                        raise SyncError(f"shared bucket {name!r} holds {size} bytes, descriptor says {self.nbytes}")
                    self._shm = mmap.mmap(f.fileno(), self.nbytes)
            except FileNotFoundError as e:
                raise SyncError(f"shared bucket {name!r} does not exist on this host (is the sender on "
                                f"another machine? publish with TcpSender there)") from e
            self.tensor = torch.frombuffer(self._shm, dtype=torch.uint8, count=self.nbytes)
        else:
            raise SyncError(f"shared bucket descriptor: unknown kind {kind!r} (expected 'cuda_ipc' or 'shm')")

    def close(self) -> None:
        self.tensor = None
        if self._shm is not None:
            self._shm.close()  # the mmap; the segment stays the sender's
            self._shm = None
