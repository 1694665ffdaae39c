"""Where a checkpoint comes from: a local folder or a hub name, resolved before anything loads.

``resolve_checkpoint`` is the one place ``bitmatch.Engine("...")`` and
``bitmatch.models.load_model`` turn a string into something ``from_pretrained`` can open:
- a path that exists is used as it is (``~`` expanded), once ``check_checkpoint_folder`` found a
  readable config.json and complete weights in it (a broken folder is named with its fix before
  transformers reads it);
- a string that looks like a local path (absolute, ``./``, ``../``, ``~``, a backslash, or more
  than one ``/``) and does not exist is a ``FileNotFoundError`` naming the path, raised before
  any network access (the hub would otherwise answer "Repo id must be in the form ...");
- anything else is a hub repo id: found in the local cache, it is used without asking the hub;
  otherwise one request to the hub (no retries, short timeout) says whether it exists, so a
  typo or an unreachable hub fails in seconds with the fix, instead of a minute of retries.
"""
from __future__ import annotations

import json
import os
import struct
import warnings

import bitmatch.models.quant as quant

HUB_TIMEOUT_S = 10.0
_verified: set[tuple[str, str | None]] = set()  # hub names that already answered in this process


def looks_local(name: str) -> bool:
    """True for strings a user means as a file-system path rather than a hub ``org/name`` id."""
    return (os.path.isabs(name) or name in (".", "..") or name.startswith(("./", "../", "~", ".\\", "..\\"))
            or "\\" in name or name.count("/") > 1 or name.endswith("/"))


def _offline(kwargs) -> bool:
    if kwargs.get("local_files_only"):
        return True
    try:
        from huggingface_hub import constants
        return bool(constants.HF_HUB_OFFLINE)
    except ImportError:  # no hub client: only local folders can work
        return True


def _cached(name: str, revision, cache_dir) -> bool:
    from huggingface_hub import try_to_load_from_cache
    hit = try_to_load_from_cache(name, "config.json", cache_dir=cache_dir, revision=revision)
    return isinstance(hit, str)


def resolve_checkpoint(path_or_name, *, who: str = "load_model", **kwargs) -> str:
    """Return the folder or hub id to hand to ``from_pretrained``, or raise a clear error.

    ``who`` names the caller in the message. ``kwargs`` are the caller's from_pretrained options
    (``revision``, ``token``, ``cache_dir``, ``local_files_only`` are honoured here).
    Raises FileNotFoundError (missing local path; hub name not cached while offline),
    ValueError (neither a folder nor a valid hub id; a file instead of a folder; the hub says
    no such repo) or ConnectionError (hub unreachable and the name not in the cache).
    """
    if not isinstance(path_or_name, (str, os.PathLike)):
        raise ValueError(f"{who}: expected a checkpoint folder or hub name, got {type(path_or_name).__name__}")
    name = os.fspath(path_or_name)
    local = os.path.expanduser(name)
    if os.path.isdir(local):
        check_checkpoint_folder(local, who=who, **kwargs)
        return local
    if os.path.exists(local):
        raise ValueError(f"{who}: {name!r} is a file; give the checkpoint folder that holds config.json "
                         "and the weights")
    if isinstance(path_or_name, os.PathLike) or looks_local(name):
        raise FileNotFoundError(f"{who}: no checkpoint folder at {name!r} (resolved to "
                                f"{os.path.abspath(local)!r}); check the path, or give a hub name such as "
                                "'Qwen/Qwen3-0.6B'")
    try:
        from huggingface_hub.utils import HFValidationError, validate_repo_id
        validate_repo_id(name)
    except ImportError:
        raise FileNotFoundError(f"{who}: no checkpoint folder {name!r} here, and huggingface_hub is not "
                                "installed to look it up on the hub") from None
    except HFValidationError as e:
        raise ValueError(f"{who}: {name!r} is neither an existing folder nor a valid hub name "
                         f"('org/name'): {e}") from None
    revision, cache_dir = kwargs.get("revision"), kwargs.get("cache_dir")
    if (name, revision) in _verified or _cached(name, revision, cache_dir):
        return name
    if _offline(kwargs):
        raise FileNotFoundError(f"{who}: {name!r} is not a local folder and not in the hub cache, and hub "
                                "access is off (HF_HUB_OFFLINE / local_files_only): download it first "
                                "(`hf download " + name + "`) or give a local checkpoint folder")
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError
    try:  # one request, no retry loop: a typo or a dead network is known in seconds
        HfApi().model_info(name, revision=revision, token=kwargs.get("token"), timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        pass  # it exists; from_pretrained reports the access problem with its own fix
    except RepositoryNotFoundError:
        raise ValueError(f"{who}: no model {name!r} on the hub (or it is private: log in with `hf auth login` "
                         f"or pass token=); if you meant a local folder, it does not exist at "
                         f"{os.path.abspath(local)!r}") from None
    except RevisionNotFoundError:
        raise ValueError(f"{who}: model {name!r} has no revision {revision!r}") from None
    except Exception as e:  # connection refused, DNS, timeout: not worth a retry loop
        raise ConnectionError(f"{who}: {name!r} is not a local folder (no {os.path.abspath(local)!r}) and the "
                              f"hub could not be reached ({type(e).__name__}: {str(e)[:200]}); give a local "
                              f"checkpoint folder (e.g. './{name}'), or "
                              "download it where the hub is reachable and set HF_HUB_OFFLINE=1 to use the "
                              "cache") from None
    _verified.add((name, revision))
    return name


def load_pretrained(path_or_name, *, dtype=None, who: str = "load_model", **kwargs):
    """``AutoModelForCausalLM.from_pretrained`` of a resolved checkpoint; a checkpoint whose config
    carries a ``quantization_config`` (DeepSeek FP8 blocks / FP4 experts) is dequantized tensor by
    tensor into ``dtype`` (default bf16) by ``bitmatch.models.quant`` (refused, named, if it cannot be
    read exactly). The same checkpoint gives the same bits on every call."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if _dtype_name(dtype) in ("float16", "half"):  # refused by every forward: say so before loading
        raise ValueError(f"{who}: dtype={dtype} is refused: bitmatch computes in bf16 or fp32 (its kernels refuse "
                         "fp16 at the first op); pass dtype=torch.bfloat16 (the default) or torch.float32, into "
                         "which an fp16 checkpoint loads too")
    path = resolve_checkpoint(path_or_name, who=who, **kwargs)
    config = kwargs.pop("config", None) or AutoConfig.from_pretrained(
        path, **{k: kwargs[k] for k in ("revision", "token", "cache_dir", "local_files_only") if k in kwargs})
    if quant.quant_spec(config, who=who) is None:
        stored = _dtype_name(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None))
        target = _dtype_name(dtype)
        # rounding to a 16-bit dtype changes the values: one line (fp32 holds any stored value exactly)
        if stored in ("float32", "float16", "bfloat16") and target in ("bfloat16", "float16") and stored != target:
            warnings.warn(f"{who}: {os.fspath(path_or_name)!r} is stored in torch.{stored}; loaded as torch.{target}, "
                          "rounded (pass dtype=torch.float32 to keep the stored values exactly)", stacklevel=3)
        return AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype, **kwargs)
    if not os.path.isdir(path):  # a hub name: the quantized loader reads the files from the local cache
        from huggingface_hub import snapshot_download
        path = snapshot_download(path, **{k: kwargs.pop(k) for k in ("revision", "token", "cache_dir") if k in kwargs})
    return quant.load_dequantized(path, config, dtype=dtype or torch.bfloat16, who=who, **kwargs)


def _dtype_name(dtype) -> str | None:
    """'float32' for torch.float32 or "float32" (a config's or a caller's dtype); None for None."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")


