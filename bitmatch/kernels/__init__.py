"""bitmatch.kernels: invariant ops. One public function per op; the backend (Triton for
CUDA tensors, the float64-exact reference for CPU tensors) is chosen per call, never a
silent fallback. See each module's docstring for its canonical reduction order; ``kernels/table.py``
declares every op (invariance axes, stock counterpart, backends, order version) and ``override``."""
from ._backend import SUPPORTED_DTYPES, backend_for, check_on_device, host_readable, use_backend
from .activation import silu_and_mul
from .attention import attention_decode, attention_paged, attention_prefill, write_kv_cache
from .compressed_attention import KeyRows, sink_attention, sink_attention_rows
from .compressor import compress_rows, compress_windows
from .fp8 import fp8_linear, fp8_linear_master, quantize_fp8_groups
from .indexer import indexer_select, indexer_topk
from .linear import linear
from .logprobs import full_logprobs, token_logprobs
from .mamba import causal_conv1d, gated_rms_norm, mamba_chunk_scan
from .mhc import hc_head, hc_post, hc_pre
from .moe import moe_combine, moe_experts, moe_route, moe_scores
from .norm import fused_add_rms_norm, rms_norm
from .rotary import SUPPORTED_ROPE_TYPES, apply_rotary, rotary_cos_sin
from .rotary_interleaved import apply_rotary_interleaved
from .sampling import apply_top_k_top_p, categorical_sample, top_k_top_p_mask, uniform_noise

# last: the op table reads the ops above from their modules; override swaps them on this package
from .table import OPS, override

__all__ = [
    "linear", "rms_norm", "fused_add_rms_norm", "rotary_cos_sin", "apply_rotary", "silu_and_mul",
    "fp8_linear", "fp8_linear_master", "quantize_fp8_groups",
    "attention_prefill", "attention_paged", "attention_decode", "write_kv_cache",
    "token_logprobs", "full_logprobs", "top_k_top_p_mask", "apply_top_k_top_p", "categorical_sample",
    "uniform_noise", "use_backend", "backend_for", "host_readable", "check_on_device", "SUPPORTED_DTYPES",
    "SUPPORTED_ROPE_TYPES",
    "moe_route", "moe_scores", "moe_experts", "moe_combine",
    "sink_attention", "sink_attention_rows", "KeyRows", "compress_windows", "compress_rows", "indexer_topk",
    "indexer_select",
    "hc_pre", "hc_post", "hc_head",
    "apply_rotary_interleaved",
    "causal_conv1d", "mamba_chunk_scan", "gated_rms_norm",
    "OPS", "override",
]
