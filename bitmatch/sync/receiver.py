"""The receiving side: stage a whole version, verify every fingerprint, then switch atomically.

A generation never sees a half-applied update: transports write into staging buffers (or, for
the in-process zero-copy case, only fingerprint the shared tensors), the receiver recomputes
every fingerprint on the staged bytes, and only a complete, fully verified version is copied
into the live weights, under the lock that generation holds. Any failure discards the staging
and leaves the previous version in place, and generation is refused until a full update
succeeds (the trainer expects the new version; serving the old one silently is the
off-by-one-step bug).
"""
from __future__ import annotations

import contextlib
import threading

import torch

from bitmatch.kernels.order import stamp_for_device
from bitmatch.models.fp8_mode import check_quantization
from bitmatch.models.state import create_state, get_state

from .errors import (  # noqa: F401
    AuthenticationError,
    CanonicalOrderError,
    FingerprintMismatchError,
    SyncError,
    WeightsNotReadyError,
    WeightVersionError,
)
from .fingerprint import Manifest, TensorSpec, byte_view, dtype_name, fingerprint, fingerprints_of
from .names import architecture_of, build_layout
from .version import check_version


class WeightState:
    """Version and readiness of an engine's weights; the engine holds ``generation()`` per step."""

    def __init__(self):
        self.lock = threading.RLock()
        self.version: int | None = None
        self.manifest: Manifest | None = None
        self.updating: int | None = None   # version being staged
        self.failure: str | None = None    # why the last update failed
        self.live_check = None             # the receiver's check that the live bytes are the verified ones
        self.quantization = None           # the receiver's mode: an engine over its target must run the same

    @property
    def ready(self) -> bool:
        return self.version is not None and self.failure is None and self.updating is None

    def require_ready(self, expected_version: int | None = None, check_live: bool = True) -> int:
        """Return the loaded version; raise WeightsNotReadyError / WeightVersionError otherwise
        (``check_live``: also the receiver's check that the live bytes are still the verified ones)."""
        if self.failure is not None:
            held = ("no verified version is loaded" if self.version is None
                    else f"version {self.version} is still loaded")
            raise WeightsNotReadyError(f"refusing to generate: {self.failure}; {held}, waiting for a full "
                                       f"update to succeed")
        if self.updating is not None:
            raise WeightsNotReadyError(f"refusing to generate: update to version {self.updating} in progress")
        if self.version is None:
            raise WeightsNotReadyError("refusing to generate: no verified weight version loaded yet")
        if check_live and self.live_check is not None:
            problem = self.live_check()
            if problem is not None:
                self.failure = problem
                raise WeightsNotReadyError(f"refusing to generate: {problem}; publish a new version (the live "
                                           f"weights are no longer version {self.version})")
        if expected_version is not None and self.version != expected_version:
            raise WeightVersionError(f"engine holds weight version {self.version}, expected {expected_version}")
        return self.version

    @contextlib.contextmanager
    def generation(self, expected_version: int | None = None):
        """Hold the weights for one generation step: no commit can happen inside; yields the version."""
        with self.lock:
            yield self.require_ready(expected_version)


def attach_state(model, state: WeightState) -> None:
    """Make ``state`` the WeightState of ``model`` (kept in its ``ModelState``; a copy of the model
    is no receiver's target, so it does not carry it)."""
    create_state(model).weights = state


def weight_state(model) -> WeightState | None:
    """The WeightState a receiver attached to ``model`` (None for a model no receiver manages)."""
    st = get_state(model)
    return None if st is None else st.weights


def require_ready(model, expected_version: int | None = None) -> int | None:
    """For engines: call before each generation. Returns the weight version to stamp on the outputs
    (None when no receiver manages ``model``); raises WeightsNotReadyError when a managed model has
    no fully verified version (update in progress or failed)."""
    st = weight_state(model)
    return None if st is None else st.require_ready(expected_version)


