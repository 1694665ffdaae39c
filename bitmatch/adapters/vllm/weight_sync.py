"""vLLM colocate transport for ``bitmatch.sync.publish``: weights go through the model's own ``load_weights``.

The vLLM side of the sync protocol (``bitmatch.sync`` names no adapter), reached as
``bitmatch.adapters.vllm.VllmColocateSender``. It does not import vLLM: it calls the engine's
interface on the object it is given.

Written against vLLM's interface (``model.load_weights(iterable of (hf_name, tensor))``, reached
directly in single-process/colocate mode or through ``llm.collective_rpc``); tested with a fake
model that mimics it and with real vLLM 0.32 (CPU) under the bitmatch plugin, both paths
(tests/test_vllm_logprobs.py). vLLM writes in place, so atomicity comes from a backup: the touched
engine parameters are copied aside first (``backup=True``, one model copy of memory), the new
version is loaded bucket by bucket, then every HF tensor's fingerprint is recomputed on the
engine's own bytes through ``bitmatch.sync.names`` (row blocks of qkv_proj / gate_up_proj). On any
failure the backup is restored, the previous version stays live, and generation is refused until a
full update succeeds. Versions are checked as every transport checks them
(``bitmatch.sync.version.check_version``) and must increase; the live version number with other
bytes is refused before anything is written. In this process (``model=`` or a reachable driver
model) every ``require_ready`` compares the parameters' version counters with those read at the
commit, so an in-place write outside ``publish`` is refused by name, as the Receiver does. Note
(vLLM CPU): the stock CPU linear repacks weights after loading; the bitmatch vLLM plugin's
non-repacking linear method is needed for load_weights to take effect.
"""
from __future__ import annotations

import torch

from bitmatch.precision import compute_cast
from bitmatch.sync.fingerprint import Manifest, TensorSpec, dtype_from_name, dtype_name, fingerprint
from bitmatch.sync.names import architecture_of, build_layout
from bitmatch.sync.receiver import FingerprintMismatchError, WeightState, WeightVersionError, attach_state
from bitmatch.sync.source import DEFAULT_BUCKET_BYTES, named_weights, wire_specs
from bitmatch.sync.version import check_version


def _driver_model(llm):
    """The vLLM model object in this process (colocate / external_launcher), or None."""
    obj = llm
    for attr in ("llm_engine", "model_executor", "driver_worker", "worker", "model_runner", "model"):
        nxt = getattr(obj, attr, None)
        if nxt is None and attr == "worker":
            continue  # older vLLM: driver_worker.model_runner
        if nxt is None:
            return None
        obj = nxt
    return obj


def _pack(batch):
    """(name, dtype name, shape, raw bytes) per tensor: vLLM's multi-process collective_rpc
    encodes tensors nested in argument lists as plain lists (measured, vLLM 0.32), so the bytes
    travel as bytes and are viewed back with their dtype on the worker (exact)."""
    out = []
    for n, t in batch:
        raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        out.append((n, dtype_name(t.dtype), tuple(t.shape), raw))
    return out


def _unpack(payload):
    out = []
    for n, dt, shape, raw in payload:
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        out.append((n, flat.view(dtype_from_name(dt)).reshape(shape)))
    return out


def _rpc_load(worker, payload):
    worker.model_runner.model.load_weights(weights=_unpack(payload))


def _rpc_params(worker):
    return {k: v.detach().cpu() for k, v in worker.model_runner.model.named_parameters()}