def check_checkpoint_folder(folder: str, *, who: str = "load_model", **kwargs) -> None:
    """Raise a one-sentence error naming the file and the fix if ``folder`` cannot be a checkpoint:
    no or unparsable config.json, no weights file, or a safetensors file whose header is cut or
    whose tensors are not all in the file (a truncated download). Reads headers only. Skipped
    parts: config.json when ``config=`` is given, everything under ``subfolder=``."""
    if kwargs.get("subfolder"):
        return
    fix = "re-download or re-save the checkpoint (save_pretrained)"
    cfg = os.path.join(folder, "config.json")
    if kwargs.get("config") is None:
        if not os.path.isfile(cfg):
            raise FileNotFoundError(f"{who}: {folder!r} has no config.json, so it is not an HF checkpoint folder; "
                                    f"give the folder that holds config.json and the weights, or {fix}")
        try:
            with open(cfg, encoding="utf-8") as f:
                json.load(f)
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{who}: {cfg!r} is not valid JSON ({e}); {fix}") from None
    names = os.listdir(folder)
    if not any(n.endswith(_WEIGHT_SUFFIXES) for n in names):
        raise FileNotFoundError(f"{who}: {folder!r} has a config.json but no weights (no *.safetensors or "
                                f"pytorch_model*.bin); {fix}")
    for n in sorted(names):
        if n.endswith(".safetensors"):
            _check_safetensors(os.path.join(folder, n), who, fix)


def _check_safetensors(path: str, who: str, fix: str) -> None:
    """The safetensors layout: 8-byte little-endian header length, a JSON header, then the data,
    which the tensors' offsets must cover exactly."""
    size = os.path.getsize(path)
    bad = None
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        if n is None or 8 + n > size:
            bad = f"its header is cut ({size} bytes)"
        else:
            try:
                header = json.loads(f.read(n))
                end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
            except (ValueError, KeyError, TypeError, IndexError) as e:
                bad = f"its header is not valid ({type(e).__name__})"
            else:
                if 8 + n + end != size:
                    bad = f"it holds {size} bytes but its tensors need {8 + n + end}"
    if bad:
        raise ValueError(f"{who}: weights file {path!r} is truncated or corrupt: {bad}; {fix}")
