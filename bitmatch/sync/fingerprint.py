"""Fingerprints of the exact bytes of a weight in the rollout dtype, and the manifest of a version.

The fingerprint is bmh1 (``hash.py``): a positional hash of the raw bytes (row-major,
contiguous), computed on the tensor's own device (a Triton kernel at memory speed on the GPU,
numpy on the CPU, same digest). Equal bytes give equal fingerprints; a flipped, lost or stale
byte changes it (accidents, not attacks: the transport's MAC covers those). Because the hash
is positional over the tensor's own byte stream, the fingerprint of a row block of a merged
engine tensor (vLLM's qkv_proj) equals the fingerprint of the HF tensor it came from.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
import xxhash

from .errors import SyncError
from .hash import HASH_NAME, StreamHasher, byte_view, fingerprint, fingerprints_of

__all__ = ["HASH_NAME", "StreamHasher", "byte_view", "fingerprint", "fingerprints_of", "dtype_name",
           "dtype_from_name", "TensorSpec", "Manifest", "check_hash_name"]


def check_hash_name(name, where: str) -> None:
    """Refuse fingerprints made by another hash (an older or newer bitmatch on the other end)."""
    if name != HASH_NAME:
        raise SyncError(f"{where}: the peer fingerprints weights with hash {name!r}, this end with "
                        f"{HASH_NAME!r}; run the same bitmatch version on both ends")


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
    """One weight version: its number and, per HF parameter name, shape, dtype and fingerprint
    (by the hash ``hash``, bmh1)."""
    version: int
    tensors: dict[str, TensorSpec] = field(default_factory=dict)
    # the sender's canonical-order stamp (bitmatch.kernels.order); checked when the update begins,
    # kept as metadata (not part of the digest, which covers the tensors)
    order: dict | None = None
    hash: str = HASH_NAME
    # None, or "fp8": the engine runs the projections on FP8 bytes it quantizes from these weights
    # (bitmatch.models.fp8_mode); part of the digest when set, so a version names its mode too
    quantization: str | None = None

    def digest(self) -> str:
        """Fingerprint of the whole version (names, shapes, dtypes, per-tensor fingerprints, and the
        quantization when there is one)."""
        body = json.dumps({k: self.tensors[k].to_json() for k in sorted(self.tensors)}, sort_keys=True)
        mode = "" if self.quantization is None else f"quantization={self.quantization}\n"
        return xxhash.xxh3_128(f"{self.hash}\n{self.version}\n{mode}{body}".encode()).hexdigest()

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.tensors.values())

    def to_json(self) -> dict:
        return {"version": self.version, "hash": self.hash, "quantization": self.quantization,
                "tensors": {k: v.to_json() for k, v in self.tensors.items()}, "order": self.order}

    @staticmethod
    def from_json(d: dict) -> "Manifest":
        check_hash_name(d.get("hash"), f"manifest of version {d.get('version')}")
        return Manifest(int(d["version"]), {k: TensorSpec.from_json(v) for k, v in d["tensors"].items()},
                        d.get("order"), quantization=d.get("quantization"))
