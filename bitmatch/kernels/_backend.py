"""Backend choice and input checks shared by every op.

CUDA tensors go to the Triton backend, CPU tensors to the reference; ``use_backend`` forces
one (tests run the Triton kernels in the interpreter on CPU tensors). There is no fallback:
a backend that lacks an op raises an error naming the op.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import threading

import torch

SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)
BACKENDS = ("reference", "triton")
_state = threading.local()


@contextlib.contextmanager
def use_backend(name: str | None):
    """Force every op inside the block onto backend ``name`` ("reference" or "triton")."""
    if name is not None and name not in BACKENDS:
        raise ValueError(f"use_backend: name must be one of {BACKENDS} or None, got {name!r}")
    prev = getattr(_state, "forced", None)
    _state.forced = name
    try:
        yield
    finally:
        _state.forced = prev


def backend_for(t: torch.Tensor) -> str:
    """The backend an op on tensor ``t`` runs on."""
    forced = getattr(_state, "forced", None)
    if forced is not None:
        if forced == "triton" and t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("the triton backend on CPU tensors needs TRITON_INTERPRET=1")
        if forced == "reference" and t.device.type != "cpu":
            raise RuntimeError("the reference backend runs on CPU tensors only")
        return forced
    if t.device.type == "cuda":
        return "triton"
    if t.device.type == "cpu":
        return "reference"
    raise ValueError(f"bitmatch.kernels: device {t.device} is not supported (cpu or cuda)")


def host_readable(t: torch.Tensor) -> bool:
    """True when an op may read ``t``'s values on the host for free: a CPU tensor on the
    reference backend. Anywhere else (CUDA; the Triton backend forced onto CPU tensors, where the
    interpreter stands for the GPU) a read is a host sync that stalls every later launch until
    the device drains: value checks go to the device instead (``check_on_device``)."""
    return t.device.type == "cpu" and getattr(_state, "forced", None) != "triton"


def check_on_device(cond: torch.Tensor, message: str) -> None:
    """Assert the bool tensor ``cond`` without reading it back: a device-side assert on CUDA
    (fatal to the CUDA context, like an out-of-range index in the op it guards), a RuntimeError
    with ``message`` on CPU."""
    torch._assert_async(cond, message)


def check_in_range(t: torch.Tensor, lo: int, hi: int, message: str) -> None:
    """``check_on_device`` that every element of the integer tensor ``t`` is in [lo, hi): on the
    Triton backend one reduction launch (kernels/triton/checks.py) feeds the assert."""
    if not t.numel():
        return
    if backend_for(t) == "triton":
        ok = triton_impl("checks", "in_range")(t, lo, hi)
    else:
        ok = ((t >= lo) & (t < hi)).all()
    check_on_device(ok, message)


def triton_impl(family: str, op: str):
    """The Triton implementation of ``op``; NotImplementedError if there is none."""
    try:
        mod = importlib.import_module(f"bitmatch.kernels.triton.{family}")
    except ImportError as exc:
        raise NotImplementedError(
            f"bitmatch.kernels.{op}: the Triton backend could not be imported ({exc}); "
            "install triton (pip install bitmatch[triton]) or run on CPU tensors") from exc
    fn = getattr(mod, op, None)
    if fn is None:
        raise NotImplementedError(f"bitmatch.kernels.{op}: no Triton implementation yet; "
                                  "run on CPU tensors (reference backend)")
    return fn


def check_float(name: str, t: torch.Tensor, op: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{op}: {name} has dtype {t.dtype}; supported: bfloat16, float32")


def check_same_device(op: str, **tensors) -> None:
    devs = {k: v.device for k, v in tensors.items() if isinstance(v, torch.Tensor)}
    if len(set(devs.values())) > 1:
        raise ValueError(f"{op}: tensors are on different devices: {devs}")


def check_int(name: str, t: torch.Tensor, op: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: {name} must be an int32/int64 tensor")


def needs_autograd(*tensors) -> bool:
    """True when autograd records this call; otherwise ops skip the autograd.Function (engine
    steps run under no_grad, and the Function's bookkeeping is pure host time there)."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def recompute_grads(plain_fn, inputs, needs, grads):
    """Gradients by re-running a plain differentiable fp32 version of the op: the reference
    (CPU) backends' backward. Backward passes need correct gradients, not invariant ones; the
    Triton backend has its own fused backward kernels (kernels/triton/*_backward)."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(bool(n)) if isinstance(t, torch.Tensor) and t.is_floating_point()
                  else t for t, n in zip(inputs, needs)]
        outs = plain_fn(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        wanted = [t for t, n in zip(leaves, needs) if n]
        if not pairs or not wanted:
            return [None] * len(inputs)
        got = torch.autograd.grad([o for o, _ in pairs], wanted, [g.to(o.dtype) for o, g in pairs],
                                  allow_unused=True)
    it = iter(got)
    res = []
    for t, n in zip(inputs, needs):
        g = next(it) if n else None
        res.append(g.to(t.dtype) if g is not None else None)
    return res
