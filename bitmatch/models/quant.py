"""Block-quantized checkpoints (DeepSeek FP8 / FP4) dequantized to a plain bf16 HF model at load time.

The format, as transformers 5.19 reads it (``quantizers/quantizer_finegrained_fp8.py``,
``integrations/finegrained_fp8.py`` ``Fp8Quantize`` / ``Fp8Dequantize``, ``integrations/mxfp4.py``):

- ``config.quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
  "activation_scheme": "dynamic", "scale_fmt": "ue8m0" | "float", "modules_to_not_convert": [...]}``.
- FP8 weight ``X.weight``: float8_e4m3fn ``[N, K]`` (leading expert dims allowed) with a per-block
  scale ``X.weight_scale_inv`` (V3 name) or ``X.scale`` (V4 name) of shape
  ``[ceil(N/128), ceil(K/128)]``: ``w[n, k] = q[n, k] * s[n // 128, k // 128]``. The scale is float32
  (``scale_fmt`` "float") or an e8m0 power of two (``scale_fmt`` "ue8m0": float8_e8m0fnu, uint8, or a
  float32 container holding powers of two).
- FP4 experts (``config.expert_dtype == "fp4"``): ``X.weight`` int8 / float4_e2m1fn_x2 ``[N, K/2]``, two
  e2m1 values per byte, element ``2j`` in the low nibble and ``2j+1`` in the high one; ``X.scale`` e8m0
  ``[N, K/32]`` (one scale per 32 consecutive K values): ``w[n, k] = e2m1(q[n, k]) * 2**(s[n, k // 32] - 127)``.

``load_dequantized`` reads every shard through safetensors' mmap and dequantizes one tensor at a time
as transformers' loader asks for it, so the quantized model is never held twice. Each value is
formed exactly in float64 (an e4m3 value has 4 significant bits, a scale at most 24) and rounded once,
to nearest-even, into the load dtype: the bits depend only on the checkpoint, not on the device or the
order of loading. Anything this module cannot read exactly is refused before a weight loads
(``QuantizedCheckpointError``, naming the option and what is supported).
"""
from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from safetensors import safe_open

SUPPORTED_BLOCKS = ((128, 128),)      # every published DeepSeek FP8 checkpoint; others are refused
FP4_GROUP = 32                        # e2m1 values per e8m0 scale along K
E8M0_BIAS = 127
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_SUFFIXES = (".weight_scale_inv", ".scale")
SUPPORTED = ("quant_method='fp8' with fmt='e4m3', weight_block_size=[128, 128], activation_scheme='dynamic', "
             "scale_fmt 'float' or 'ue8m0', and FP4 (e2m1, 32-wide e8m0 scales) experts when "
             "config.expert_dtype='fp4'")
_KNOWN_KEYS = {"quant_method", "fmt", "weight_block_size", "activation_scheme", "scale_fmt", "modules_to_not_convert",
               "ignored_layers", "modules_to_convert", "dequantize", "expert_dtype"}
_FP8 = "F8_E4M3"
_FP4_PACKED = ("I8", "U8", "F4")
_E8M0 = ("F8_E8M0", "U8")
_FLOAT_SCALES = ("F32", "F64", "BF16", "F16")


class QuantizedCheckpointError(ValueError):
    """A quantized checkpoint, or one of its options, that bitmatch cannot dequantize exactly."""


@dataclass(frozen=True, slots=True)
class QuantSpec:
    """What ``quantization_config`` (and ``expert_dtype``) declare, once validated."""
    block: tuple[int, int]
    scale_fmt: str
    activation_scheme: str
    expert_fp4: bool
    source: dict

    def note(self) -> dict:
        """The record left on the loaded config (``config.dequantized_from``)."""
        return {**self.source, "expert_dtype": "fp4" if self.expert_fp4 else "fp8",
                "dequantized_by": "bitmatch.models.quant",
                "activations": "not quantized (the forward runs in the load dtype)"}


def _get(cfg, name, default=None):
    return cfg.get(name, default) if isinstance(cfg, dict) else getattr(cfg, name, default)


