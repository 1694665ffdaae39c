"""``publish``: the one entry of the sending side, whatever the transport (``to=``).

Apart from the package's ``__init__`` so that the rollout copy (which the ``__init__`` imports)
imports it at its top like every other module does.
"""
from __future__ import annotations

import torch

from bitmatch.models.fp8_mode import check_quantization
from bitmatch.models.registry import patch_state

from .fingerprint import Manifest
from .receiver import Receiver
from .transport_inprocess import InProcessSender
from .transport_tcp import TcpSender
from .version import check_version


def publish(model, version: int, *, to, dtype: torch.dtype = torch.bfloat16,
            quantization: str | None = None) -> Manifest:
    """Publish ``model``'s weights (nn.Module, dict or (name, tensor) pairs; fp32 master or already
    compute dtype) as ``version`` through ``to``: a Receiver in this process, or a sender
    (InProcessSender, TcpSender, IpcSender, ``bitmatch.adapters.vllm.VllmColocateSender``). Returns
    the committed Manifest; raises (SyncError, FingerprintMismatchError, ValueError,
    AuthenticationError) if the receiver did not switch, in which case it still holds its previous
    version.
    ``quantization`` (default: the one ``bitmatch.patch`` set on ``model``): the trainer's mode, which
    the receiver must share (its engine re-quantizes the cast weights to FP8; the manifest records it).
    Invariance: the bytes the engine ends up with are compute_cast(w, dtype), checked by fingerprint."""
    version = check_version(version, "publish")
    if quantization is None and isinstance(model, torch.nn.Module):  # the trainer's own mode (bitmatch.patch)
        st = patch_state(model)
        quantization = None if st is None else st.quantization
    check_quantization(quantization, "publish")
    if isinstance(to, Receiver):
        to = InProcessSender(to)
    if not callable(getattr(to, "send", None)):
        raise TypeError(f"publish: to= takes a Receiver (bitmatch.sync.receive(model) on the engine's model) or "
                        f"a sender (InProcessSender, TcpSender, IpcSender, bitmatch.adapters.vllm.VllmColocateSender), "
                        f"got {type(to).__name__}")
    weights = model.named_parameters() if isinstance(model, torch.nn.Module) else \
        model.items() if isinstance(model, dict) else ()  # other iterables are read once, by the send
    half = next((n for n, w in weights if isinstance(w, torch.Tensor) and w.dtype == torch.float16), None)
    if half is not None:  # an fp16 trainer's own forward is refused: so is its publish
        raise ValueError(f"publish: the weights are torch.float16 ({half!r}), but bitmatch computes in bf16 or "
                         "fp32: train with fp32 master weights or bf16 ones (model.to(torch.bfloat16)) and "
                         "publish those")
    if quantization is None:
        return to.send(model, version, dtype)
    if not isinstance(to, (InProcessSender, TcpSender)):   # IpcSender is a TcpSender
        raise ValueError(f"publish: quantization={quantization!r} travels through InProcessSender, TcpSender and "
                         f"IpcSender (to a receive(engine_model, quantization={quantization!r})), not through "
                         f"{type(to).__name__} yet (docs/fp8.md, FP8 mode)")
    return to.send(model, version, dtype, quantization=quantization)
