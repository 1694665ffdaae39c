"""The rollout copy: the engine's own model when it cannot run on the trainer's tensors.

LoRA (the rollout needs the merged weights), ``rollout_weights="copy"``, or a rollout worker that
only ever sees the trainer's weights on the wire (verl): the engine then runs on a copy built
from the config, which only ever changes through ``bitmatch.sync.publish`` (fingerprint-checked,
versioned). One class builds it for every adapter.

Storage dtype, per parameter: the compute dtype, except the parameters the family's forward
reads in float32 whatever the compute dtype (``Family.fp32_parameters``: routers, SSM decay, mHC
mixes), which stay float32. Every other parameter is cast to the compute dtype at use by the
trainer (``cast_param``, round-to-nearest-even, elementwise), so storing that cast once gives the
same bits; an fp32 read of a bf16-stored copy would instead see a rounded weight where the
trainer sees its fp32 master (Qwen3-MoE's router chose other experts).

Buffers change the forward too, so none is left as ``to_empty`` made it. Persistent ones (in the
state dict: router correction biases, DeepSeek-V4's hash-routing table) are published with the
parameters, fingerprinted and versioned by the same receiver; floating ones stored in float32
(the forward reads them in float32, so any trainer dtype arrives losslessly), integer ones
travelling as their bytes (see ``wire_view``). Non-persistent ones (rotary frequency tables) are
a function of the config: recomputed as ``from_pretrained`` does (HF's ``_init_weights``), or
copied from the trainer model when there is one; a sender that includes them has them checked.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from ..models import check_supported, unwrap_causal_lm
from ..models.fp8_mode import check_quantization
from ..models.lora import merged_state_dict, plain_name
from ..models.registry import family_for_config
from ..patching import patch as bitmatch_patch
from ..precision import compute_cast
from .fingerprint import Manifest, fingerprint
from .names import architecture_of
from .publishing import publish
from .receiver import Receiver, attach_state, require_ready


def storage_dtypes(model, compute_dtype: torch.dtype) -> dict[str, torch.dtype]:
    """{HF name: dtype} a rollout copy of ``model`` stores each parameter in (tied ones under
    every name): float32 for the family's ``fp32_parameters``, ``compute_dtype`` otherwise."""
    fp32 = family_for_config(model.config).fp32_parameters(model) if compute_dtype != torch.float32 else set()
    return {n: (torch.float32 if n in fp32 else compute_dtype)
            for n, _ in model.named_parameters(remove_duplicate=False)}


def named_buffers_by_kind(model) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(persistent, non-persistent) buffers of ``model`` by name: the first are in its state dict."""
    kept, derived = {}, {}
    for mname, m in model.named_modules():
        for bname, b in m._buffers.items():
            if b is not None:
                name = f"{mname}.{bname}" if mname else bname
                (derived if bname in m._non_persistent_buffers_set else kept)[name] = b
    return kept, derived


def wire_view(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` as the sync protocol carries it: floating tensors as they are; an integer buffer's
    bytes viewed as float32 (the protocol casts floats only, and a float32 -> float32 cast is the
    identity, so the bytes arrive exactly as they left and are fingerprinted as they are)."""
    if t.is_floating_point():
        return t
    if t.dim() == 0 or (t.shape[-1] * t.element_size()) % 4:
        raise NotImplementedError(f"RolloutCopy: buffer {name!r} ({t.dtype}, shape {tuple(t.shape)}) cannot travel "
                                  "as whole 4-byte words; make it a parameter or recompute it from the config")
    return t.contiguous().view(torch.float32)


def recompute_buffers(view, names) -> None:
    """Fill the non-persistent buffers ``names`` of ``view`` from its config, as ``from_pretrained``
    does: HF's own ``_init_weights`` on each module holding one. Refuses one it left unwritten."""
    owners = {n.rpartition(".")[0] for n in names}
    before = {n: view.get_buffer(n)._version for n in names}
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):  # a module's own parameters would draw from the RNG
        for mname in sorted(owners):
            view._init_weights(view.get_submodule(mname))
    stale = [n for n in names if view.get_buffer(n)._version == before[n]]
    if stale:
        raise NotImplementedError(f"RolloutCopy.from_config: {type(view).__name__}._init_weights does not compute "
                                  f"the buffers {stale[:4]} from the config; build the copy with "
                                  "RolloutCopy(trainer_model, ...) to take them from the trainer")


