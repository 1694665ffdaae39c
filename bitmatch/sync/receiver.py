"""The receiving side: stage a whole version, verify every fingerprint, then switch atomically.

A generation never sees a half-applied update: transports write into staging buffers (or, for
the in-process zero-copy case, only fingerprint the shared tensors), the receiver recomputes
every fingerprint on the staged bytes, and only a complete, fully verified version is copied
into the live weights, under the lock that generation holds. Any failure discards the staging
and leaves the previous version in place, and generation is refused until a full update
succeeds (the trainer expects the new version; serving the old one silently is the
off-by-one-step bug).

``Receiver`` checks each update's announcement and follows the target's tensors; ``update.py`` holds the
``Update`` a version is staged in, ``weight_state.py`` the ``WeightState`` the engine holds per step.
"""
from __future__ import annotations

import threading

import torch

from bitmatch.kernels.order import stamp_for_device
from bitmatch.models.fp8_mode import check_quantization

from .errors import (  # noqa: F401
    AuthenticationError,
    CanonicalOrderError,
    FingerprintMismatchError,
    SyncError,
    WeightsNotReadyError,
    WeightVersionError,
)
from .fingerprint import Manifest, TensorSpec, dtype_name, fingerprints_of
from .names import architecture_of, build_layout
from .update import Update
from .version import check_version
from .weight_state import (
    WeightState,
    attach_state,
    require_ready as require_ready,
    weight_state as weight_state,
)


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

    def end_update(self, upd: Update, failure: str | None) -> None:
        """Close ``upd`` (called by it at commit or abort); a ``failure`` refuses generation."""
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
