"""One weight version being staged: transports write or share each tensor, then ``commit`` switches.

Every tensor's bytes are fingerprinted where they are staged (``finish``), shared (``share``) or kept
(``keep``, re-checked at commit); ``commit`` copies the staging into the live weights under the lock
generation holds and seals the live version counters; any failure aborts and keeps the previous version.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .errors import FingerprintMismatchError, SyncError, WeightVersionError
from .fingerprint import Manifest, TensorSpec, byte_view, fingerprint, fingerprints_of

if TYPE_CHECKING:  # annotations only: receiver.py imports this module
    from .receiver import Receiver


class Update:
    """One version being staged. Transports write bytes into ``buffer(name)``, then call
    ``finish(name, fingerprint)``; ``commit()`` switches; any exception inside ``with`` aborts."""

    def __init__(self, rx: Receiver, version: int, specs: dict[str, TensorSpec]):
        self.rx, self.version, self.specs = rx, version, specs
        self.bank: dict[str, torch.Tensor] = {} if rx.staging == "shadow" else rx.standby
        self.done: dict[str, str] = {}
        self.shared: set[str] = set()
        self.kept: set[str] = set()  # unchanged since the live version: no bytes, checked at commit
        self.checked: dict[str, int] = {}  # engine tensor -> its version counter before its live bytes were checked
        self.base = rx.state.manifest if rx.state.failure is None else None
        self.received_bytes = 0
        self.closed = False
        self.order: dict | None = None  # the sender's canonical-order stamp, checked by Receiver.begin

    def __enter__(self):
        return self

    def __exit__(self, et, ev, tb):
        if not self.closed:
            self.abort(f"update to version {self.version} failed: {ev!r}" if ev is not None
                       else f"update to version {self.version} ended without commit")
        return False

    def buffer(self, name: str) -> torch.Tensor:
        """The staging bytes for ``name`` (flat uint8, contiguous): write the new bytes here. Refused
        once ``name`` is finished."""
        return byte_view(self._staged(self._open(name)))

    def finish(self, name: str, expected: str) -> None:
        """Recompute the staged tensor's fingerprint; a mismatch aborts the whole update. The tensor
        is then sealed: any later ``buffer``, ``finish``, ``share`` or ``keep`` of it aborts."""
        got = fingerprint(self._staged(self._open(name)))  # allocates the slot if no byte arrived (zero-size)
        self._check(name, expected, got, " (staged bytes)")
        self.done[name] = got

    def share(self, name: str, tensor: torch.Tensor, expected: str) -> None:
        """Zero-copy: ``tensor`` is the target's own live tensor; only its fingerprint is checked."""
        sl = self.rx.slots
        live = sl.view(sl.live, self._open(name))
        if tensor.data_ptr() != live.data_ptr() or tuple(tensor.shape) != tuple(live.shape):
            raise ValueError(f"tensor {name!r} is not the target's own tensor; it cannot be shared")
        self._mark(sl.key(name))
        self._check(name, expected, fingerprint(live), " (shared tensor)")
        self.done[name] = expected
        self.shared.add(name)

    def keep(self, name: str, expected: str) -> None:
        """The sender's tensor is byte for byte the one the live version already holds (same
        fingerprint): nothing is sent or copied. The live bytes are re-fingerprinted at commit,
        with the rest of the model in one pass, so a live tensor changed since it was verified is
        caught, not carried into the new version."""
        self._open(name)
        spec, base = self.specs[name], self.base
        prev = None if base is None else base.tensors.get(name)
        if prev is None or prev.fingerprint != expected or tuple(prev.shape) != tuple(spec.shape) \
                or prev.dtype != spec.dtype:
            self.abort(f"update to version {self.version}: tensor {name!r} was sent as unchanged, but the live "
                       f"version does not hold it with fingerprint {expected}")
            raise SyncError(self.rx.last_error)
        self.done[name] = expected
        self.kept.add(name)

    def _known(self, name: str) -> str:
        if name not in self.specs:
            self.abort(f"update to version {self.version}: tensor {name!r} was not announced")
            raise ValueError(f"tensor {name!r} was not announced in this update")
        return name

    def _open(self, name: str) -> str:
        """``name``, announced and not finished yet: a finished tensor's bytes were checked, and a later
        write would switch the engine to bytes no one verified."""
        self._known(name)
        if name in self.done:
            self.abort(f"update to version {self.version}: tensor {name!r} was already finished (its bytes "
                       "checked); a later write into it is refused (a sender must send each tensor once)")
            raise SyncError(self.rx.last_error)
        return name

    def _staged(self, name: str) -> torch.Tensor:
        sl = self.rx.slots
        key = sl.key(name)
        if key not in self.bank:
            self.bank[key] = torch.empty_like(sl.live[key])
        return sl.view(self.bank, name)

    def _mark(self, key: str) -> None:
        """Read live tensor ``key``'s version counter before its bytes are checked; the earliest read
        is kept, so a write after any check of it moves the counter away from what is sealed."""
        self.checked.setdefault(key, self.rx.slots.live[key]._version)

    def _check(self, name, expected, got, where):
        if expected != got:
            err = FingerprintMismatchError(name, expected, got, where)
            self.abort(f"update to version {self.version} rejected: {err}")
            raise err

    def manifest(self) -> Manifest:
        return Manifest(self.version, {k: TensorSpec(s.shape, s.dtype, self.done.get(k, s.fingerprint))
                                       for k, s in self.specs.items()}, quantization=self.rx.quantization)

    def commit(self, digest: str | None = None) -> Manifest:
        """All tensors staged and verified: switch the live weights to this version atomically."""
        missing = [k for k in self.specs if k not in self.done]
        if missing:
            self.abort(f"update to version {self.version} incomplete: {len(missing)} tensor(s) never "
                       f"arrived, first {missing[0]!r}")
            raise SyncError(self.rx.last_error)
        man = self.manifest()
        live = self.rx.state.manifest
        if live is not None and self.rx.state.version == self.version and live.digest() != man.digest():
            self.abort(f"update to version {self.version}: that version is live with other weights (digest "
                       f"{live.digest()}, this update {man.digest()}): a version number must name one set of bytes")
            raise WeightVersionError(self.rx.last_error)
        if digest is not None and digest != man.digest():
            self.abort(f"update to version {self.version}: manifest digest {man.digest()} != announced {digest}")
            raise SyncError(self.rx.last_error)
        sl, st = self.rx.slots, self.rx.state
        with st.lock:
            live = sl.live
            if self.kept:  # before anything is written: a stale live tensor aborts with the old version intact
                kept = sorted(self.kept)
                for k in kept:
                    self._mark(sl.key(k))
                for name, got in zip(kept, fingerprints_of(sl.view(live, k) for k in kept)):
                    self._check(name, self.done[name], got, " (the live tensor changed after it was verified; "
                                "publish with InProcessSender(receiver, incremental=False) to rewrite every tensor)")
            # a write after a tensor was checked (a trainer thread writing the shared tensors while it
            # publishes) must not be sealed as verified; refused before anything is written
            moved = next((k for k, c in self.checked.items() if live[k]._version != c), None)
            if moved is not None:
                self.abort(f"update to version {self.version}: live tensor {moved!r} was written after its bytes "
                           "were checked, while the update was running (a trainer thread writing the shared "
                           "weights during publish?); publish again once the writes are done")
                raise SyncError(self.rx.last_error)
            names = [k for k in self.specs if k not in self.shared and k not in self.kept]
            # row block by row block: the rows of a merged engine tensor (vLLM's qkv_proj) whose HF
            # tensor was kept are not in the staging bank and keep their live bytes
            for name in names:
                sl.view(live, name).copy_(sl.view(self.bank, name))
            for key in {sl.key(k) for k in names}:
                self.checked[key] = live[key]._version  # our own copies moved it; verified below
            if self.rx.verify_after_commit:
                for name, got in zip(names, fingerprints_of(sl.view(live, k) for k in names)):
                    if got != self.done[name]:
                        st.version, self.closed = None, True  # live bytes are neither version: unusable
                        self.rx.end_update(self, f"live tensor {name!r} differs from its verified staging copy "
                                                 f"after the switch (expected {self.done[name]}, got {got})")
                        raise FingerprintMismatchError(name, self.done[name], got, " (after switch)")
            man.order = self.order
            st.version, st.manifest, st.failure = self.version, man, None
            self.rx.seal(self.checked)
            self.closed = True
            if self.rx.staging == "shadow":
                self.bank = {}
            self.rx.end_update(self, None)
        return man

    def abort(self, reason: str) -> None:
        """Discard the staging; the previous version stays live and generation is refused."""
        if self.closed:
            return
        self.closed = True
        if self.rx.staging == "shadow":
            self.bank = {}
        prev = self.rx.state.version
        self.rx.end_update(self, f"{reason}; previous version {prev} kept")
