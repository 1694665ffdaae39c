"""The one cast from master weights to compute weights.

The trainer's forward and every weight publish call this function, so the rollout engine
holds exactly the bits the trainer computes with.
"""
from __future__ import annotations

import torch

SUPPORTED_COMPUTE_DTYPES = (torch.bfloat16, torch.float32)


def unsupported_dtype_message(who: str, found, how: str) -> str:
    """The one sentence for a model whose weights bitmatch cannot compute in (fp16): what ``who`` found,
    what bitmatch computes in, and the fixes, ``how`` being the caller's own option."""
    return (f"{who}: the model's parameters are {found}, but bitmatch computes in bf16 or fp32: load it with "
            f"dtype=torch.bfloat16 (or torch.float32), call model.to(torch.bfloat16), or {how}")


def compute_cast(t: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Round ``t`` to ``dtype`` (round to nearest, ties to even); a no-op if already there.

    Invariance: elementwise and exact-rounded, so the bits depend on each element alone.
    """
    if dtype not in SUPPORTED_COMPUTE_DTYPES:
        raise ValueError(f"compute_cast: dtype must be one of {SUPPORTED_COMPUTE_DTYPES}, got {dtype}")
    if t.dtype == dtype:
        return t
    if t.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        raise ValueError(f"compute_cast: tensor dtype {t.dtype} is not a floating type")
    return t.to(dtype)


# Set by bitmatch.models.lora (set_kept_cast): inside an engine step that reads kept weights, a
# parameter's cast kept between steps (same bits, refreshed in place), not a fresh cast per call.
_kept_cast = None


def set_kept_cast(fn) -> None:
    """Register ``fn(param, dtype) -> tensor | None``: the kept cast ``cast_param`` returns for a
    parameter when ``fn`` gives one (bitmatch.models.lora's engine-step casts)."""
    global _kept_cast
    _kept_cast = fn


def cast_param(p: torch.Tensor | None, dtype: torch.dtype):
    """``compute_cast`` of a parameter at use (None stays None): fp32 master, bf16 compute."""
    if p is None or p.dtype == dtype:
        return p
    if _kept_cast is not None and isinstance(p, torch.nn.Parameter):
        kept = _kept_cast(p, dtype)
        if kept is not None:
            return kept
    return compute_cast(p, dtype)
