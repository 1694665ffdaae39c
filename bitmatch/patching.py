"""bitmatch.patch / unpatch (module bitmatch.patching: a module named bitmatch.patch would shadow the
function bitmatch.patch once imported): run an HF causal LM's forward on bitmatch kernels in place.

The parameters stay the module's own; only ``forward`` of the causal LM, its base model, each
decoder layer, attention, MLP and norms is rebound (instance attributes; ``unpatch`` removes
them). A patched ``model(input_ids, attention_mask)`` packs the real tokens, takes positions
from the mask, and returns logits computed by ``bitmatch.models.forward_hidden`` +
``compute_logits`` (zeros at padding). There is no KV-cache path: generation goes through
``bitmatch.Engine``.
"""
from __future__ import annotations

import types

import torch

from bitmatch.models import dense, pack, unwrap_causal_lm
from bitmatch.models.dense import LayerCall

_PATCHED = "_bitmatch_patched"
_SAVED = "_bitmatch_saved_forward"


class BitmatchCacheError(RuntimeError):
    pass


def _no_cache(what):
    raise BitmatchCacheError(
        f"bitmatch: a patched model has no KV-cache path ({what} was requested). Generate with "
        "bitmatch.Engine(model).generate(...) (same kernels, paged KV cache), or call the model "
        "without past_key_values/use_cache (full recompute)."
    )


def _patched_run(self, input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, use_cache, kwargs):
    if past_key_values is not None:
        _no_cache("past_key_values")
    if use_cache:
        _no_cache("use_cache=True")
    if inputs_embeds is not None:
        raise ValueError("bitmatch: inputs_embeds is not supported by a patched model; pass input_ids")
    if input_ids is None:
        raise ValueError("bitmatch: input_ids is required")
    if isinstance(attention_mask, dict) or (attention_mask is not None and attention_mask.dim() != 2):
        raise ValueError("bitmatch: attention_mask must be the 2-D [batch, length] padding mask")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    p = pack(input_ids, attention_mask, position_ids)
    lm = unwrap_causal_lm(self)
    hidden = dense.forward_hidden_lm(lm, p.input_ids, p.context())
    return p, hidden


def _causal_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                    inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    p, hidden = _patched_run(self, input_ids, attention_mask, position_ids, past_key_values, inputs_embeds,
                             use_cache, kwargs)
    B, L = (input_ids[None] if input_ids.dim() == 1 else input_ids).shape
    cols = torch.arange(L, device=hidden.device)
    if isinstance(logits_to_keep, int):
        keep_cols = cols[-logits_to_keep:] if logits_to_keep > 0 else cols
    else:
        keep_cols = cols[logits_to_keep]
    keep = torch.zeros(L, dtype=torch.bool, device=hidden.device)
    keep[keep_cols] = True
    sel = keep[p.cols].nonzero(as_tuple=True)[0]
    logits_rows = dense.compute_logits_lm(self, hidden[sel])
    col_index = torch.full((L,), -1, dtype=torch.long, device=hidden.device)
    col_index[keep_cols] = torch.arange(keep_cols.numel(), device=hidden.device)
    logits = logits_rows.new_zeros((B, keep_cols.numel(), logits_rows.shape[-1]))
    logits = logits.index_put((p.rows[sel], col_index[p.cols[sel]]), logits_rows)
    loss = None
    if labels is not None:
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
    return CausalLMOutputWithPast(loss=loss, logits=logits)


def _base_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                  inputs_embeds=None, use_cache=None, **kwargs):
    from transformers.modeling_outputs import BaseModelOutputWithPast

    lm = self._bitmatch_lm
    p, hidden = _patched_run(lm, input_ids, attention_mask, position_ids, past_key_values, inputs_embeds,
                             use_cache, kwargs)
    B, L = (input_ids[None] if input_ids.dim() == 1 else input_ids).shape
    out = hidden.new_zeros((B, L, hidden.shape[-1])).index_put((p.rows, p.cols), hidden)
    return BaseModelOutputWithPast(last_hidden_state=out)


def _layer_forward(self, hidden_states=None, residual=None, cos=None, sin=None, *, bm: LayerCall | None = None,
                   **kwargs):
    if bm is None:
        raise RuntimeError("bitmatch: a patched decoder layer runs only inside bitmatch's forward "
                           "(call the causal LM, bitmatch.token_logprobs or bitmatch.models.forward_hidden)")
    return dense.decoder_layer(self, hidden_states, residual, cos, sin, bm=bm)


