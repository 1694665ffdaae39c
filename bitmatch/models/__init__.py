"""bitmatch model path: HF causal LMs of the dense families run on bitmatch.kernels.

The interface the engine and the trainer share (see the module docs of ``dense``):
``forward_hidden``, ``compute_logits``, ``kv_cache_spec``, ``check_supported``, ``load_model``.
"""
from __future__ import annotations

import torch

from bitmatch.models import dense
from bitmatch.models.dense import (
    SUPPORTED_ARCHITECTURES,
    DenseSpec,
    KVCacheSpec,
    model_spec as _model_spec,
)
from bitmatch.models.pack import Packed, pack

__all__ = [
    "forward_hidden", "compute_logits", "kv_cache_spec", "check_supported", "load_model",
    "unwrap_causal_lm", "model_spec", "KVCacheSpec", "DenseSpec", "SUPPORTED_ARCHITECTURES",
    "pack", "Packed", "compute_dtype_of",
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
    # not found: let check_supported produce the error naming the outer architecture
    dense.check_supported(model)
    return model


def check_supported(model) -> None:
    """ValueError listing the supported architectures unless ``model`` (or what it wraps) is one."""
    dense.check_supported(unwrap_causal_lm(model))


def model_spec(model) -> DenseSpec:
    return _model_spec(unwrap_causal_lm(model))


def compute_dtype_of(model) -> torch.dtype:
    return dense.default_compute_dtype(unwrap_causal_lm(model))


def forward_hidden(model, input_ids: torch.Tensor, ctx, *, compute_dtype: torch.dtype | None = None,
                   recorder=None) -> torch.Tensor:
    """Packed tokens [T] -> final-norm hidden states [T, hidden] on bitmatch kernels.

    ``ctx`` is a ``bitmatch.context.ForwardContext``: packed prefill (``cu_seqlens``) or paged
    (``slot_mapping``, ``kv_caches``, ... : each layer writes its k/v, then attention_paged).
    ``compute_dtype``: dtype the weights are cast to at use (default: the one set by
    ``bitmatch.patch(model, compute_dtype=...)``, else the parameters' dtype).
    ``recorder(name, value)``: called after each op (see ``bitmatch.verify.locate``).
    """
    return dense.forward_hidden_lm(unwrap_causal_lm(model), input_ids, ctx, compute_dtype=compute_dtype,
                                   recorder=recorder)


def compute_logits(model, hidden: torch.Tensor, *, compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """hidden [N, hidden] -> logits [N, vocab] in the compute dtype (lm_head, tied or not, via kernels.linear)."""
    return dense.compute_logits_lm(unwrap_causal_lm(model), hidden, compute_dtype=compute_dtype)


def kv_cache_spec(model, *, compute_dtype: torch.dtype | None = None) -> KVCacheSpec:
    return dense.kv_cache_spec_lm(unwrap_causal_lm(model), compute_dtype=compute_dtype)


def load_model(path_or_name: str, dtype: torch.dtype = torch.bfloat16, device=None, **kwargs):
    """HF ``AutoModelForCausalLM.from_pretrained`` (hub names work where a network exists), eval
    mode, checked for support. Extra kwargs go to from_pretrained."""
    import transformers

    from bitmatch.hub import resolve_checkpoint  # missing folder / bad hub name: clear error, fast

    model = transformers.AutoModelForCausalLM.from_pretrained(
        resolve_checkpoint(path_or_name, who="load_model", **kwargs), dtype=dtype, **kwargs)
    check_supported(model)
    if device is not None:
        model = model.to(device)
    model.eval()
    return model