def quant_spec(config, *, who: str = "load_model") -> QuantSpec | None:
    """The validated quantization of ``config`` (a PretrainedConfig or a config.json dict), None when it
    has none. Raises QuantizedCheckpointError naming every option it cannot read."""
    q = _get(config, "quantization_config")
    if not q:
        return None
    q = q.to_dict() if hasattr(q, "to_dict") else dict(q)
    method = str(q.get("quant_method", ""))
    problems = []
    if method != "fp8":
        raise QuantizedCheckpointError(
            f"{who}: quantization_config.quant_method={method!r} is not read by bitmatch (supported: {SUPPORTED}); "
            "dequantize the checkpoint to bf16 with the tool of its format and pass that folder")
    if q.get("fmt", "e4m3") != "e4m3":
        problems.append(f"fmt={q['fmt']!r} (only 'e4m3')")
    block = q.get("weight_block_size", (128, 128))
    try:
        block = tuple(int(b) for b in block)
    except (TypeError, ValueError):
        block = (block,)
    if block not in SUPPORTED_BLOCKS:
        problems.append(f"weight_block_size={q.get('weight_block_size')!r} (only [128, 128])")
    act = str(q.get("activation_scheme", "dynamic")).lower()
    if act != "dynamic":
        problems.append(f"activation_scheme={act!r} (only 'dynamic': a 'static' checkpoint carries activation "
                        "scales whose FP8 activation forward a bf16 model would silently drop)")
    scale_fmt = q.get("scale_fmt") or "float"
    if scale_fmt not in ("float", "ue8m0"):
        problems.append(f"scale_fmt={scale_fmt!r} (only 'float' or 'ue8m0')")
    expert_dtype = q.get("expert_dtype", _get(config, "expert_dtype", "fp8")) or "fp8"
    if expert_dtype not in ("fp8", "fp4"):
        problems.append(f"expert_dtype={expert_dtype!r} (only 'fp8' or 'fp4')")
    unknown = sorted(set(q) - _KNOWN_KEYS)
    if unknown:
        problems.append(f"unknown quantization_config keys {unknown} (their meaning is not known, so the weights "
                        "could be read wrong)")
    if problems:
        raise QuantizedCheckpointError(f"{who}: cannot dequantize this checkpoint: " + "; ".join(problems)
                                       + f". Supported: {SUPPORTED}")
    return QuantSpec(block=block, scale_fmt=scale_fmt, activation_scheme=act, expert_fp4=expert_dtype == "fp4",
                     source=q)


# ---------------------------------------------------------------------------------------------- math

