"""FP8 mode: a family's projection linears on block-FP8 weights (W8A8), the trainer and the engine alike.

``quantization="fp8"`` (``token_logprobs``, ``patch``, ``EngineConfig``) rides in the step's
``ForwardContext``; the dense decoder layer (which Qwen3-MoE shares) enters ``projections`` with
it, so a gradient-checkpointed layer recomputed in backward runs in the mode of its forward. Inside,
``dense.linear`` hands every projection (q/k/v/o, gate/up/down) to ``linear`` below:

- trainer (autograd or not): ``kernels.fp8_linear_master(x, cast(W))``, the master weight cast to
  the compute dtype (the bytes a weight sync ships) and quantized by ``quantize_fp8_blocks``, with
  straight-through gradients to the master weight;
- engine step (``lora.kept_on``: a paged step without autograd): ``kernels.fp8_linear`` on FP8
  bytes + scales kept on the module (``quantize_fp8_blocks`` of the same cast weight, keyed on the
  weight's pointer and version counter and refilled in place, as the fused copies: an optimizer
  step or a sync re-quantizes, a captured graph keeps its addresses). The engine keeps no bf16
  copy of a projection: the cast lives only while it is quantized.

Each HF projection is quantized on its own (the checkpoint's and the sync's unit): q/k/v and gate/up
are not fused in FP8 mode, so a 128-row block never straddles two projections on either side.
Qwen3-MoE's routed experts run ``experts`` below (each expert's weights quantized per expert).
The LM head, the embeddings, the norms and the MoE router (fp32) stay in the compute dtype
(docs/fp8.md, "FP8 mode").
"""
from __future__ import annotations

import contextlib
import threading

import torch

import bitmatch.kernels as K
from bitmatch.kernels.fp8 import quantize_fp8_blocks
from bitmatch.models import lora
from bitmatch.models.registry import tp_shard
from bitmatch.models.state import create_state, get_state
from bitmatch.precision import cast_param, compute_cast

QUANTIZATIONS = (None, "fp8")
_KEPT = "fp8:"   # + the parameter's name: a module's ModelState.derived slot, {dtype: [key, q, scale]}
_mode = threading.local()


def check_quantization(quantization, who: str):
    """``quantization`` if bitmatch reproduces it (None or "fp8"), else ValueError naming ``who``."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"{who}: quantization={quantization!r} is not supported: None (weights in the compute "
                         "dtype) or 'fp8' (block-FP8 W8A8 projections: 128 x 128 weight blocks, per-token 128-wide "
                         "activation groups, fp32 scales; docs/fp8.md). Other formats (per-tensor scales, static "
                         "activation scales, other block sizes, FP4, int8) are not reproduced")
    return quantization


def check_model(lm, family, quantization, who: str) -> None:
    """Refuse, by name, a model FP8 mode does not run: a family not wired for it, PEFT LoRA layers
    (their merged weight is not quantized on both sides yet), a tensor-parallel shard."""
    if quantization is None:
        return
    if quantization not in family.quantizations:
        raise ValueError(f"{who}: quantization={quantization!r} is not wired for the {family.name!r} family "
                         f"({', '.join(family.architectures)}): FP8 mode runs the dense family (Qwen2, Qwen3, Llama, "
                         "Mistral) and Qwen3-MoE (docs/fp8.md); use quantization=None")
    lora_layer = next((n for n, m in lm.named_modules() if hasattr(m, "lora_A")), None)
    if lora_layer is not None:
        raise ValueError(f"{who}: quantization={quantization!r} with PEFT LoRA layers ({lora_layer}) is not "
                         "supported: merge the adapters first (peft merge_and_unload) or use quantization=None")
    if tp_shard(lm) is not None:
        raise ValueError(f"{who}: quantization={quantization!r} with tensor parallelism is not supported; run one "
                         "process (or quantization=None)")


@contextlib.contextmanager
def projections(quantization):
    """Inside the block, ``dense.linear`` runs the projections in ``quantization`` (None: as given)."""
    prev = getattr(_mode, "q", None)
    _mode.q = quantization
    try:
        yield
    finally:
        _mode.q = prev


def active() -> bool:
    """Whether the current layer runs its projections in FP8 (``projections("fp8")``)."""
    return getattr(_mode, "q", None) == "fp8"


def linear(mod, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``mod`` (an nn.Linear) on ``x`` in FP8: the trainer's ``fp8_linear_master`` or, in an engine
    step, ``fp8_linear`` on the kept bytes; the same bits (one quantizer of one cast weight)."""
    if hasattr(mod, "base_layer") or hasattr(mod, "lora_A"):
        raise ValueError(f"bitmatch: FP8 mode does not run PEFT LoRA layers ({type(mod).__name__}); merge the "
                         "adapters first or use quantization=None")
    bias = cast_param(getattr(mod, "bias", None), dtype)
    if lora.kept_on():
        q, s = kept_weight(mod, dtype)
        return K.fp8_linear(x, q, s, bias)
    return K.fp8_linear_master(x, cast_param(mod.weight, dtype), bias)


