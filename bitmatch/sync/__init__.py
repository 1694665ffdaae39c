"""bitmatch.sync: prove the rollout engine holds the trainer's exact bits before it samples.

Protocol, in a few lines:
1. The trainer publishes a numbered version: every parameter goes through the one cast
   (``bitmatch.precision.compute_cast``) into the rollout dtype, and travels with the bmh1
   fingerprint of its exact bytes (``hash.py``: computed on the tensor's own device, a Triton
   kernel on the GPU; it catches accidents, the TCP transport's MAC catches tampering).
2. The receiver stages the whole version, recomputes every fingerprint on what it holds, and
   only then switches (atomically, under the lock generation holds). Any failure (a flipped bit,
   a dead sender, a wrong shape) leaves the previous version live, names the tensor with expected
   and got fingerprints, and refuses generation until a full update succeeds.
3. Rollouts carry the weight version they were sampled with; the trainer checks it
   (``check_weight_version``) and catches the off-by-one-step bug.
Transports: in-process (shared tensors: fingerprint check only; otherwise cast and checked on the
rollout's device), TCP (loopback, shared-token HMAC auth, bucketed so memory stays bounded), IPC
(another process on this node: TCP control channel, bytes through a shared CUDA IPC / shared-memory
bucket). vLLM colocate (load_weights) is the vLLM adapter's transport,
``bitmatch.adapters.vllm.VllmColocateSender``: this package names no adapter, and any object with
``send(model, version, dtype)`` is a sender.
"""
from __future__ import annotations

import numbers
from collections.abc import Mapping

import numpy as np
import torch

from .fingerprint import HASH_NAME, Manifest, TensorSpec, fingerprint, fingerprints_of
from .names import Layout, architecture_of, build_layout, layout_rules
from .publishing import publish
from .receiver import (
    AuthenticationError,
    CanonicalOrderError,
    FingerprintMismatchError,
    Receiver,
    SyncError,
    Update,
    WeightsNotReadyError,
    WeightState,
    WeightVersionError,
    require_ready,
    weight_state,
)
from .rollout_copy import RolloutCopy, storage_dtypes
from .source import DEFAULT_BUCKET_BYTES, cast_fingerprint, named_weights
from .transport_inprocess import InProcessSender
from .transport_ipc import IpcSender
from .transport_tcp import TcpReceiverServer, TcpSender
from .version import check_version

__all__ = [
    "publish", "receive", "serve", "verify", "fingerprints", "fingerprint", "check_weight_version",
    "stamp_weight_version", "require_ready", "HASH_NAME", "weight_state", "Manifest", "TensorSpec", "Receiver",
    "Update", "WeightState", "InProcessSender", "TcpSender", "IpcSender", "fingerprints_of", "TcpReceiverServer",
    "SyncError", "FingerprintMismatchError", "WeightsNotReadyError", "WeightVersionError",
    "AuthenticationError", "CanonicalOrderError", "build_layout", "Layout", "layout_rules", "DEFAULT_BUCKET_BYTES",
    "RolloutCopy", "storage_dtypes",
]


def receive(target, *, layout: str = "hf", arch: str | None = None, staging: str = "shadow",
            initial_version: int | None = None, verify_every: int = 0, allow_older_versions: bool = False,
            quantization: str | None = None) -> Receiver:
    """A Receiver managing ``target``'s weights (see Receiver); attaches its WeightState to the
    module so ``require_ready(model)`` finds it. Generation is refused until a version is verified,
    and after any write to the live weights outside ``publish`` (version counters every step, a
    full fingerprint pass every ``verify_every`` steps). Versions must increase. ``quantization``
    ("fp8"): the engine over ``target`` runs FP8 mode; updates must announce it (docs/fp8.md)."""
    return Receiver(target, layout=layout, arch=arch, staging=staging, initial_version=initial_version,
                    verify_every=verify_every, allow_older_versions=allow_older_versions, quantization=quantization)


def serve(receiver: Receiver, token, host: str = "127.0.0.1", port: int = 0,
          timeout: float = 60.0, auth_timeout: float = 5.0, *, name: str = "",
          max_pending: int = 32) -> TcpReceiverServer:
    """Accept TCP updates for ``receiver`` (a thread per connection); ``.address`` is (host, port).
    ``token`` (str or bytes) is the shared secret; ``name`` the receiver's name, which a sender
    must give (``TcpSender(..., receiver=name)``): name each receiver that shares a token. A
    connection that has not authenticated within ``auth_timeout`` seconds is dropped, at most
    ``max_pending`` may be in their handshake at once, and each frame has ``timeout`` seconds."""
    return TcpReceiverServer(receiver, token, host=host, port=port, timeout=timeout, auth_timeout=auth_timeout,
                             name=name, max_pending=max_pending)