def round_exact(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (float64) rounded once, to nearest-even, into ``dtype``. torch's own float64 -> bf16 cast
    goes through float32 (two roundings), which can move a tie: 1 + 2**-8 + 2**-30 becomes 1.0."""
    if dtype in (torch.float64, torch.float32):
        return x.to(dtype)                       # one IEEE rounding
    if dtype != torch.bfloat16:
        raise QuantizedCheckpointError(f"dequantize: dtype={dtype} (supported: torch.bfloat16, float32, float64)")
    _, e = torch.frexp(x)                        # |x| = m * 2**e, 0.5 <= m < 1
    q = torch.clamp(e - 8, min=-133)             # bf16 keeps 8 significant bits; 2**-133 is its subnormal step
    y = torch.ldexp(torch.round(torch.ldexp(x, -q)), q)   # torch.round is round-half-even
    return y.to(torch.float32).to(torch.bfloat16)          # exact: y is a bf16 value


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """float64 multipliers of a block-scale tensor: e8m0 bytes (float8_e8m0fnu or uint8) are
    ``2**(b - 127)`` (255 is NaN and refused); float scales are taken as they are."""
    if scale.dtype in (torch.uint8, torch.float8_e8m0fnu):
        b = scale.view(torch.uint8).to(torch.int64)
        if bool((b == 255).any()):
            raise QuantizedCheckpointError("dequantize: an e8m0 scale byte is 0xFF (NaN); the checkpoint is corrupt")
        return torch.ldexp(torch.ones(b.shape, dtype=torch.float64, device=b.device), b - E8M0_BIAS)
    return scale.to(torch.float64)


def fp8_block_dequant(weight: torch.Tensor, scale: torch.Tensor, block=(128, 128),
                      dtype: torch.dtype = torch.bfloat16, max_elems: int = 1 << 24) -> torch.Tensor:
    """``weight`` (float8_e4m3fn ``[..., N, K]``) times its per-block ``scale`` (``[..., ceil(N/bn),
    ceil(K/bk)]``, the last blocks partial), rounded once into ``dtype``; row chunks of whole blocks
    bound the float64 working set to about ``max_elems`` elements."""
    bn, bk = block
    *lead, n, k = weight.shape
    want = (*lead, -(-n // bn), -(-k // bk))
    if tuple(scale.shape) != want:
        raise QuantizedCheckpointError(f"dequantize: scale shape {tuple(scale.shape)} for an fp8 weight "
                                       f"{tuple(weight.shape)} with {bn}x{bk} blocks; expected {want}")
    w = weight.reshape(-1, n, k)
    s = scale_values(scale.reshape(-1, want[-2], want[-1]))
    out = torch.empty(w.shape, dtype=dtype, device=weight.device)
    rows = max(bn, (max_elems // max(k, 1)) // bn * bn)
    for e in range(w.shape[0]):
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            sb = s[e, r0 // bn: -(-r1 // bn)].repeat_interleave(bn, 0)[: r1 - r0].repeat_interleave(bk, 1)[:, :k]
            out[e, r0:r1] = round_exact(w[e, r0:r1].to(torch.float64) * sb, dtype)
    return out.reshape(weight.shape)


def fp4_dequant(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                max_elems: int = 1 << 24) -> torch.Tensor:
    """``packed`` (int8 / uint8 / float4_e2m1fn_x2 ``[..., N, K/2]``, low nibble first) times its e8m0
    ``scale`` (``[..., N, K/32]``), rounded once into ``dtype``."""
    *lead, n, kp = packed.shape
    k = 2 * kp
    want = (*lead, n, k // FP4_GROUP)
    if k % FP4_GROUP or tuple(scale.shape) != want:
        raise QuantizedCheckpointError(f"dequantize: scale shape {tuple(scale.shape)} for an fp4 weight of "
                                       f"{k} values a row (packed {tuple(packed.shape)}); expected {want} "
                                       f"(one e8m0 scale per {FP4_GROUP} values, K a multiple of {FP4_GROUP})")
    if scale.dtype not in (torch.uint8, torch.float8_e8m0fnu):
        raise QuantizedCheckpointError(
            f"dequantize: fp4 scales must be e8m0 (float8_e8m0fnu or uint8), got {scale.dtype}")
    b = packed.reshape(-1, kp).view(torch.uint8)
    s = scale_values(scale.reshape(-1, want[-1]))
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=packed.device)
    out = torch.empty(b.shape[0], k, dtype=dtype, device=packed.device)
    rows = max(1, max_elems // k)
    for r0 in range(0, b.shape[0], rows):
        r1 = min(b.shape[0], r0 + rows)
        byte = b[r0:r1].to(torch.int64)
        v = torch.stack((lut[byte & 0xF], lut[byte >> 4]), dim=-1).reshape(r1 - r0, k)
        out[r0:r1] = round_exact(v * s[r0:r1].repeat_interleave(FP4_GROUP, 1), dtype)
    return out.reshape(*lead, n, k)


# ---------------------------------------------------------------------------------------------- files

def shard_files(folder: str) -> list[str]:
    """The safetensors files of a checkpoint folder (the index's shards when there is an index)."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not names:
        raise QuantizedCheckpointError(f"load_model: {folder!r} has no *.safetensors weights; quantized checkpoints "
                                       "are read from safetensors only")
    return [os.path.join(folder, n) for n in names]


@dataclass(slots=True)
class _Entry:
    file: str
    dtype: str                 # safetensors dtype string
    shape: tuple
    kind: str = "plain"        # plain | fp8 | fp4
    scale: str | None = None   # the scale tensor's key


class _LazyDequant:
    """One checkpoint tensor, dequantized when transformers' loader slices it (``t[...]``)."""

    def __init__(self, ckpt: "DequantizedCheckpoint", key: str):
        self.ckpt, self.key = ckpt, key

    def __getitem__(self, index):
        return self.ckpt.tensor(self.key)[index]

    def get_dtype(self) -> str:
        e = self.ckpt.entries[self.key]
        return "BF16" if e.kind != "plain" else e.dtype

    def get_shape(self) -> list[int]:
        e = self.ckpt.entries[self.key]
        return list(e.shape[:-1]) + [2 * e.shape[-1]] if e.kind == "fp4" and e.dtype != "F4" else list(e.shape)


class DequantizedCheckpoint(Mapping):
    """A lazy state dict over a quantized checkpoint folder: weight keys map to tensors dequantized
    on access; scale keys are consumed. Every pairing and shape is checked when it is built, from
    the safetensors headers alone, so a bad checkpoint fails before any weight is read."""

    def __init__(self, folder: str, spec: QuantSpec, dtype: torch.dtype = torch.bfloat16, device=None,
                 who: str = "load_model"):
        self.spec, self.dtype, self.who = spec, dtype, who
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._files = {f: safe_open(f, framework="pt", device="cpu") for f in shard_files(folder)}
        self.entries: dict[str, _Entry] = {}
        for f, h in self._files.items():
            for k in h.keys():
                sl = h.get_slice(k)
                self.entries[k] = _Entry(f, sl.get_dtype(), tuple(sl.get_shape()))
        self._pair_scales()

    def _pair_scales(self) -> None:
        bad, scales = [], {}
        for k, e in self.entries.items():
            if k.endswith("activation_scale") or k.endswith("input_scale"):
                bad.append(f"{k!r} is an activation scale (static activation quantization is not supported)")
            for suf in SCALE_SUFFIXES:
                if k.endswith(suf) and k[: -len(suf)] + ".weight" in self.entries:
                    scales[k[: -len(suf)] + ".weight"] = k
        paired = set(scales.values())
        for k, e in self.entries.items():
            s = scales.get(k)
            if k in paired:
                continue
            if e.dtype == _FP8:
                if s is None:
                    bad.append(f"{k!r} is float8_e4m3fn but has no scale tensor ({k[:-7]}.weight_scale_inv "
                               f"or {k[:-7]}.scale)")
                    continue
                e.kind, e.scale = "fp8", s
                se = self.entries[s]
                want = (*e.shape[:-2], -(-e.shape[-2] // self.spec.block[0]), -(-e.shape[-1] // self.spec.block[1]))
                if se.shape != want:
                    bad.append(f"scale {s!r} has shape {list(se.shape)}; its weight {list(e.shape)} with "
                               f"{self.spec.block[0]}x{self.spec.block[1]} blocks needs {list(want)}")
                elif se.dtype not in _FLOAT_SCALES + _E8M0:
                    bad.append(f"scale {s!r} has dtype {se.dtype} (float32 or e8m0 expected)")
            elif s is not None and e.dtype in _FP4_PACKED:
                if not self.spec.expert_fp4:
                    bad.append(f"{k!r} is packed {e.dtype} with a scale, but the config does not declare "
                               "expert_dtype='fp4'")
                    continue
                e.kind, e.scale = "fp4", s
                se = self.entries[s]
                n_k = e.shape[-1] if e.dtype == "F4" else 2 * e.shape[-1]   # safetensors F4 shapes count values
                want = (*e.shape[:-1], n_k // FP4_GROUP)
                if n_k % FP4_GROUP or se.shape != want or se.dtype not in _E8M0:
                    bad.append(f"scale {s!r} ({se.dtype} {list(se.shape)}) does not fit fp4 weight {k!r} "
                               f"({n_k} values a row): need e8m0 {list(want)}")
            elif e.dtype == "F4" or e.dtype.startswith("F8"):
                bad.append(f"{k!r} has dtype {e.dtype}{' and no scale' if s is None else ''} (supported: "
                           "F8_E4M3 with a block scale, packed FP4 with an e8m0 scale)")
            elif s is not None and e.dtype not in ("BF16", "F16", "F32"):
                bad.append(f"{k!r} ({e.dtype}) has a scale {s!r} but is neither fp8 nor packed fp4")
        used = {e.scale for e in self.entries.values() if e.scale}
        for w, s in scales.items():
            if s not in used and self.entries[w].dtype in ("BF16", "F16", "F32"):
                bad.append(f"scale {s!r} belongs to the unquantized ({self.entries[w].dtype}) weight {w!r}")
        if bad:
            shown = "; ".join(bad[:5]) + (f"; and {len(bad) - 5} more" if len(bad) > 5 else "")
            raise QuantizedCheckpointError(f"{self.who}: cannot dequantize the checkpoint: {shown}. Supported: "
                                           f"{SUPPORTED}")
        self._keys = [k for k in self.entries if k not in used]
        self._key_set = set(self._keys)

    def counts(self) -> dict[str, int]:
        out = {"fp8": 0, "fp4": 0, "plain": 0}
        for k in self._keys:
            out[self.entries[k].kind] += 1
        return out

    def tensor(self, key: str) -> torch.Tensor:
        """The checkpoint tensor ``key``, dequantized to ``self.dtype`` when it is fp8 / fp4."""
        e = self.entries[key]
        t = self._files[e.file].get_tensor(key)
        if e.kind == "plain":
            return t
        scale = self._files[self.entries[e.scale].file].get_tensor(e.scale).to(self.device)
        t = t.to(self.device)
        out = fp8_block_dequant(t, scale, self.spec.block, self.dtype) if e.kind == "fp8" \
            else fp4_dequant(t, scale, self.dtype)
        if not bool(torch.isfinite(out).all()):
            raise QuantizedCheckpointError(f"{self.who}: {key!r} dequantizes to non-finite values (NaN fp8 codes "
                                           "or a scale overflow); the checkpoint is corrupt")
        return out

    def __getitem__(self, key):
        if key not in self._key_set:
            raise KeyError(key)
        return _LazyDequant(self, key)

    def __iter__(self):
        return iter(self._keys)

    def __len__(self):
        return len(self._keys)


# ---------------------------------------------------------------------------------------------- sizes

def dequantized_bytes(config_or_index, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes the model takes once dequantized. A config (PretrainedConfig or dict): the parameters and
    buffers of the HF model built on the meta device in ``dtype`` (fp32-kept modules at 4 bytes).
    A checkpoint folder or its ``model.safetensors.index.json``: from the headers, quantized weights
    at ``dtype``'s size per value, scales dropped, other tensors at their stored size (this counts
    tensors HF ignores, e.g. DeepSeek's MTP layers)."""
    if isinstance(config_or_index, (str, os.PathLike)):
        path = os.fspath(config_or_index)
        folder = path if os.path.isdir(path) else os.path.dirname(path)
        size = torch.empty((), dtype=dtype).element_size()
        total = 0
        per = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "BF16": 2, "F16": 2, "I16": 2,
               "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}
        for f in shard_files(folder):
            with safe_open(f, framework="pt") as h:
                keys = set(h.keys())
                for k in keys:
                    sl = h.get_slice(k)
                    dt, n = sl.get_dtype(), math.prod(sl.get_shape())
                    scaled = (any(k[: -len(".weight")] + s in keys for s in SCALE_SUFFIXES)
                              if k.endswith(".weight") else False)
                    if k.endswith(SCALE_SUFFIXES) and k[: k.rfind(".")] + ".weight" in keys:
                        continue
                    if scaled and dt in ("I8", "U8"):
                        total += 2 * n * size
                    elif scaled or dt == "F4":
                        total += n * size
                    else:
                        total += n * per.get(dt, 2)
        return total
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import build_glob_alternation

    cfg = config_or_index
    if isinstance(cfg, dict):
        cfg = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "quantization_config"})
    else:
        cfg = type(cfg).from_dict({k: v for k, v in cfg.to_dict().items() if k != "quantization_config"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    # from_config leaves out what from_pretrained applies: the fp32-kept (strict) modules' dtype plan
    plan = model._get_dtype_plan(dtype)
    keep = build_glob_alternation(list(plan))[0] if plan else None
    total = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        kept = keep is not None and t.is_floating_point() and keep.search(name) is not None
        total += t.numel() * (4 if kept else t.element_size())   # every plan entry is float32
    return total


def gib(n: int) -> str:
    return f"{n / 2 ** 30:.1f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.1f} MiB"


# ---------------------------------------------------------------------------------------------- loading

def strip_quantization(config, spec: QuantSpec):
    """``config`` without ``quantization_config`` / ``expert_dtype``, noted as ``config.dequantized_from``."""
    for name in ("quantization_config", "expert_dtype"):
        if hasattr(config, name):
            delattr(config, name)
    config.dequantized_from = spec.note()
    return config


def load_dequantized(folder: str, config=None, *, dtype: torch.dtype = torch.bfloat16, device=None,
                     who: str = "load_model", **kwargs):
    """``AutoModelForCausalLM`` of the quantized checkpoint in ``folder``, its fp8 / fp4 weights
    dequantized one tensor at a time into ``dtype``; ``device`` is where the arithmetic runs (the bits
    are the same on every device). The model carries no quantization_config (see
    ``config.dequantized_from``). Other kwargs go to ``from_pretrained``."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if config is None:
        config = AutoConfig.from_pretrained(folder)
    spec = quant_spec(config, who=who)
    if spec is None:
        raise QuantizedCheckpointError(f"{who}: {folder!r} has no quantization_config; load it with from_pretrained")
    ckpt = DequantizedCheckpoint(folder, spec, dtype=dtype, device=device, who=who)
    config = strip_quantization(config, spec)
    c = ckpt.counts()
    print(f"bitmatch: dequantizing {folder}: {c['fp8']} fp8 e4m3 tensors ({spec.block[0]}x{spec.block[1]} blocks, "
          f"{spec.scale_fmt} scales), {c['fp4']} fp4 e2m1 tensors, {c['plain']} unquantized; "
          f"{gib(dequantized_bytes(config, dtype))} as {str(dtype).replace('torch.', '')} after dequantization",
          file=sys.stderr, flush=True)
    # the folder goes in as ``state_dict`` (transformers takes no name beside one), so its loader
    # still applies the family's key renames and expert merges, one materialized tensor at a time
    cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    model = cls.from_pretrained(None, config=config, state_dict=ckpt, dtype=dtype, **kwargs)
    return model
