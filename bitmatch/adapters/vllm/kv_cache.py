"""bitmatch's own plain layout inside the KV cache tensor vLLM allocates for each layer.

vLLM hands every attention layer a logical ``[num_blocks, num_kv_heads, block_size, 2*head_dim]``
view (``vllm/v1/kv_cache_layout.py``: the physical order varies by backend and CPU ISA).
bitmatch keeps vLLM's block boundaries (so vLLM's block zeroing and block copies still act on
whole blocks) and, inside each block, stores token-major ``[block_size, 2, num_kv_heads,
head_dim]``: K then V of each slot. Viewed that way the cache is ``k, v: [num_blocks,
block_size, num_kv_heads, head_dim]``, the layout ``kernels.write_kv_cache`` and
``kernels.attention_paged`` take: non-contiguous views (slot stride 2*Hkv*D), which the CPU
reference indexes through and the Triton kernel addresses by the views' strides
(``tests/test_triton_interpret.py::test_attention_paged_strided_cache_views``). vLLM's own
attention kernels never read these bytes (bitmatch replaces the model forward), so the two
layouts never meet.
"""
from __future__ import annotations

import torch

from .checks import BitmatchUnsupportedError


def check_backend(attn) -> None:
    """Refuse attention layers whose cache bitmatch cannot view (e.g. MLA, quantized KV)."""
    kv_dtype = getattr(attn, "kv_cache_dtype", "auto")
    if kv_dtype != "auto":
        raise BitmatchUnsupportedError(f"bitmatch: layer {attn.layer_name} has kv_cache_dtype={kv_dtype!r}")
    if getattr(attn, "kv_sharing_target_layer_name", None) is not None:
        raise BitmatchUnsupportedError(f"bitmatch: layer {attn.layer_name} shares another layer's KV cache")
    if getattr(attn, "head_size_v", attn.head_size) != attn.head_size:
        raise BitmatchUnsupportedError(f"bitmatch: layer {attn.layer_name} has a different V head size")


def _block_is_dense(kv: torch.Tensor) -> bool:
    """True when each block's elements fill one contiguous range (in any order of the logical
    dims: NHD or HND), and blocks do not overlap. Blocks need not follow each other: vLLM's
    cross-layer layout puts the other layers' blocks between them."""
    dims = sorted(zip(kv.stride()[1:], kv.shape[1:]))
    expect = 1
    for stride, size in dims:
        if size > 1 and stride != expect:
            return False
        expect *= size
    return kv.shape[0] == 1 or kv.stride(0) >= expect


def paged_kv_views(attn) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache), each ``[num_blocks, block_size, num_kv_heads, head_dim]``, over the
    layer's vLLM cache tensor (views: writes land in vLLM's memory)."""
    kv = attn.kv_cache
    heads, d = attn.num_kv_heads, attn.head_size
    if kv.dim() != 4 or kv.shape[1] != heads or kv.shape[3] != 2 * d or not _block_is_dense(kv):
        raise BitmatchUnsupportedError(
            f"bitmatch: KV cache of {attn.layer_name} has shape {tuple(kv.shape)} strides {kv.stride()}; expected "
            f"a logical [blocks, {heads}, block_size, {2 * d}] view with each block contiguous (a layer-major "
            "vLLM KV layout). The layouts measured bitwise are those of vLLM's FLASH_ATTN backend (GPU) and its CPU "
            "backend: choose it with LLM(..., attention_backend='FLASH_ATTN')")
    nb, bs = kv.shape[0], kv.shape[2]
    v = torch.as_strided(kv, (nb, bs, 2, heads, d), (kv.stride(0), 2 * heads * d, heads * d, d, 1),
                         kv.storage_offset())
    return v[:, :, 0], v[:, :, 1]