def fingerprints(model, dtype: torch.dtype = torch.bfloat16) -> dict[str, str]:
    """Per-tensor fingerprint of compute_cast(w, dtype), without materializing the cast model."""
    return {k: cast_fingerprint(v, dtype) for k, v in named_weights(model)}


def verify(target, manifest: Manifest, *, layout: str = "hf", arch: str | None = None) -> None:
    """Recompute every fingerprint on ``target``'s own bytes (HF names, or vLLM's merged layout)
    and raise FingerprintMismatchError naming the first differing tensor (ValueError if the name
    sets or shapes differ). A Receiver / managed model is also checked for manifest.version."""
    # the version only: the fingerprints below name any tensor that changed
    if isinstance(target, Receiver):
        target.state.require_ready(manifest.version, check_live=False)
        target = target.target
    else:
        st = weight_state(target)
        if st is not None:
            st.require_ready(manifest.version, check_live=False)
    params = dict(named_weights(target))
    if layout == "vllm":
        lay = build_layout(arch or architecture_of(target), {k: s.shape for k, s in manifest.tensors.items()},
                           {k: tuple(v.shape) for k, v in params.items()})
        views = {hf: params[s.engine_name][s.row_start:s.row_start + s.rows] for hf, s in lay.hf_to_engine.items()}
    elif layout == "hf":
        missing, extra = sorted(set(manifest.tensors) - set(params)), sorted(set(params) - set(manifest.tensors))
        if missing or extra:
            raise ValueError(f"verify: manifest and target differ: missing {missing[:8]}, unknown {extra[:8]}")
        views = params
    else:
        raise ValueError(f"layout must be 'hf' or 'vllm', got {layout!r}")
    for name, spec in manifest.tensors.items():
        v = views[name]
        if tuple(v.shape) != tuple(spec.shape) or v.dtype != spec.dtype:
            raise ValueError(f"verify: tensor {name!r} is {tuple(v.shape)} {v.dtype}, manifest says "
                             f"{tuple(spec.shape)} {spec.dtype}")
    names = list(manifest.tensors)
    # every fingerprint on the tensors' own device, one host sync for the whole model
    for name, got in zip(names, fingerprints_of(views[n] for n in names)):
        if got != manifest.tensors[name].fingerprint:
            raise FingerprintMismatchError(name, manifest.tensors[name].fingerprint, got,
                                           f" (version {manifest.version})")


def _version_of(r):
    if isinstance(r, numbers.Integral):
        return r
    if isinstance(r, Mapping):
        return r.get("weight_version")
    return getattr(r, "weight_version", None)


def stamp_weight_version(outputs, version: int):
    """Set ``weight_version`` on each rollout output (objects or dicts); returns ``outputs``."""
    version = check_version(version, "stamp_weight_version")
    for o in outputs:
        if isinstance(o, dict):
            o["weight_version"] = version
        else:
            try:
                setattr(o, "weight_version", version)
            except AttributeError as e:  # a slotted class without the field
                raise TypeError(f"{type(o).__name__} has no weight_version field to stamp; declare "
                                f"`weight_version: int | None = None` on it or stamp dict rollouts") from e
    return outputs


def check_weight_version(rollouts, expected: int) -> None:
    """Trainer side: every rollout (an int, a dict or object with ``weight_version``, or a list of
    them) must have been sampled with weight version ``expected``; raises WeightVersionError, also
    for no rollouts at all (an empty batch proves nothing on-policy)."""
    expected = check_version(expected, "check_weight_version", "expected")
    items = rollouts if isinstance(rollouts, (list, tuple)) else [rollouts]
    if not items:
        raise WeightVersionError("check_weight_version: no rollouts to check, so none is proven on-policy; pass the "
                                 "step's rollouts (RequestOutputs, dicts or versions), not an empty list")
    for i, r in enumerate(items):
        v = _version_of(r)
        if v is None:
            raise WeightVersionError(f"rollout {i} carries no weight version; cannot prove it is on-policy")
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral):
            raise WeightVersionError(f"rollout {i} carries weight version {v!r} ({type(v).__name__}), not an int; "
                                     "stamp rollouts with the engine's version (bitmatch.sync.stamp_weight_version)")
        if v != expected:
            hint = " (one step stale: the update did not reach the engine)" if v == expected - 1 else ""
            raise WeightVersionError(f"rollout {i} was sampled with weight version {v}, "
                                     f"trainer expects {expected}{hint}")
