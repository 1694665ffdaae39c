"""Fused projections: q/k/v and gate/up as one GEMM each, on a concatenated copy of the HF weights.

Inference only (no autograd recording); the HF weights stay the source of truth.
kernels.linear(segments=) gives each segment the bits of its own linear, so fusing changes no bit.
The copy is keyed on the weights' data_ptr (a replaced tensor: new copy) and _version (an in-place
update, an optimizer step or a weight sync: recomputed in place, so a captured CUDA graph reading it
stays valid). It lives in the parent module's ModelState (``derived``), so it goes with the module.

A PEFT LoRA layer joins a fused copy in the engine's kept-weights steps: its part is the cast
merged weight (lora.fused_part: the bits of its kept rollout weight), keyed on W, A, B, the live
adapters, their scalings and the base bias (lora.fused_key). The fused copy then IS the kept
weight (not a second copy), and the LoRA model's projections run as the merged model's do.
"""
from __future__ import annotations

import torch

import bitmatch.kernels as K
from bitmatch.models import fp8_mode, lora
from bitmatch.models.primitives import linear
from bitmatch.models.state import create_state, get_state
from bitmatch.precision import cast_param


def _part(m, dtype):
    if lora.is_lora_layer(m):
        return lora.fused_part(m, dtype)
    return cast_param(m.weight, dtype), getattr(m, "bias", None)


def _part_key(m):
    if lora.is_lora_layer(m):
        return lora.fused_key(m)
    b = getattr(m, "bias", None)
    return (m.weight.data_ptr(), m.weight._version), None if b is None else (b.data_ptr(), b._version)


class _FusedEntry:
    __slots__ = ("mods", "dtype", "key", "weight", "bias", "segments")

    def versions(self):
        return tuple(_part_key(m) for m in self.mods)

    def build(self, out=None):
        parts = [_part(m, self.dtype) for m in self.mods]
        ws = [w for w, _ in parts]
        shape = (sum(w.shape[0] for w in ws), ws[0].shape[1])
        # in place while the shape holds: a captured graph reads this address
        self.weight = torch.cat(ws, 0, out=out) if out is not None and out.shape == shape else torch.cat(ws, 0)
        bs = [b for _, b in parts]
        self.bias = None if bs[0] is None else torch.cat([cast_param(b, self.dtype) for b in bs], 0)
        self.key = self.versions()

    def refresh(self, force: bool = False, key=None):
        if (self.versions() if key is None else key) == self.key and not force:
            return
        self.build(out=self.weight)


def fused_weight(parent, name: str, mods, dtype):
    """(weight, bias, segments) of ``mods`` fused, or None when fusing does not apply (autograd
    records: the trainer keeps its separate parameters; PEFT layers outside the engine's
    kept-weights steps or that the LoRA linear cannot run; mixed bias)."""
    # (inference mode, e.g. inside vLLM: its tensors carry no _version to key the copy on)
    if torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        return None
    if fp8_mode.active():  # FP8 mode quantizes each projection on its own: no fused copy
        return None
    for m in mods:  # LoRA layers only where the engine reads kept weights; other PEFT layers never
        if lora.is_lora_layer(m):
            if not lora.fusable(m):
                return None
        elif hasattr(m, "base_layer") or hasattr(m, "lora_A"):
            return None
    key = tuple(_part_key(m) for m in mods)
    if len({k[1] is None for k in key}) != 1:  # mixed bias
        return None
    per = create_state(parent).derived
    e = per.get(name)
    if e is None or e.dtype != dtype or any(a is not b for a, b in zip(e.mods, mods)):
        e = _FusedEntry()
        e.mods, e.dtype = tuple(mods), dtype
        e.segments = tuple(m.weight.shape[0] for m in mods)
        e.build()
        per[name] = e
    else:
        e.refresh(key=key)
    return e.weight, e.bias, e.segments


def refresh_fused(lm, force: bool = False) -> None:
    """Bring every fused copy of ``lm``'s layers up to date in place (before a CUDA graph replay,
    which runs no host code). ``force``: rebuild even where the version counters did not move (a
    write through ``param.data`` bumps no counter; the engine forces a rebuild whenever it starts
    work after being idle, so such a write between generate() calls is seen)."""
    for layer in lm.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for e in fused_copies(parent).values():
                e.refresh(force)


def fused_copies(parent) -> dict:
    """``{name: fused copy}`` the engine derived from ``parent``'s projections (empty if none)."""
    st = get_state(parent)
    return {} if st is None else st.derived


def fused_linear(parent, name, mods, x, dtype, fuse: bool = True):
    """The outputs of ``linear(m, x)`` for each of ``mods``: one GEMM when fusable, same bits."""
    f = fused_weight(parent, name, mods, dtype) if fuse else None
    if f is None:
        return [linear(m, x, dtype) for m in mods]
    w, b, segs = f
    y = K.linear(x, w, b, segments=segs)
    return list(torch.split(y, segs, dim=-1))
