"""Fingerprints of the exact bytes of a weight in the rollout dtype, and the manifest of a version.

xxh3-128 over the raw bytes (row-major, contiguous): two tensors share a fingerprint exactly
when their bytes are equal (up to hash collisions at 2^-128), so a fingerprint match proves the
rollout holds the trainer's bits, not just close values. Because the hash is streamed over
bytes, the fingerprint of a row block of a merged engine tensor (vLLM's qkv_proj) equals the
fingerprint of the HF tensor it came from.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
import xxhash

_HASH_CHUNK = 64 << 20  # bytes hashed per step for device tensors: bounds the host copy


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 tensor sharing its memory."""
    if not t.is_contiguous():
        raise ValueError("byte_view: tensor must be contiguous")
    return t.detach().reshape(-1).view(torch.uint8)


def new_hasher():
    return xxhash.xxh3_128()


def update_hasher(h, t: torch.Tensor) -> None:
    """Feed the bytes of ``t`` (any device) into the streaming hash ``h``."""
    b = byte_view(t.contiguous())
    if b.device.type == "cpu":
        h.update(memoryview(b.numpy()))
        return
    for a in range(0, b.numel(), _HASH_CHUNK):
        h.update(memoryview(b[a:a + _HASH_CHUNK].cpu().numpy()))


def fingerprint(t: torch.Tensor) -> str:
    """xxh3-128 hex digest of the exact bytes of ``t`` (its own dtype, row-major order)."""
    h = new_hasher()
    update_hasher(h, t)
    return h.hexdigest()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    fingerprint: str | None = None

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "dtype": dtype_name(self.dtype), "fingerprint": self.fingerprint}

    @staticmethod
    def from_json(d: dict) -> "TensorSpec":
        return TensorSpec(tuple(int(s) for s in d["shape"]), dtype_from_name(d["dtype"]), d.get("fingerprint"))


@dataclass
class Manifest:
    """One weight version: its number and, per HF parameter name, shape, dtype and fingerprint."""
    version: int
    tensors: dict[str, TensorSpec] = field(default_factory=dict)
    # the sender's canonical-order stamp (bitmatch.kernels.order); checked when the update begins,
    # kept as metadata (not part of the digest, which covers the tensors)
    order: dict | None = None

    def digest(self) -> str:
        """Fingerprint of the whole version (names, shapes, dtypes, per-tensor fingerprints)."""
        body = json.dumps({k: self.tensors[k].to_json() for k in sorted(self.tensors)}, sort_keys=True)
        return xxhash.xxh3_128(f"{self.version}\n{body}".encode()).hexdigest()

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.tensors.values())

    def to_json(self) -> dict:
        return {"version": self.version, "tensors": {k: v.to_json() for k, v in self.tensors.items()},
                "order": self.order}

    @staticmethod
    def from_json(d: dict) -> "Manifest":
        return Manifest(int(d["version"]), {k: TensorSpec.from_json(v) for k, v in d["tensors"].items()},
                        d.get("order"))