def experts(ex, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """HF's stacked SwiGLU experts (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) in FP8: each
    (token, rank) row through its expert's ``gate_up`` FP8 linear, ``silu_and_mul``, its ``down`` FP8
    linear, then ``moe_combine`` (fp32, rank order). Each expert weight is quantized per expert in
    128 x 128 blocks (``quantize_fp8_blocks`` of the stacked tensor: the same blocks as expert by
    expert). Invariance: a token's bits depend only on its row, its routing and the expert weights
    (the FP8 linear is row-invariant). The loop over the routed experts reads them on the host: FP8
    MoE steps are not captured in CUDA graphs (``capturable``)."""
    T, H = x.shape
    k = ids.shape[1]
    flat = ids.reshape(-1)
    kept = lora.kept_on()
    if kept:
        (gq, gs), (dq, ds) = kept_weight(ex, dtype, name="gate_up_proj"), kept_weight(ex, dtype, name="down_proj")
    else:
        gu, dn = cast_param(ex.gate_up_proj, dtype), cast_param(ex.down_proj, dtype)
    y = x.new_zeros(T * k, H)
    for e in torch.unique(flat).tolist():
        pos = (flat == e).nonzero().squeeze(1)
        xe = x.index_select(0, pos // k)
        if kept:
            ye = K.fp8_linear(K.silu_and_mul(K.fp8_linear(xe, gq[e], gs[e])), dq[e], ds[e])
        else:
            ye = K.fp8_linear_master(K.silu_and_mul(K.fp8_linear_master(xe, gu[e])), dn[e])
        y = y.index_put((pos,), ye)
    return K.moe_combine(y.view(T, k, H), weights.float())


def capturable(lm) -> bool:
    """Whether FP8 mode's forward of ``lm`` may be captured in a CUDA graph: not with stacked experts,
    whose loop (``experts``) reads the routed expert ids on the host."""
    return not any(hasattr(m, "gate_up_proj") for m in lm.modules())


def _fill(entry, w: torch.Tensor, dtype: torch.dtype, key) -> None:
    with torch.no_grad():
        q, s = quantize_fp8_blocks(compute_cast(w.detach(), dtype))   # the cast is dropped here
        if entry[1] is not None and entry[1].shape == q.shape and entry[2].shape == s.shape:
            entry[1].copy_(q)   # in place: a captured graph reads these addresses
            entry[2].copy_(s)
        else:
            entry[1], entry[2] = q, s
    entry[0] = key


def kept_weight(mod, dtype: torch.dtype, force: bool = False, name: str = "weight") -> tuple[torch.Tensor,
                                                                                             torch.Tensor]:
    """(FP8 bytes, fp32 block scales) of ``quantize_fp8_blocks(compute_cast(mod.<name>, dtype))``,
    kept on the module and refilled in place when the weight's pointer or version counter moves
    (``force``: always). Invariance: the very bytes ``fp8_linear_master`` quantizes in the trainer."""
    w = getattr(mod, name)
    key = (w.data_ptr(), w._version)
    entry = create_state(mod).derived.setdefault(_KEPT + name, {}).setdefault(dtype, [None, None, None])
    if force or entry[0] != key:
        _fill(entry, w, dtype, key)
    return entry[1], entry[2]


def kept_weights_of(mod, name: str = "weight") -> dict:
    """``{dtype: (q, scale)}`` the engine keeps of ``mod``'s parameter ``name`` (empty if none)."""
    st = get_state(mod)
    return {} if st is None else {dt: (e[1], e[2]) for dt, e in st.derived.get(_KEPT + name, {}).items()}


def refresh(lm, force: bool = False) -> None:
    """Re-quantize, in place, every kept FP8 weight of ``lm`` whose master moved (``force``: all);
    before a graph replay and whenever the engine starts work. ``lora.drop_kept_weights`` drops them."""
    for m in lm.modules():
        st = get_state(m)
        for slot in [] if st is None else [k for k in st.derived if k.startswith(_KEPT)]:
            for dtype in list(st.derived[slot]):
                kept_weight(m, dtype, force, name=slot[len(_KEPT):])


__all__ = ["QUANTIZATIONS", "check_quantization", "check_model", "projections", "active", "linear", "experts",
           "capturable", "kept_weight", "kept_weights_of", "refresh"]