class CopyTensors(Mapping):
    """{HF name: tensor} of what a rollout copy's receiver manages: the model's parameters and its
    persistent buffers (integer ones as ``wire_view``), read from the model at every access, so
    the receiver notices a tensor the model no longer holds (an offload / reload replaced it)."""

    def __init__(self, model, buffer_names):
        self.model, self.buffer_names = model, list(buffer_names)
        self._views: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> (buffer, its wire view)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.buffer_names:
            return self.model.get_parameter(name)
        b = self.model.get_buffer(name)
        held = self._views.get(name)
        if held is None or held[0] is not b:  # one view per buffer: the receiver compares identities
            held = self._views[name] = (b, wire_view(name, b))
        return held[1]

    def __iter__(self):
        yield from (n for n, _ in self.model.named_parameters())
        yield from self.buffer_names

    def __len__(self) -> int:
        return len(list(self.model.named_parameters())) + len(self.buffer_names)


class RolloutCopy:
    """A patched HF model for the engine, its Receiver, and the publish that fills it.

    ``RolloutCopy(trainer_model, compute_dtype)``: built from the trainer model's config on its LM
    head's device, tied as it is tied; ``publish(version)`` sends its merged LoRA weights and its
    persistent buffers. ``RolloutCopy.from_config(config, compute_dtype, device)``: for a worker
    that only receives weights (``publish(version, weights)``, with ``weights`` the trainer's
    state dict: parameters and persistent buffers).
    ``sender``: what ``publish`` sends through; None (the default) is this copy's receiver, in
    process. Any sender of the copy's receiver (``send(model, version, dtype)``: an
    ``InProcessSender(copy.receiver)`` wrapped to time or log each send) may take its place.
    Invariance: after ``publish(v)`` every parameter holds ``compute_cast(w, storage dtype)`` and
    every persistent buffer the trainer's values (fingerprint-verified), so the engine's logprobs
    equal ``token_logprobs`` on the trainer."""

    def __init__(self, trainer_model, compute_dtype: torch.dtype, *, patch: bool = True,
                 quantization: str | None = None):
        self.source = trainer_model
        lm = unwrap_causal_lm(trainer_model)
        self._init(lm.config, compute_dtype, lm.lm_head.weight.device, patch, lm, quantization)

    @classmethod
    def from_config(cls, config, compute_dtype: torch.dtype, device, *, patch: bool = True,
                    quantization: str | None = None) -> "RolloutCopy":
        self = cls.__new__(cls)
        self.source = None
        self._init(config, compute_dtype, torch.device(device), patch, None, quantization)
        return self

    def _init(self, config, compute_dtype, device, patch, lm, quantization=None):
        import transformers
        if compute_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"RolloutCopy: compute_dtype must be torch.bfloat16 or torch.float32, got {compute_dtype}")
        self.compute_dtype = compute_dtype
        self.quantization = check_quantization(quantization, "RolloutCopy")
        with torch.device("meta"):
            view = transformers.AutoModelForCausalLM.from_config(config, dtype=compute_dtype)
        check_supported(view)
        self.dtypes = storage_dtypes(view, compute_dtype)
        for name, p in list(view.named_parameters()):
            if p.dtype != self.dtypes[name]:
                module, _, attr = name.rpartition(".")
                setattr(view.get_submodule(module), attr,
                        torch.nn.Parameter(torch.empty_like(p, dtype=self.dtypes[name]), requires_grad=False))
        kept, _ = named_buffers_by_kind(view)
        for name, b in kept.items():
            if b.is_floating_point() and b.dtype != torch.float32:
                module, _, attr = name.rpartition(".")
                view.get_submodule(module)._buffers[attr] = torch.empty_like(b, dtype=torch.float32)
        view = view.to_empty(device=device).eval()
        view.requires_grad_(False)
        with torch.no_grad():  # zeros, not whatever the allocator held, until the first publish fills them
            for t in [*view.parameters(), *view.buffers()]:
                t.zero_()
        self.model, self._lm = view, lm
        kept, derived = named_buffers_by_kind(view)
        self.buffers, self.derived = list(kept), list(derived)
        if lm is not None:
            tie_parameters_like(view, lm)
            self.copy_buffers()
        else:
            view.tie_weights()  # to_empty gave each tied name its own tensor; tie them as the config says
            recompute_buffers(view, self.derived)
        self.dtypes.update({n: torch.float32 for n in self.buffers})
        if patch:
            bitmatch_patch(view, compute_dtype=compute_dtype, quantization=quantization)
        # one receiver over the parameters and the persistent buffers: one version, one check
        self.receiver = Receiver(CopyTensors(view, self.buffers), arch=architecture_of(view),
                                 quantization=quantization)
        attach_state(view, self.receiver.state)
        self.sender = None

    # -- weights ---------------------------------------------------------------------------------
    def copy_buffers(self) -> None:
        """Give the copy the source's non-persistent buffers (rotary tables), bit for bit and in
        their own dtype. In place once the dtypes agree: a captured CUDA graph keeps its addresses.
        The persistent ones are published (``weights``)."""
        if self._lm is None:
            raise ValueError("RolloutCopy.copy_buffers: this copy was built from a config and has no source model")
        src = {plain_name(n): b for n, b in self._lm.named_buffers()}
        for name in self.derived:
            b = self.model.get_buffer(name)
            if name not in src:
                raise ValueError(f"RolloutCopy: the trainer model has no buffer {name!r}")
            s = src[name].detach()
            if b.dtype == s.dtype and b.shape == s.shape:
                b.copy_(s)
            else:
                module, _, attr = name.rpartition(".")
                self.model.get_submodule(module)._buffers[attr] = s.clone().to(b.device)

    def weights(self) -> list[tuple[str, torch.Tensor]]:
        """(HF name, tensor) pairs the copy must hold: merged LoRA weights, the rest as they are,
        and the persistent buffers."""
        if self.source is None:
            raise ValueError("RolloutCopy.weights: this copy was built from a config; pass the weights to publish()")
        kept, _ = named_buffers_by_kind(self.source)
        return merged_state_dict(self.source) + [(plain_name(n), b.detach()) for n, b in kept.items()]

    def wire(self, weights) -> list[tuple[str, torch.Tensor]]:
        """``weights`` as the receiver takes them: integer buffers as their bytes (``wire_view``); a
        non-persistent buffer, or the second name of a tied parameter (a state dict has both),
        checked against what the copy holds and left out. Raises naming a persistent buffer the
        sender left out: the copy would otherwise run without the trainer's."""
        weights = list(weights)
        primary = {id(p): n for n, p in self.model.named_parameters()}
        alias = {n: primary[id(p)] for n, p in self.model.named_parameters(remove_duplicate=False)
                 if primary[id(p)] != n}
        sent = dict(weights)
        out = []
        for name, w in weights:
            if name in self.derived:
                ours = self.model.get_buffer(name)
                if w.dtype != ours.dtype or w.shape != ours.shape or fingerprint(w.detach()) != fingerprint(ours):
                    raise ValueError(f"RolloutCopy.publish: buffer {name!r} differs from the one this copy computed "
                                     "from the config (the trainer's config or transformers version is not the "
                                     "rollout's); build both from the same config")
            elif name in alias:
                first = sent.get(alias[name])
                if first is None:
                    out.append((alias[name], w))
                elif not torch.equal(compute_cast(w, self.dtypes[name]), compute_cast(first, self.dtypes[name])):
                    raise ValueError(f"RolloutCopy.publish: {name!r} is tied to {alias[name]!r} in the config, but "
                                     "the weights hold different values for them; untie them in both configs or "
                                     "send one")
            else:
                out.append((name, wire_view(name, w) if name in self.buffers else w))
        missing = sorted(set(self.buffers) - {n for n, _ in out})
        if missing:
            raise ValueError(f"RolloutCopy.publish: the weights lack the buffers {missing[:4]} (router correction "
                             "biases, routing tables: they change the forward); publish the trainer model's "
                             "state_dict(), not only its named_parameters()")
        return out

    def publish(self, version: int, weights=None) -> Manifest:
        """Publish ``weights`` (default: the trainer model's merged weights and persistent buffers)
        as ``version``, each tensor cast into the dtype the copy stores it in; raises and keeps the
        previous version if any tensor's fingerprint, shape or dtype does not match."""
        if weights is None:
            weights = self.weights()
            self.copy_buffers()
        to = self.receiver if self.sender is None else self.sender
        return publish(self.wire(weights), version, to=to, dtype=self.dtypes, quantization=self.quantization)

    def require_ready(self, version: int | None = None) -> int | None:
        return require_ready(self.model, version)

    def differing(self, weights=None) -> list[str]:
        """Names of the tensors (parameters and persistent buffers) whose bytes in the copy differ
        from ``weights`` (default: the trainer's) cast into the copy's storage dtype."""
        live = self.receiver.slots.live
        return [name for name, w in self.wire(self.weights() if weights is None else weights)
                if name in live and fingerprint(compute_cast(w, self.dtypes[name])) != fingerprint(live[name])]


def tie_parameters_like(view, lm) -> None:
    """Share in the rollout copy ``view`` every parameter the trainer's ``lm`` shares under several
    names (tied embeddings: Qwen3-0.6B/1.7B, Llama-3.2-1B), as the trainer does. ``to_empty``
    gives each name its own tensor, and the publish, which sends a tied tensor once (under its
    first name), would then leave ``lm_head.weight`` unfilled; tied, the copy has one parameter
    where the trainer has one, so the update covers it exactly once and the LM head reads the
    embedding's bits, as the trainer's."""
    first: dict[int, str] = {}
    for name, p in lm.named_parameters(remove_duplicate=False):
        src = first.setdefault(id(p), name)
        if src == name:
            continue
        src, name = plain_name(src), plain_name(name)
        module, _, attr = name.rpartition(".")
        setattr(view.get_submodule(module), attr, view.get_parameter(src))
