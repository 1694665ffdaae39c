"""The embedded engine's settings: one dataclass, validated in one place, under vLLM's names.

``Engine(model, max_num_seqs=8)`` and ``Engine(model, config=EngineConfig(max_num_seqs=8))`` are the
same engine; the config is printed in errors and written into benchmark JSON (``asdict``). Checks
that need the model (``max_model_len`` against its positions, prefix caching against its cache
groups, the KV budget against its block size) stay in ``Engine``; everything else is here.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from bitmatch.models.fp8_mode import check_quantization

# vLLM engine arguments the engine refuses, each with the fix (what a vLLM user would try first)
VLLM_REFUSED = {
    "tensor_parallel_size": "shard the model with bitmatch.parallel.enable_tensor_parallel(model, ...) before Engine",
    "pipeline_parallel_size": "pipeline parallelism is not supported",
    "data_parallel_size": "run one Engine per data-parallel rank",
    "dtype": "load or cast the model in the dtype (torch.bfloat16 / torch.float32), or "
             "bitmatch.patch(model, compute_dtype=...)",
    "kv_cache_dtype": "the KV cache is kept in the compute dtype (its bits are the trainer's)",
    "max_num_partial_prefills": "chunked prefill interleaves any number of prefills",
    "swap_space": "preemption recomputes (same bits); nothing is swapped to the host",
    "cpu_offload_gb": "weights are the module's own tensors, where the module keeps them",
    "num_gpu_blocks_override": "use num_gpu_blocks",
    "speculative_config": "speculative decoding is not supported",
    "enable_lora": "PEFT LoRA models run as they are (the engine reads their merged weights)",
    "trust_remote_code": "pass a loaded module (Engine(model)) or a checkpoint of a registered family",
    "tokenizer_mode": "pass the tokenizer object (Engine(model, tokenizer))",
}


def positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"Engine: {name} must be an int >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class EngineConfig:
    """What ``Engine`` takes besides the model and tokenizer (see ``Engine`` for each meaning).

    KV budget: ``num_gpu_blocks`` blocks or ``kv_cache_bytes`` bytes (not both); by default, on
    CUDA, ``gpu_memory_utilization`` of the device after a profiled step; ``memory_share`` "device"
    (vLLM's rule) or "engine" (the fraction is the engine's own beside a trainer: TRL colocate).
    ``quantization``: None (default: the one ``bitmatch.patch(model, quantization=...)`` set) or
    "fp8": the projections run ``kernels.fp8_linear`` on FP8 bytes + scales the engine quantizes from
    the model's weights (docs/fp8.md, "FP8 mode"); any other value is refused by name."""
    block_size: int = 16
    num_gpu_blocks: int | None = None
    kv_cache_bytes: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = False
    seed: int = 0
    enforce_eager: bool = False
    gpu_memory_utilization: float = 0.9
    max_seq_len_to_capture: int = 8192
    memory_share: str = "device"
    max_model_len: int | None = None
    quantization: str | None = None

    def __post_init__(self):
        check_quantization(self.quantization, "Engine")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_seq_len_to_capture"):
            positive_int(name, getattr(self, name))
        for name in ("num_gpu_blocks", "kv_cache_bytes", "max_model_len"):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name))
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2 ** 64:
            raise ValueError(f"Engine: seed must be an int in [0, 2**64), got {self.seed!r}")
        if self.num_gpu_blocks is not None and self.kv_cache_bytes is not None:
            raise ValueError("Engine: give num_gpu_blocks or kv_cache_bytes, not both")
        u = self.gpu_memory_utilization
        if not isinstance(u, (int, float)) or isinstance(u, bool) or not 0 < u <= 1:
            raise ValueError(f"Engine: gpu_memory_utilization must be in (0, 1], got {u!r}")
        if self.memory_share not in ("device", "engine"):
            raise ValueError(f"Engine: memory_share must be 'device' or 'engine', got {self.memory_share!r}")

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        """The config of ``Engine(model, **kwargs)``: vLLM's refused names with their fix (ValueError),
        any other unknown name a TypeError."""
        refused = [k for k in kwargs if k in VLLM_REFUSED]
        if refused:
            raise ValueError("Engine: " + "; ".join(f"{k}= (vLLM's) is not supported: {VLLM_REFUSED[k]}"
                                                     for k in refused))
        known = {f.name for f in fields(cls)}
        unknown = sorted(k for k in kwargs if k not in known)
        if unknown:
            raise TypeError(f"Engine() got unexpected keyword argument(s) {unknown} (the vLLM engine "
                            "arguments it takes are listed in the Engine docstring)")
        return cls(**kwargs)

    def as_dict(self) -> dict:
        return asdict(self)
