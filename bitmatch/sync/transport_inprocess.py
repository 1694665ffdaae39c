"""In-process transport: the embedded engine in the trainer's process.

When the engine shares the trainer's tensors (compute dtype already, same storage) nothing is
copied: the receiver only fingerprints its own tensors against the announced ones. Otherwise
each tensor is moved to the rollout's device, cast there, fingerprinted there and copied into the
receiver's staging (on that device), then verified and switched by one device copy: on a shared
GPU no byte leaves the device. Tensors whose fingerprint equals the live version's are not
copied at all (only what changed is published: the merged LoRA layers, the trained weights).
"""
from __future__ import annotations

import torch

from ..precision import compute_cast
from .fingerprint import Manifest, TensorSpec, byte_view, fingerprint
from .receiver import Receiver
from .source import dtype_for, named_weights, sender_order, wire_specs


class InProcessSender:
    """Publish into a Receiver living in this process. ``incremental``: a tensor whose cast bytes
    have the fingerprint the live version already holds is not copied (frozen weights, LoRA's
    base layers); the receiver re-fingerprints those live tensors at commit."""

    def __init__(self, receiver: Receiver, incremental: bool = True):
        self.receiver = receiver
        self.incremental = incremental

    def _write(self, name: str, dst: torch.Tensor, src_bytes: torch.Tensor) -> None:
        dst.copy_(src_bytes)

    def send(self, model, version: int, dtype=torch.bfloat16, quantization: str | None = None) -> Manifest:
        """``dtype``: the rollout dtype of every tensor, or a {name: dtype} map (a rollout copy that
        stores each parameter in its own dtype); each tensor goes through ``compute_cast`` into its
        own dtype, and the receiver checks every spec's dtype against its target's. ``quantization``:
        the trainer's mode, which must be the receiver's (the engine re-quantizes the cast weights)."""
        weights = named_weights(model)
        rx = self.receiver
        specs = wire_specs(weights, dtype)
        with rx.begin(version, specs, order=sender_order(weights), quantization=quantization) as upd:
            for name, t in weights:
                live = rx.slots.view(rx.slots.live, name)
                d = dtype_for(dtype, name)
                # the cast runs on the rollout's device: no host round trip when both share a GPU
                cast = compute_cast(t.to(live.device, non_blocking=True), d)
                fp = fingerprint(cast)
                specs[name] = TensorSpec(specs[name].shape, d, fp)
                if cast.data_ptr() == live.data_ptr() and cast.shape == live.shape:
                    upd.share(name, cast, fp)
                elif self.incremental and upd.base is not None and name in upd.base.tensors \
                        and upd.base.tensors[name].fingerprint == fp:
                    upd.keep(name, fp)  # unchanged since the live version (a frozen base weight)
                else:
                    self._write(name, upd.buffer(name), byte_view(cast.contiguous()))
                    upd.finish(name, fp)
                del cast
            return upd.commit(Manifest(version, specs, quantization=quantization).digest())
