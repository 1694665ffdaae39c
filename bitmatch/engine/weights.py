"""The engine's side of the model's weights: the receiver's hold per step, what a step read, the copies
derived on the model.

Under a ``bitmatch.sync`` receiver the engine steps only on a verified version, holding the receiver's
lock for the step (no switch inside it), and stamps each request with the version and the manifest's
digest. ``weight_versions`` snapshots the parameters' version counters when the engine starts sampling,
so a write between sampling and scoring is named. The last engine over a model to close drops the copies
the engines derived on it (fused projections, kept casts).
"""
from __future__ import annotations

import contextlib
import weakref

from bitmatch.models.lora import drop_kept_weights
from bitmatch.sync import WeightsNotReadyError


def weight_versions(model) -> dict:
    """name -> (data_ptr, version counter) of every parameter and buffer of ``model``: which tensors
    a step read and how often each was written in place, without reading a weight (microseconds a
    tensor). ``Engine.weights_written_since_sampling`` compares it with the snapshot taken when the
    engine started sampling. A write through ``.data`` bumps no counter and is not seen."""
    out = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        try:
            out[name] = (t.data_ptr(), t._version)
        except RuntimeError:   # an inference-mode tensor keeps no version counter
            out[name] = (t.data_ptr(), None)
    return out


def written_since(before: dict | None, model) -> list[str]:
    """The parameters and buffers of ``model`` written in place or replaced since the snapshot
    ``before`` (``weight_versions``; None: no snapshot, nothing written)."""
    if before is None:
        return []
    now = weight_versions(model)
    return [n for n in now if now[n] != before.get(n)] + [n for n in before if n not in now]


# causal LM -> how many engines over it are open (weak: the count goes with the model)
_OPEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def engine_opened(engine, lm) -> weakref.finalize:
    """Count ``engine`` open over ``lm``; the finalizer returned counts it closed (called by
    ``close()``, or when the engine is dropped unclosed)."""
    _OPEN[lm] = _OPEN.get(lm, 0) + 1
    return weakref.finalize(engine, _engine_gone, weakref.ref(lm))


def _engine_gone(lm_ref) -> None:
    """An engine over ``lm_ref()`` closed (or died unclosed: its finalizer): the last one drops the
    copies the engines derived on the model (fused weights, kept casts); the next engine rebuilds them."""
    lm = lm_ref()
    if lm is None:
        return
    n = _OPEN.get(lm, 1) - 1
    if n > 0:
        _OPEN[lm] = n
        return
    _OPEN.pop(lm, None)
    drop_kept_weights(lm)


class ManifestDigest:
    """The digest of the manifest last stepped with, computed once per manifest (``Manifest.digest``
    hashes every spec)."""

    def __init__(self):
        self.manifest, self.digest = None, None

    def of(self, man) -> str | None:
        if man is None:
            return None
        if self.manifest is not man:
            self.manifest, self.digest = man, man.digest()
        return self.digest


@contextlib.contextmanager
def holding_weights(st, quantization: str | None, digests: ManifestDigest):
    """One step's hold on the weights of receiver state ``st`` (a ``WeightState``; None: no receiver):
    its lock (no switch inside the step) and (version, fingerprint) of the verified weights, or
    WeightsNotReadyError naming the fix; (None, None) for a model no receiver manages."""
    if st is None:
        yield None, None
        return
    if st.quantization != quantization:
        raise ValueError(f"Engine: runs quantization={quantization!r} but the bitmatch.sync receiver managing "
                         f"its model was made for quantization={st.quantization!r}: the trainer's and the "
                         "engine's bits would differ. Give both the same (receive(model, quantization=...), "
                         "EngineConfig(quantization=...); docs/fp8.md)")
    with st.lock:
        try:
            version = st.require_ready()
        except WeightsNotReadyError as e:
            if st.updating is not None:
                fix = ("a weight update is being staged right now: publish between generate() calls, not "
                       "during one (or wait for the publish to return)")
            elif st.failure is not None:
                fix = "publish a full version again (bitmatch.sync.publish(trainer_model, version, to=receiver))"
            else:
                fix = ("the engine's model is managed by a bitmatch.sync receiver: publish a version first "
                       "(bitmatch.sync.publish(trainer_model, version, to=receiver)), or create the receiver "
                       "with initial_version=N to accept the weights already loaded")
            raise WeightsNotReadyError(f"Engine: {e}. Fix: {fix}") from None
        yield version, digests.of(st.manifest)
