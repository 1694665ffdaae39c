"""bitmatch model path: HF causal LMs of the registered families run on bitmatch.kernels.

The interface the engine, the trainer and the adapters share; each call finds the model's
family in the registry (``bitmatch.models.registry``: how to add a family is documented there)
and never names an architecture:
``forward_hidden``, ``compute_logits``, ``cache_groups``, ``check_supported``, ``load_model``.
"""
from __future__ import annotations

import dataclasses

import torch

from bitmatch.models import fp8_mode, lora
from bitmatch.models.hub import load_pretrained
from bitmatch.models.pack import Packed, pack
from bitmatch.models.registry import (
    CacheGroup,
    Family,
    PatchState,
    allocate_caches,
    check_config,
    compute_dtype_of as _compute_dtype_of,
    families,
    family_for_architecture,
    family_for_config,
    patch_state,
    register,
    spec_of,
    supported_architectures,
    supported_message,
)

__all__ = [
    "forward_hidden", "compute_logits", "cache_groups", "allocate_caches", "check_supported", "load_model",
    "unwrap_causal_lm", "model_spec", "family_of", "compute_dtype_of", "pack", "Packed", "CacheGroup",
    "Family", "PatchState", "register", "families", "family_for_architecture", "family_for_config",
    "check_config", "patch_state", "supported_architectures", "supported_message",
]


def unwrap_causal_lm(model):
    """The HF causal LM inside DDP / FSDP(1) / PEFT / torch.compile wrappers (walks .module,
    .base_model.model, ._orig_mod, ._fsdp_wrapped_module); returns the module with ``lm_head``."""
    seen = 0
    m = model
    while seen < 16:
        seen += 1
        if hasattr(m, "lm_head") and hasattr(getattr(m, "model", None), "layers"):
            return m
        nxt = None
        for path in ("module", "_orig_mod", "_fsdp_wrapped_module", "base_model.model", "base_model", "model"):
            cur = m
            ok = True
            for part in path.split("."):
                cur = getattr(cur, part, None)
                if cur is None:
                    ok = False
                    break
            if ok and isinstance(cur, torch.nn.Module) and cur is not m:
                nxt = cur
                break
        if nxt is None:
            break
        m = nxt
    # not found: an error naming the outer architecture
    family_for_config(getattr(model, "config", None), type(model).__name__)  # raises for an unknown model_type
    raise ValueError(f"bitmatch: {type(model).__name__} has no causal-LM head (lm_head + model.layers); "
                     "pass the *ForCausalLM model")


def check_supported(model) -> None:
    """ValueError naming the supported architectures, or every unsupported option, unless ``model``
    (or what it wraps) is a registered family that reproduces its whole config."""
    spec_of(unwrap_causal_lm(model))


def family_of(model) -> Family:
    return spec_of(unwrap_causal_lm(model))[0]


def model_spec(model):
    return spec_of(unwrap_causal_lm(model))[1]


def compute_dtype_of(model) -> torch.dtype:
    return _compute_dtype_of(unwrap_causal_lm(model))


def forward_hidden(model, input_ids: torch.Tensor, ctx, *, compute_dtype: torch.dtype | None = None,
                   recorder=None) -> torch.Tensor:
    """Packed tokens [T] -> final-norm hidden states [T, hidden] on bitmatch kernels.

    ``ctx`` is a ``bitmatch.context.ForwardContext``: packed prefill (``cu_seqlens``) or paged
    (``slot_mapping``, ``caches``, ... : each attention layer writes its k/v, then attention_paged).
    ``compute_dtype``: dtype the weights are cast to at use (default: the one set by
    ``bitmatch.patch(model, compute_dtype=...)``, else the parameters' dtype).
    ``ctx.quantization`` "fp8": the projections on block-FP8 weights (``fp8_mode``; refused by name
    for a family that does not declare it in ``Family.quantizations``); None: the one
    ``bitmatch.patch(model, quantization=...)`` set, else none.
    ``recorder(name, value)``: called after each op (``bitmatch.diagnostics.verify.locate``, ``Engine.record``);
    an observer: every family runs the same ops with or without one.
    Invariance: each token's hidden state depends only on its own tokens and causal prefix.
    """
    lm = unwrap_causal_lm(model)
    fam, spec = spec_of(lm)
    if input_ids.dim() != 1:
        raise ValueError(f"forward_hidden: input_ids must be 1-D packed tokens [T], got shape {tuple(input_ids.shape)}")
    if ctx.positions is None or ctx.positions.shape[0] != input_ids.shape[0]:
        raise ValueError("forward_hidden: ctx.positions must have one entry per token of input_ids")
    dt = compute_dtype if compute_dtype is not None else _compute_dtype_of(lm)
    st = patch_state(lm)
    if ctx.quantization is None and st is not None and st.quantization is not None:
        # the patch's mode, as for the compute dtype: every caller (locate, checks) runs what the trainer runs
        ctx = dataclasses.replace(ctx, quantization=st.quantization)
    if ctx.quantization is not None and ctx.quantization not in fam.quantizations:  # never bf16 in silence
        fp8_mode.check_model(lm, fam, fp8_mode.check_quantization(ctx.quantization, "forward_hidden"),
                             "forward_hidden")
    return fam.forward_hidden(lm, spec, input_ids, ctx, dt, recorder)


def compute_logits(model, hidden: torch.Tensor, *, compute_dtype: torch.dtype | None = None,
                   kept: bool = False) -> torch.Tensor:
    """hidden [N, hidden] -> logits [N, vocab] in the compute dtype (the family's head on kernels.linear).
    ``kept``: an engine step's head, reading the kept cast of a head weight held in another dtype
    (bitmatch.models.lora ``kept_weights``; same bits) instead of casting it again."""
    lm = unwrap_causal_lm(model)
    fam, spec = spec_of(lm)
    dt = compute_dtype if compute_dtype is not None else _compute_dtype_of(lm)
    with lora.kept_weights(kept):
        return fam.compute_logits(lm, spec, hidden, dt)


def cache_groups(model, *, compute_dtype: torch.dtype | None = None) -> list[CacheGroup]:
    """The engine caches the model's family needs (``allocate_caches`` builds them)."""
    lm = unwrap_causal_lm(model)
    fam, spec = spec_of(lm)
    dt = compute_dtype if compute_dtype is not None else _compute_dtype_of(lm)
    return fam.cache_groups(spec, dt)


def load_model(path_or_name: str, dtype: torch.dtype = torch.bfloat16, device=None, **kwargs):
    """HF ``AutoModelForCausalLM.from_pretrained`` (hub names work where a network exists), eval
    mode, checked for support; FP8 / FP4 DeepSeek checkpoints are dequantized to ``dtype`` as they
    load (``bitmatch.models.hub.load_pretrained``). Extra kwargs go to from_pretrained."""

    model = load_pretrained(path_or_name, dtype=dtype, who="load_model", **kwargs)
    check_supported(model)
    if device is not None:
        model = model.to(device)
    model.eval()
    return model
