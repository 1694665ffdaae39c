"""vLLM colocate transport: weights go through the model's own ``load_weights``.

Written against vLLM's interface (``model.load_weights(iterable of (hf_name, tensor))``, reached
directly in single-process/colocate mode or through ``llm.collective_rpc``); tested with a fake
model that mimics it and with real vLLM 0.32 (CPU) under the bitmatch plugin, both paths
(tests/test_vllm_logprobs.py). vLLM writes in place, so atomicity comes from a backup: the touched
engine parameters are copied aside first (``backup=True``, one model copy of memory), the new
version is loaded bucket by bucket, then every HF tensor's fingerprint is recomputed on the
engine's own bytes through names.py (row blocks of qkv_proj / gate_up_proj). On any failure the
backup is restored, the previous version stays live, and generation is refused until a full
update succeeds. Note (vLLM CPU): the stock CPU linear repacks weights after loading; the
bitmatch vLLM plugin's non-repacking linear method is needed for load_weights to take effect.
"""
from __future__ import annotations

import torch

from ..precision import compute_cast
from .fingerprint import Manifest, TensorSpec, dtype_from_name, dtype_name, fingerprint
from .names import architecture_of, build_layout
from .receiver import FingerprintMismatchError, WeightState, attach_state
from .source import DEFAULT_BUCKET_BYTES, named_weights, wire_specs


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
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, backup: bool = True, use_rpc: bool = False):
        if model is None and llm is None:
            raise ValueError("VllmColocateSender needs llm= or model=")
        if use_rpc and llm is None:
            raise ValueError("VllmColocateSender(use_rpc=True) needs llm=")
        self.llm = llm
        self.model = model if model is not None else (None if use_rpc else _driver_model(llm))
        self.arch = arch
        self.bucket_bytes, self.backup = bucket_bytes, backup
        self.state = WeightState()
        if self.model is not None:
            attach_state(self.model, self.state)

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
        weights = named_weights(model)
        specs = wire_specs(weights, dtype)
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
            st.updating = int(version)
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
            man = Manifest(int(version), {k: TensorSpec(s.shape, dtype, fps[k]) for k, s in specs.items()})
            st.version, st.manifest, st.failure = int(version), man, None
        reset = getattr(self.llm, "reset_prefix_cache", None)
        if reset is not None:
            reset()  # cached KV blocks were computed with the previous weights
        return man

    def require_ready(self, expected_version: int | None = None) -> int:
        return self.state.require_ready(expected_version)
