"""Triton backend of bitmatch.kernels (CUDA; also runs under TRITON_INTERPRET=1 on CPU).

One module per op family; the lead's kernels/*.py validate inputs, make them contiguous and
call the function of the same name here:

- linear.linear(x2d, weight, bias)                       -> [M, N]
- norm.rms_norm(x2d, weight, eps), norm.fused_add_rms_norm(x2d, res2d, weight, eps)
- rotary.apply_rotary(q, k, cos, sin)                    -> (q, k)
- activation.silu_and_mul(x2d)                           -> [M, I]
- attention.attention_prefill(...), attention.attention_paged(...)
- logprobs.token_logprobs(logits2d, token_ids, temperature), logprobs.full_logprobs(...)
- sampling.categorical_sample(logits2d, temperature, uniforms, greedy, bits) -> int64 [N]

Canonical orders (what fixes the bits; anything else is free to tune). Every switch named here
is a field of the active ``kernels.order.current()``, read at launch, so the sync stamp follows it:
- linear: dot over K = ordered fp32 sum of SPLIT fixed K chunks (SPLIT fixed per weight shape,
  see linear.split_for), each chunk a sequential tensor-core accumulation from zero.
- attention: KV walked from position 0 in blocks of ``kv_block`` (64) positions, online softmax
  inside fixed partitions of ``kv_partition`` (512) positions, partitions merged in order.
  Fully masked blocks/partitions are exact no-ops, so they may be skipped.
- norms / logprobs: one program per row, block width and warps fixed by the row length.

Interpreter note: under TRITON_INTERPRET=1 (CPU tensors), tl.dot on bf16 returns garbage, so
kernels take a constexpr INTERP that computes each block dot in float64 (exact for bf16
products) and rounds it to fp32: structure (tiling, masking, walk order) is what CPU tests check.
"""
import os

import torch


def interpreting(t: torch.Tensor) -> bool:
    """True when kernels run in Triton's CPU interpreter (CPU tensors)."""
    if t.device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise RuntimeError(
                "bitmatch.kernels.triton: CPU tensors need TRITON_INTERPRET=1 set before triton "
                "is imported (Triton's interpreter); use the reference backend otherwise")
        return True
    return False


def _patch_interpreter_for_numpy2():
    """Triton 3.6's interpreter converts scalar tensors with int(ndarray); numpy >= 2.4 refuses
    that for 1-element arrays of ndim > 0 (e.g. `range(0, n, BK)` with a runtime n fails).
    Wrap its tensor patcher so __index__ uses .item(). Interpreter only; no effect on CUDA."""
    try:
        from triton.runtime import interpreter as _it
    except Exception:  # pragma: no cover
        return
    if getattr(_it, "_bitmatch_patched", False):
        return
    orig = _it._patch_lang_tensor

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _it._patch_lang_tensor = patched
    _it._bitmatch_patched = True


if os.environ.get("TRITON_INTERPRET", "0") == "1":
    _patch_interpreter_for_numpy2()

_SM_COUNT = {}


def sm_count(device) -> int:
    """Streaming multiprocessors of ``device`` (4 for the CPU interpreter): sizes persistent grids
    and split decisions, launch knobs that never change bits."""
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


__all__ = ["interpreting", "sm_count"]