def _holders(target) -> list[tuple[str, dict, str, torch.Tensor]]:
    """(name, the dict that holds it, its key there, tensor) for every tensor of ``target``, tied
    aliases included: where an offload / reload, ``load_state_dict(assign=True)`` or ``p.data = ...``
    would put another tensor."""
    if isinstance(target, torch.nn.Module):
        return [(f"{mod_name}.{key}" if mod_name else key, mod._parameters, key, p)
                for mod_name, mod in target.named_modules(remove_duplicate=False)
                for key, p in mod._parameters.items() if p is not None]
    return [(k, target, k, v) for k, v in target.items()]


class _Slots:
    """HF name -> tensor view inside a bank of the target's own tensors (HF or engine layout)."""

    def __init__(self, target, layout: str, arch: str | None):
        if layout not in ("hf", "vllm"):
            raise ValueError(f"layout must be 'hf' or 'vllm', got {layout!r}")
        self.target = target
        self.layout = layout
        self.arch = arch or architecture_of(target)
        self.map = None  # vllm: HF name -> Slot, built in bind() from the announced HF shapes
        self.names = None
        self.read()

    def read(self) -> None:
        """Bind to the tensors the target holds now."""
        # detach(), not .data: a detached view shares the parameter's version counter, so a commit
        # bumps p._version and whatever the engine derived from the weight (fused q/k/v, gate/up
        # copies) sees the update; a write through .data would be invisible to it
        t = self.target
        if isinstance(t, torch.nn.Module):
            self.live = {k: p.detach() for k, p in t.named_parameters()}
        else:
            self.live = {k: (v.detach() if isinstance(v, torch.nn.Parameter) else v) for k, v in t.items()}
        # self.live keeps the bound storage alive, so a replacement can never reuse its address
        self.held = [(name, d, key, v, v.data_ptr(), v.shape) for name, d, key, v in _holders(t)]
        if self.layout == "hf":
            self.names = list(self.live)

    def replaced(self) -> list[str]:
        """Names (tied aliases too) whose tensor the target no longer holds: the engine computes with
        another tensor than the one this receiver writes and checks. Identity, address and shape only:
        cheap enough for every step (under a millisecond for an 8B model's ~400 tensors)."""
        return [name for name, d, key, v, ptr, shape in self.held
                if d.get(key) is not v or v.data_ptr() != ptr or v.shape != shape]

    def bind(self, specs: dict[str, TensorSpec]) -> None:
        if self.layout == "vllm":
            lay = build_layout(self.arch, {k: s.shape for k, s in specs.items()},
                               {k: tuple(v.shape) for k, v in self.live.items()})
            self.map = lay.hf_to_engine
            self.names = list(self.map)

    def key(self, name: str) -> str:
        return name if self.map is None else self.map[name].engine_name

    def hf_names(self, key: str) -> list[str]:
        """The HF names whose rows live in engine tensor ``key`` (``key`` itself in the HF layout)."""
        return [key] if self.map is None else [n for n, s in self.map.items() if s.engine_name == key]

    def view(self, bank: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        if self.map is None:
            return bank[name]
        s = self.map[name]
        return bank[s.engine_name][s.row_start:s.row_start + s.rows]


class Receiver:
    """Receives weight versions into ``target`` (an nn.Module or dict of tensors).

    layout: "hf" (target holds HF names: the embedded engine) or "vllm" (target holds vLLM's merged
    names; mapped with names.py). staging: "shadow" (allocate a full staging copy per update, freed
    after) or "double_buffer" (one standby copy allocated now, so an update needs only the
    transport's bucket as extra memory). initial_version: accept the weights already loaded as
    this version (fingerprinted now); otherwise generation is refused until the first update.

    The weights a step runs with are the verified ones: every ``require_ready`` (the engine calls
    it per step) compares the live tensors' version counters with those recorded at the commit, so
    an in-place write outside ``publish`` (an optimizer step on shared tensors, a stray ``mul_``)
    makes the next step raise, naming the tensor; writes that bypass the counters (``.data``, a
    kernel through a raw pointer) are caught by a full fingerprint pass every ``verify_every``
    steps (0: never; on the GPU it costs a few ms for an 8B model). A tensor the target no longer
    holds (an offload / reload, ``load_state_dict(assign=True)``, ``p.data = ...``) is noticed at
    the next step or update: adopted if it holds the verified bytes, refused by name otherwise.
    Versions must increase: an older one is refused (``allow_older_versions=True`` to roll back on
    purpose) and the live version number with other bytes is refused at commit. Every update
    carries the sender's canonical-order stamp, which must equal the receiver's field by field.
    ``quantization`` (None or "fp8"): the mode the engine over ``target`` runs in; every update must
    announce the same one (a bf16 sender and an FP8 receiver, or the reverse, are refused by name) and
    the manifest records it. FP8 weights travel in the compute dtype: the engine re-quantizes them
    with ``quantize_fp8_blocks``, the function the trainer's FP8 forward calls (docs/fp8.md).
    """

    def __init__(self, target, *, layout: str = "hf", arch: str | None = None, staging: str = "shadow",
                 initial_version: int | None = None, verify_after_commit: bool = True, verify_every: int = 0,
                 allow_older_versions: bool = False, quantization: str | None = None):
        if isinstance(verify_every, bool) or not isinstance(verify_every, int) or verify_every < 0:
            raise ValueError(f"verify_every must be an int >= 0 (steps between full fingerprint checks), "
                             f"got {verify_every!r}")
        if staging not in ("shadow", "double_buffer"):
            raise ValueError(f"staging must be 'shadow' or 'double_buffer', got {staging!r}")
        self.target = target
        self.slots = _Slots(target, layout, arch)
        self.staging = staging
        self.verify_after_commit = verify_after_commit
        self.verify_every, self.allow_older_versions = verify_every, bool(allow_older_versions)
        self._counters: dict[str, int] = {}
        self._steps = 0
        self.state = WeightState()
        self.state.live_check = self._check_live
        self.state.quantization = self.quantization = check_quantization(quantization, "Receiver")
        self.last_error: str | None = None
        self._update: Update | None = None
        self._busy = threading.Lock()
        self.standby = ({k: v.clone() for k, v in self.slots.live.items()} if staging == "double_buffer" else None)
        if isinstance(target, torch.nn.Module):
            attach_state(target, self.state)
        if initial_version is not None:
            if layout != "hf":
                raise ValueError("initial_version needs layout='hf' (a vLLM layout needs the HF specs first)")
            self.state.version = check_version(initial_version, "Receiver", "initial_version")
            live = self.slots.live
            counters = {k: t._version for k, t in live.items()}  # before the check: a write during it shows
            self.state.manifest = Manifest(int(initial_version), {
                k: TensorSpec(tuple(v.shape), v.dtype, fp)
                for (k, v), fp in zip(live.items(), fingerprints_of(live.values()))}, quantization=self.quantization)
            self.seal(counters)

    def seal(self, counters: dict[str, int]) -> None:
        """Make ``counters`` (each live tensor's version counter read before its bytes were checked)
        the verified state steps must run on: any later write moves a counter, even one made while
        the publish was still running (a trainer thread writing the shared tensors)."""
        self._counters = dict(counters)
        self._steps = 0

    def _rebind(self) -> str | None:
        """Follow the target to the tensors it holds now: an offload / reload (a colocated sleep and
        wake), ``load_state_dict(assign=True)`` or ``p.data = ...`` replace them, and the old ones
        become orphans that publish would write and check while the engine reads the new ones. A
        replacement holding the verified bytes is adopted; otherwise returns the problem, naming the
        tensor (None: nothing replaced, or all adopted)."""
        sl, how = self.slots, "an offload / reload, load_state_dict(assign=True) or p.data = ..."
        with self.state.lock:
            if not sl.replaced():
                return None
            old = sl.live
            sl.read()
            moved = [k for k, v in sl.live.items() if k not in old or not _same_tensor(v, old[k])]
            counters = {k: sl.live[k]._version for k in moved}
            if self.standby is not None:
                for k in moved:
                    if k not in self.standby or not _same_kind(self.standby[k], sl.live[k]):
                        self.standby[k] = torch.empty_like(sl.live[k])
            man, version = self.state.manifest, self.state.version
            if man is None:  # nothing verified yet, nothing to keep
                return None
            gone, new = sorted(set(old) - set(sl.live)), sorted(set(sl.live) - set(old))
            if gone or new:
                return (f"the target's tensors changed ({how}?): it no longer holds {gone[:8]} and now holds "
                        f"{new[:8]}; the receiver checks none of the new ones")
            for k in moved:
                if not _same_kind(sl.live[k], old[k]):
                    v = sl.live[k]
                    return (f"live tensor {k!r} was replaced ({how}) by a {dtype_name(v.dtype)} {tuple(v.shape)} "
                            f"tensor on {v.device}; version {version} verified a {dtype_name(old[k].dtype)} "
                            f"{tuple(old[k].shape)} one on {old[k].device}")
            names = [n for k in moved for n in sl.hf_names(k)]
            for name, got in zip(names, fingerprints_of(sl.view(sl.live, n) for n in names)):
                if got != man.tensors[name].fingerprint:
                    return (f"live tensor {name!r} was replaced ({how}) by one that does not hold version "
                            f"{version}'s bytes (expected {man.tensors[name].fingerprint}, got {got})")
            self._counters.update(counters)
            return None

    def _check_live(self) -> str | None:
        problem = self._rebind()
        if problem is not None:
            return problem
        version = self.state.version
        for k, t in self.slots.live.items():
            if t._version != self._counters.get(k):
                return (f"live tensor {k!r} was written after version {version} was verified (outside "
                        f"bitmatch.sync.publish)")
        self._steps += 1
        man = self.state.manifest
        if self.verify_every and man is not None and self._steps % self.verify_every == 0:
            names = list(man.tensors)
            sl = self.slots
            for name, got in zip(names, fingerprints_of(sl.view(sl.live, n) for n in names)):
                if got != man.tensors[name].fingerprint:
                    return (f"live tensor {name!r} no longer has version {version}'s fingerprint (expected "
                            f"{man.tensors[name].fingerprint}, got {got}): written behind the version counters")
        return None

    @property
    def version(self) -> int | None:
        return self.state.version

    @property
    def update_in_progress(self) -> "Update | None":
        return self._update

    def require_ready(self, expected_version: int | None = None) -> int:
        return self.state.require_ready(expected_version)

    def order(self) -> dict:
        """The canonical-order stamp of the kernels the target's tensors run on."""
        live = next(iter(self.slots.live.values()), None)
        return stamp_for_device(live.device if live is not None else "cpu")

    def check_order(self, version: int, order) -> None:
        """Refuse an update whose canonical-order stamp is missing or is not the receiver's, field by
        field: the fingerprint alone is the sender's claim, not a proof of its fields."""
        where = f"weight update to version {version}"
        if order is None:
            raise CanonicalOrderError(
                f"{where} carries no canonical-order stamp: the receiver cannot tell whether the sender's kernels "
                "give the same bits. Send bitmatch.kernels.order.stamp_for_device(<the weights' device>) "
                "(publish, InProcessSender and TcpSender do)")
        if not isinstance(order, dict):
            raise CanonicalOrderError(f"{where}: the canonical-order stamp must be an object "
                                      f"(bitmatch.kernels.order.stamp_for_device), got {type(order).__name__}")
        mine = self.order()
        if order == mine:
            return
        diff = sorted(k for k in set(order) | set(mine) if k != "fingerprint" and order.get(k) != mine.get(k))
        if not diff or order.get("fingerprint") == mine["fingerprint"]:
            raise CanonicalOrderError(
                f"{where}: the stamp's fingerprint {order.get('fingerprint')} is not the fingerprint of its fields "
                f"(differ from the receiver's order {mine['fingerprint']} in {diff}: sender "
                f"{[order.get(k) for k in diff]}, receiver {[mine.get(k) for k in diff]}): a forged or corrupted stamp")
        raise CanonicalOrderError(
            f"{where}: the sender's kernels run canonical order {order.get('fingerprint')} and the receiver's "
            f"{mine['fingerprint']} (differ in {diff}: sender {[order.get(k) for k in diff]}, "
            f"receiver {[mine.get(k) for k in diff]}); the same weights would give other bits. Run trainer and "
            "rollout on the same backend and bitmatch version")

    def begin(self, version: int, specs: dict[str, TensorSpec], order: dict | None = None,
              quantization: str | None = None) -> "Update":
        """Start staging ``version``; checks the sender's canonical-order stamp (``order``, from
        ``bitmatch.kernels.order.stamp_for_device``: required), its ``quantization`` against the
        receiver's, and names, shapes and dtypes against the target first."""
        version = check_version(version, "weight update")
        if not self._busy.acquire(blocking=False):
            raise SyncError("another weight update is in progress")
        try:
            cur = self.state.version
            if cur is not None and version < cur and not self.allow_older_versions:
                raise WeightVersionError(
                    f"weight update to version {version}: this receiver holds version {cur} and versions must "
                    "increase (a stale or replayed publish?); create the receiver with allow_older_versions=True "
                    "to roll back on purpose")
            self.check_order(version, order)
            if quantization != self.quantization:
                raise SyncError(f"weight update to version {version}: the sender publishes for quantization="
                                f"{quantization!r}, this receiver's engine runs quantization={self.quantization!r}; "
                                "the same weights would give other bits. Publish with publish(..., quantization="
                                f"{self.quantization!r}) or receive(..., quantization={quantization!r}) (docs/fp8.md)")
            replaced = self._rebind()
            if replaced is not None and self.state.failure is None:
                self.state.failure = replaced  # not the verified bytes: nothing may be kept, all is rewritten
            self.slots.bind(specs)
            names = set(self.slots.names)
            missing, extra = sorted(names - set(specs)), sorted(set(specs) - names)
            if missing or extra:
                raise ValueError(f"weight update must cover every parameter exactly once: missing {missing[:8]}"
                                 f"{'...' if len(missing) > 8 else ''}, unknown {extra[:8]}")
            for name, spec in specs.items():
                v = self.slots.view(self.slots.live, name)
                if tuple(v.shape) != tuple(spec.shape):
                    raise ValueError(f"tensor {name!r}: shape {tuple(spec.shape)} does not match the "
                                     f"target's {tuple(v.shape)}")
                if v.dtype != spec.dtype:
                    raise ValueError(f"tensor {name!r}: dtype {dtype_name(spec.dtype)} does not match the "
                                     f"target's {dtype_name(v.dtype)}")
        except BaseException:
            self._busy.release()
            raise
        self._update = Update(self, int(version), specs)
        self._update.order = order
        self.state.updating = int(version)
        return self._update

    def _end(self, upd: "Update", failure: str | None) -> None:
        self._update = None
        self.state.updating = None
        if failure is not None:
            self.last_error = failure
            self.state.failure = failure
        self._busy.release()


def _same_kind(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return _same_kind(a, b) and a.data_ptr() == b.data_ptr() and a.stride() == b.stride()


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
                        self.rx._end(self, f"live tensor {name!r} differs from its verified staging copy "
                                           f"after the switch (expected {self.done[name]}, got {got})")
                        raise FingerprintMismatchError(name, self.done[name], got, " (after switch)")
            man.order = self.order
            st.version, st.manifest, st.failure = self.version, man, None
            self.rx.seal(self.checked)
            self.closed = True
            if self.rx.staging == "shadow":
                self.bank = {}
            self.rx._end(self, None)
        return man

    def abort(self, reason: str) -> None:
        """Discard the staging; the previous version stays live and generation is refused."""
        if self.closed:
            return
        self.closed = True
        if self.rx.staging == "shadow":
            self.bank = {}
        prev = self.rx.state.version
        self.rx._end(self, f"{reason}; previous version {prev} kept")
