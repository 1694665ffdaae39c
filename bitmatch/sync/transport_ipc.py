"""Cross-process transport on one node: the bytes through a shared bucket, the rest over TCP.

The sender casts each weight on its own device into a bucket the receiver's process also maps
(CUDA IPC memory on a GPU, POSIX shared memory on the CPU: ``shared_bucket.py``), hashes it there,
and tells the receiver over the authenticated TCP control channel (``transport_tcp.py``: the same
server, the same frames, no payload bytes) which tensor bytes the bucket holds, with a MAC of
them under the session key (``shared_bucket.BucketAuth``). The receiver copies them out of the
bucket, checks the MAC on its copy, moves them into its staging on its own device, acknowledges,
and the sender refills the bucket. Another process that can open the bucket can make the update
fail, never change what is staged.
On one GPU no weight byte leaves the device. Everything else (staging, fingerprints, the atomic
switch, the failure rules) is the receiver's, as for every transport.
"""
from __future__ import annotations

import torch

from .channel import raise_reply
from .shared_bucket import BucketAuth, SharedBucket
from .source import iter_buckets
from .transport_tcp import TcpSender

DEFAULT_IPC_BUCKET_BYTES = 256 << 20


class IpcSender(TcpSender):
    """Publish to a TcpReceiverServer (``bitmatch.sync.serve``) in another process on this host
    through a shared bucket of ``bucket_bytes`` on ``device`` (default: the first weight's device)."""

    def __init__(self, host: str, port: int, token, *, receiver: str = "",
                 bucket_bytes: int = DEFAULT_IPC_BUCKET_BYTES, device: str | torch.device | None = None,
                 timeout: float = 60.0):
        super().__init__(host, port, token, receiver=receiver, bucket_bytes=bucket_bytes, timeout=timeout)
        self.device = device
        self._bucket: SharedBucket | None = None
        self._private: torch.Tensor | None = None
        self._auth: BucketAuth | None = None

    def _begin_extra(self, weights) -> dict:
        dev = self.device or (weights[0][1].device if weights else "cpu")
        self._bucket = SharedBucket(self.bucket_bytes - self.bucket_bytes % 4, dev)
        # filled here, tagged here, then copied into the shared bucket: a process that rewrites the
        # shared bucket cannot change what the tag covers
        self._private = torch.empty_like(self._bucket.tensor)
        return {"bucket": self._bucket.descriptor}

    def _buckets(self, weights, dtype):
        return iter_buckets(weights, dtype, self.bucket_bytes, buf=self._private)

    def send(self, model, version: int, dtype: torch.dtype = torch.bfloat16, quantization: str | None = None):
        try:
            return super().send(model, version, dtype, quantization)
        finally:
            if self._bucket is not None:  # the sender owns the bucket: freed (unlinked) after every update
                self._bucket.close()
                self._bucket = self._private = self._auth = None

    def _send_bucket(self, ch, buf, segs, finished) -> None:
        if self._auth is None or self._auth.key != ch.key:
            self._auth = BucketAuth(ch.key)
        mac = self._auth.tag(buf, ch.next_label())
        self._bucket.tensor[:buf.numel()].copy_(buf)
        self._bucket.ready()
        ch.send({"type": "bucket", "segments": segs, "finished": finished, "shared": True, "mac": mac})
        raise_reply(ch.recv())  # copied out: the bucket may be refilled