def _mlp_forward(self, x):
    return dense.mlp(self, x, self.__dict__.get("_bitmatch_cd") or self.gate_proj.weight.dtype)


def _norm_forward(self, x):
    return dense.rms_norm(self, x, self.__dict__.get("_bitmatch_cd") or self.weight.dtype)


def _attn_forward(self, *args, **kwargs):
    raise RuntimeError("bitmatch: a patched attention module runs only inside bitmatch's forward "
                       "(it needs the packed ForwardContext); call the causal LM instead")


def _bind(mod, fn, lm):
    if getattr(mod, _PATCHED, False):
        return
    saved = mod.__dict__.get("forward", None)
    setattr(mod, _SAVED, saved)
    mod.forward = types.MethodType(fn, mod)
    object.__setattr__(mod, _PATCHED, True)
    object.__setattr__(mod, "_bitmatch_cd", getattr(lm, "_bitmatch_compute_dtype", None))


def patch(model, compute_dtype: torch.dtype | None = None):
    """Rebind ``model``'s forwards onto bitmatch kernels (in place); returns ``model``.

    ``model`` may be wrapped (DDP, FSDP, PEFT, torch.compile): the causal LM inside is found.
    ``compute_dtype``: cast each weight to this dtype at use (e.g. fp32 master weights with
    bf16 compute, through ``bitmatch.precision.compute_cast``); default: the parameters' dtype.
    Raises ValueError for an unsupported architecture.
    """
    lm = unwrap_causal_lm(model)
    dense.check_supported(lm)
    dense.model_spec(lm)
    if compute_dtype is not None and compute_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"patch: compute_dtype must be torch.bfloat16 or torch.float32, got {compute_dtype}")
    if compute_dtype is None:  # the kernels would meet e.g. fp16 only later, inside a norm: refuse now
        bad = sorted({str(p.dtype) for p in lm.parameters()
                      if p.is_floating_point() and p.dtype not in (torch.bfloat16, torch.float32)})
        if bad:
            raise ValueError(f"patch: the model's parameters are {', '.join(bad)}, but bitmatch computes in "
                             "bf16 or fp32: load it with dtype=torch.bfloat16 (or torch.float32), call "
                             "model.to(torch.bfloat16), or pass patch(model, compute_dtype=torch.bfloat16)")
    object.__setattr__(lm, "_bitmatch_compute_dtype", compute_dtype)
    _bind(lm, _causal_forward, lm)
    object.__setattr__(lm.model, "_bitmatch_lm", lm)
    _bind(lm.model, _base_forward, lm)
    _bind(lm.model.norm, _norm_forward, lm)
    for layer in lm.model.layers:
        _bind(layer, _layer_forward, lm)
        _bind(layer.self_attn, _attn_forward, lm)
        _bind(layer.mlp, _mlp_forward, lm)
        _bind(layer.input_layernorm, _norm_forward, lm)
        _bind(layer.post_attention_layernorm, _norm_forward, lm)
        for n in ("q_norm", "k_norm"):
            if hasattr(layer.self_attn, n):
                _bind(getattr(layer.self_attn, n), _norm_forward, lm)
    for mod in lm.modules():  # patching again with another compute dtype updates it everywhere
        if getattr(mod, _PATCHED, False):
            object.__setattr__(mod, "_bitmatch_cd", compute_dtype)
    return model


def _unbind(mod):
    if not getattr(mod, _PATCHED, False):
        return
    saved = mod.__dict__.get(_SAVED, None)
    if saved is None:
        del mod.__dict__["forward"]
    else:
        mod.forward = saved
    for a in (_SAVED, _PATCHED, "_bitmatch_cd", "_bitmatch_lm"):
        mod.__dict__.pop(a, None)


def unpatch(model):
    """Undo ``patch``: every module's own forward again (parameters untouched); returns ``model``."""
    lm = unwrap_causal_lm(model)
    for mod in lm.modules():
        _unbind(mod)
    lm.__dict__.pop("_bitmatch_compute_dtype", None)
    return model


def is_patched(model) -> bool:
    return bool(getattr(unwrap_causal_lm(model), _PATCHED, False))