class VllmColocateSender:
    """Publish into a vLLM engine in this process. Give ``llm`` (a vllm.LLM) or ``model`` (the
    object with ``load_weights`` and ``named_parameters``; what a worker-side call receives).
    ``use_rpc=True`` goes through ``llm.collective_rpc`` even when the model is reachable here
    (the path a multi-process engine always takes; functions need
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` there)."""

    def __init__(self, llm=None, *, model=None, arch: str | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, backup: bool = True, use_rpc: bool = False,
                 allow_older_versions: bool = False):
        if model is None and llm is None:
            raise ValueError("VllmColocateSender needs llm= or model=")
        if use_rpc and llm is None:
            raise ValueError("VllmColocateSender(use_rpc=True) needs llm=")
        self.llm = llm
        self.model = model if model is not None else (None if use_rpc else _driver_model(llm))
        self.arch = arch
        self.bucket_bytes, self.backup = bucket_bytes, backup
        self.allow_older_versions = bool(allow_older_versions)
        self.state = WeightState()
        self._counters: dict[str, int] = {}
        if self.model is not None:
            attach_state(self.model, self.state)
            self.state.live_check = self._check_live

    def _check_live(self) -> str | None:
        """The commit's version counters against the live parameters' (the Receiver's check)."""
        for k, p in self.model.named_parameters():
            if p._version != self._counters.get(k):
                return (f"live tensor {k!r} was written after version {self.state.version} was verified (outside "
                        "bitmatch.sync.publish)")
        return None

    def _check_version(self, version: int, weights, dtype) -> Manifest | None:
        """Refuse an older version, or the live one with other bytes (fingerprinted before anything is
        written); returns the live manifest when ``weights`` are exactly the live version's."""
        cur = self.state.version
        if cur is None or version > cur:
            return None
        if version < cur and not self.allow_older_versions:
            raise WeightVersionError(f"weight update to version {version}: the vLLM engine holds version {cur} and "
                                     "versions must increase (a stale or replayed publish?); create the sender "
                                     "with allow_older_versions=True to roll back on purpose")
        if version == cur:
            man = Manifest(version, {k: TensorSpec(tuple(t.shape), dtype, fingerprint(compute_cast(t, dtype)))
                                     for k, t in weights})
            if self.state.manifest is None or man.digest() != self.state.manifest.digest():
                raise WeightVersionError(f"weight update to version {version}: the vLLM engine holds version {cur} "
                                         "with other bytes; publish the new weights under a new version number")
            return self.state.manifest
        return None

    def _engine_params(self) -> dict[str, torch.Tensor]:
        if self.model is not None:
            return {k: p.data for k, p in self.model.named_parameters()}
        return self.llm.collective_rpc(_rpc_params)[0]  # read-only copies (multi-process mode)

    def _load(self, batch) -> None:
        if self.model is not None:
            self.model.load_weights(batch)
        else:
            self.llm.collective_rpc(_rpc_load, args=(_pack(batch),))

    def send(self, model, version: int, dtype: torch.dtype = torch.bfloat16) -> Manifest:
        version = check_version(version, "VllmColocateSender.send")
        weights = named_weights(model)
        specs = wire_specs(weights, dtype)
        same = self._check_version(version, weights, dtype)
        if same is not None:
            return same  # the live version's own bytes again: nothing to write
        arch = self.arch or architecture_of(self.model if self.model is not None else model)
        eng = self._engine_params()
        layout = build_layout(arch, {k: s.shape for k, s in specs.items()},
                              {k: tuple(v.shape) for k, v in eng.items()})
        for hf, slot in layout.hf_to_engine.items():
            if eng[slot.engine_name].dtype != dtype:
                raise ValueError(f"tensor {hf!r}: dtype {dtype_name(dtype)} does not match the engine's "
                                 f"{slot.engine_name!r} ({dtype_name(eng[slot.engine_name].dtype)})")
        st = self.state
        with st.lock:  # no generation while the engine's weights are being rewritten
            st.updating = version
            saved = {k: v.detach().clone() for k, v in eng.items()} if self.backup and self.model else None
            fps: dict[str, str] = {}
            try:
                batch, nb = [], 0
                for name, t in weights:
                    cast = compute_cast(t, dtype)
                    fps[name] = fingerprint(cast)
                    batch.append((name, cast))
                    nb += cast.numel() * cast.element_size()
                    if nb >= self.bucket_bytes:
                        self._load(batch)
                        batch, nb = [], 0
                if batch:
                    self._load(batch)
                del batch
                # read before the check: a write made while the bytes are being checked shows at the next step
                counters = {k: p._version for k, p in self.model.named_parameters()} if self.model else {}
                eng = self._engine_params()
                for hf, slot in layout.hf_to_engine.items():
                    view = eng[slot.engine_name][slot.row_start:slot.row_start + slot.rows]
                    got = fingerprint(view.reshape(specs[hf].shape))
                    if got != fps[hf]:
                        raise FingerprintMismatchError(hf, fps[hf], got, f" (read back from vLLM's "
                                                                         f"{slot.engine_name!r})")
            except BaseException as e:
                if saved is not None:
                    for k, v in self._engine_params().items():
                        v.copy_(saved[k])
                    kept = f"previous version {st.version} restored"
                else:
                    st.version, kept = None, "no backup: engine weights are unusable until a full update"
                st.failure = f"vLLM weight update to version {version} failed: {e}; {kept}"
                raise
            finally:
                st.updating = None
                saved = None
            man = Manifest(version, {k: TensorSpec(s.shape, dtype, fps[k]) for k, s in specs.items()})
            st.version, st.manifest, st.failure = version, man, None
            self._counters = counters
        reset = getattr(self.llm, "reset_prefix_cache", None)
        if reset is not None:
            reset()  # cached KV blocks were computed with the previous weights
        return man

    def require_ready(self, expected_version: int | None = None) -> int:
        return self.state.require_ready(expected_version)
