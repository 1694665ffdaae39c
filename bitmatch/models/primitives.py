"""The ops every family runs on an HF module's own parameters: ``linear`` (plain, PEFT LoRA or FP8 mode),
``rms_norm`` / ``fused_add_rms_norm`` (eps read from the module), the embedding gather and the LM head.

Each reads ``module.weight`` / ``module.bias``, casts at use (``bitmatch.precision.cast_param``) and calls
``K.op`` (read at call time, so ``kernels.override`` reaches it): the parameters stay the model's own,
trainable, and a module's output has the bits of the kernel on the cast weight.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import bitmatch.kernels as K
from bitmatch.models import fp8_mode, lora
from bitmatch.precision import cast_param


def plain_module(mod, what: str):
    """``mod`` when no PEFT adapter wraps it, else a ValueError naming it: the families read the
    parameters of such modules (routers, experts, lm_head, V4's grouped o_a_proj) directly, so an
    adapter there would be ignored, not reproduced. LoRA runs on the projections that go through
    ``linear`` below."""
    if hasattr(mod, "base_layer") or hasattr(mod, "lora_A"):
        raise ValueError(
            f"bitmatch: a PEFT adapter wraps {what} ({type(mod).__name__}); bitmatch reads its weights "
            "directly and would ignore the adapter: remove it from LoraConfig target_modules / "
            "target_parameters (LoRA runs on the attention and MLP projections), or merge the adapters "
            "(peft merge_adapter) first")
    return mod


def _plain_linear_params(mod, what: str = "a layer bitmatch reads directly"):
    mod = plain_module(mod, what)
    return mod.weight, getattr(mod, "bias", None)


def linear(mod, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if fp8_mode.active():  # quantization="fp8": every projection on block-FP8 weights
        return fp8_mode.linear(mod, x, dtype)
    if lora.is_lora_layer(mod):
        return lora.linear(mod, x, dtype)  # PEFT LoRA: the merged weight the rollout receives
    w, b = _plain_linear_params(mod)
    return K.linear(x, cast_param(w, dtype), cast_param(b, dtype))


def norm_eps(norm_mod) -> float:
    """The epsilon of an HF RMSNorm module (``variance_epsilon`` or ``eps``)."""
    for name in ("variance_epsilon", "eps"):
        if hasattr(norm_mod, name):
            return float(getattr(norm_mod, name))
    raise ValueError(f"bitmatch: cannot find eps on norm module {type(norm_mod).__name__}")


def rms_norm(norm_mod, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return K.rms_norm(x, cast_param(norm_mod.weight, dtype), norm_eps(norm_mod))


def fused_add_rms_norm(norm_mod, x, residual, dtype):
    return K.fused_add_rms_norm(x, residual, cast_param(norm_mod.weight, dtype), norm_eps(norm_mod))


def embed(lm, input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    emb = plain_module(lm.model.embed_tokens, "the token embeddings (embed_tokens)")
    w = emb.weight
    # exact gather (cast after gather == gather after cast); padding_idx as nn.Embedding has it:
    # the pad row gets no gradient (HF configs set it from pad_token_id)
    h = F.embedding(input_ids, w, padding_idx=getattr(emb, "padding_idx", None))
    if torch.is_grad_enabled() and not h.requires_grad and getattr(emb, "_forward_hooks", None) and \
            getattr(lm, "_require_grads_hooks", None):
        # HF enable_input_require_grads (PEFT + reentrant checkpointing) hooks the embedding module,
        # which this gather bypasses: do what its hook does
        h.requires_grad_(True)
    return cast_param(h, dtype)


def lm_head_logits(lm, hidden: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Logits [N, vocab] of ``lm.lm_head`` on kernels.linear, weights cast at use (every family's head;
    a row's bits do not depend on the other rows)."""
    w, b = _plain_linear_params(lm.lm_head, "lm_head")
    return K.linear(hidden, cast_param(w, dtype), cast_param(b, dtype))
