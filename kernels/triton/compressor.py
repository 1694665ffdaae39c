"""compress_windows on the Triton backend (CUDA; TRITON_INTERPRET=1 on CPU), composed of
elementwise fp32 ops and fixed folds, so it runs on any device without a kernel of its own.

Canonical order (this backend's bits): z = fp32(gate) + bias; p = exp(z - max) / fold(exp) in
fp32 (``torch.exp``: one correctly-defined value per element, no dependence on the launch);
entry = round_dtype(fold_slots(fp32(kv) * fp32(round_dtype(p)))). ``fold`` is ``_exact.tree_sum``:
fold-in-halves over the fixed slot axis (m or 2m) by elementwise adds, so an entry's bits depend
on its window's rows alone, whatever the number of windows in the call.
"""
import torch

from .._exact import tree_sum
from ..compressor import pooling_slots


def compress_windows(kv, gate, bias, prev_kv, prev_gate, has_prev):
    kv_all, z, valid = pooling_slots(kv, gate, bias, prev_kv, prev_gate, has_prev)
    if valid is not None:
        z = torch.where(valid, z, -torch.inf)
    e = torch.exp(z - z.amax(1, keepdim=True))
    if valid is not None:
        e = torch.where(valid, e, 0.0)
    p = (e / tree_sum(e, 1).unsqueeze(1)).to(kv.dtype)
    return tree_sum(kv_all.float() * p.float(), 1).to(kv.dtype)
