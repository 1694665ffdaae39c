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
"""
from __future__ import annotations

import torch

from ..models import check_supported, unwrap_causal_lm
from ..models.lora import merged_state_dict, plain_name
from ..models.registry import family_for_config
from ..patching import patch as bitmatch_patch
from ..precision import compute_cast
from .fingerprint import Manifest, fingerprint
from .receiver import Receiver, require_ready


def storage_dtypes(model, compute_dtype: torch.dtype) -> dict[str, torch.dtype]:
    """{HF name: dtype} a rollout copy of ``model`` stores each parameter in (tied ones under
    every name): float32 for the family's ``fp32_parameters``, ``compute_dtype`` otherwise."""
    fp32 = family_for_config(model.config).fp32_parameters(model) if compute_dtype != torch.float32 else set()
    return {n: (torch.float32 if n in fp32 else compute_dtype)
            for n, _ in model.named_parameters(remove_duplicate=False)}


class RolloutCopy:
    """A patched HF model for the engine, its Receiver, and the publish that fills it.

    ``RolloutCopy(trainer_model, compute_dtype)``: built from the trainer model's config on its LM
    head's device, tied as it is tied, its buffers copied (router correction biases, hash-routing
    tables: not trained by the optimizer, not published); ``publish(version)`` sends its merged
    LoRA weights. ``RolloutCopy.from_config(config, compute_dtype, device)``: for a worker that
    only receives weights (``publish(version, weights)``).
    Invariance: after ``publish(v)`` every parameter holds ``compute_cast(w, storage dtype)``
    (fingerprint-verified), so the engine's logprobs equal ``token_logprobs`` on the trainer."""

    def __init__(self, trainer_model, compute_dtype: torch.dtype, *, patch: bool = True):
        self.source = trainer_model
        lm = unwrap_causal_lm(trainer_model)
        self._init(lm.config, compute_dtype, lm.lm_head.weight.device, patch, lm)

    @classmethod
    def from_config(cls, config, compute_dtype: torch.dtype, device, *, patch: bool = True) -> "RolloutCopy":
        self = cls.__new__(cls)
        self.source = None
        self._init(config, compute_dtype, torch.device(device), patch, None)
        return self

    def _init(self, config, compute_dtype, device, patch, lm):
        import transformers
        if compute_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"RolloutCopy: compute_dtype must be torch.bfloat16 or torch.float32, got {compute_dtype}")
        self.compute_dtype = compute_dtype
        with torch.device("meta"):
            view = transformers.AutoModelForCausalLM.from_config(config, dtype=compute_dtype)
        check_supported(view)
        self.dtypes = storage_dtypes(view, compute_dtype)
        for name, p in list(view.named_parameters()):
            if p.dtype != self.dtypes[name]:
                module, _, attr = name.rpartition(".")
                setattr(view.get_submodule(module), attr,
                        torch.nn.Parameter(torch.empty_like(p, dtype=self.dtypes[name]), requires_grad=False))
        view = view.to_empty(device=device).eval()
        view.requires_grad_(False)
        self.model, self._lm = view, lm
        if lm is not None:
            tie_parameters_like(view, lm)
            self.copy_buffers()
        if patch:
            bitmatch_patch(view, compute_dtype=compute_dtype)
        self.receiver = Receiver(view)

    # -- weights ---------------------------------------------------------------------------------
    def copy_buffers(self) -> None:
        """Give the copy the source's buffers, bit for bit and in their own dtype (``to_empty`` left
        them unset; HF may build them in the compute dtype, which would round a router's fp32
        correction bias). In place once the dtypes agree: a captured CUDA graph keeps its addresses."""
        if self._lm is None:
            raise ValueError("RolloutCopy.copy_buffers: this copy was built from a config and has no source model")
        src = {plain_name(n): b for n, b in self._lm.named_buffers()}
        for name, b in list(self.model.named_buffers()):
            if name not in src:
                raise ValueError(f"RolloutCopy: the trainer model has no buffer {name!r}")
            s = src[name].detach()
            if b.dtype == s.dtype and b.shape == s.shape:
                b.copy_(s)
            else:
                module, _, attr = name.rpartition(".")
                self.model.get_submodule(module)._buffers[attr] = s.clone().to(b.device)

    def weights(self) -> list[tuple[str, torch.Tensor]]:
        """(HF name, tensor) pairs the copy must hold: merged LoRA weights, the rest as they are."""
        if self.source is None:
            raise ValueError("RolloutCopy.weights: this copy was built from a config; pass the weights to publish()")
        return merged_state_dict(self.source)

    def publish(self, version: int, weights=None) -> Manifest:
        """Publish ``weights`` (default: the trainer model's merged weights) as ``version``, each
        tensor cast into the dtype the copy stores it in; raises and keeps the previous version
        if any tensor's fingerprint, shape or dtype does not match."""
        # bitmatch.sync.publish, looked up per call: the package's __init__ (which defines it) imports
        # this module, and benchmarks/trl_step.py times the publish by wrapping it there
        from . import publish
        if weights is None:
            weights = self.weights()
            self.copy_buffers()
        return publish(weights, int(version), to=self.receiver, dtype=self.dtypes)

    def require_ready(self, version: int | None = None) -> int | None:
        return require_ready(self.model, version)

    def differing(self, weights=None) -> list[str]:
        """Names of the tensors whose bytes in the copy differ from ``weights`` (default: the
        trainer's merged weights) cast into the copy's storage dtype."""
        live = dict(self.model.named_parameters())
        return [name for name, w in (self.weights() if weights is None else weights)
                if name in live and fingerprint(compute_cast(w, self.dtypes[name])) != fingerprint(live[name].detach())]


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
