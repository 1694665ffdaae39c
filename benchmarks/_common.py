"""Helpers the benchmark scripts share (each runs as a script: its folder is on sys.path)."""
import platform

import torch


def machine_info(device) -> dict:
    """Versions and the device a result came from (written into every benchmark's JSON)."""
    import transformers
    import triton
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine()}
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, sm_count=p.multi_processor_count)
    return info
