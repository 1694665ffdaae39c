"""The stock side of "bitmatch vs the same engine on stock ops": ``stock_ops()``, the op table's stock ops.

``stock_ops()``: the bitmatch engine on stock ops (cuBLAS F.linear, torch norms / activation /
rotary as HF writes them, SDPA attention over K/V gathered from the paged cache, fp32
log_softmax(logits / T)), for benchmarks/engine/gpu_e2e.py's and engine_cpu.py's "same engine with
stock ops" baseline: the op table's stock counterparts (``kernels/stock.py``) swapped in by
``kernels.override``, so every caller, the engine's sampler included, reaches them inside the block."""
import bitmatch.kernels as K
from bitmatch.kernels.table import stock_for

# the ops of a dense engine step; the sampling ops stay canonical (the baseline is the forward's
# and the logprobs' kernels, not a per-request generator loop)
BASELINE = ("linear", "rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_cos_sin", "apply_rotary",
            "attention_prefill", "attention_paged", "write_kv_cache", "token_logprobs", "full_logprobs")


def stock_ops(names=BASELINE):
    """Inside the block the ops ``names`` (default ``BASELINE``) are their stock counterparts;
    yields {op: the bitmatch function replaced}."""
    return K.override(stock_for(names))
