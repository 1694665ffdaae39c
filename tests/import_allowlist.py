"""The exceptions tests/test_imports.py accepts, each with its reason. Shrink it; never grow it
without a reason a reviewer would accept (a cycle broken on purpose, an optional extra)."""

VERL = "optional extra: rollout.py subclasses verl's BaseRollout at its import (pip install bitmatch[verl])"
PLUGIN = ("verl's entry point: register() imports the adapter inside its try, so a failed load is one logged "
          "message, not a crash of every verl process")

# (importing module, imported module): why the import stays inside a function
LOCAL_IMPORTS = {
    # lazily loaded optional / heavy pieces
    ("bitmatch.sync.hash", "bitmatch.kernels.triton.fingerprint"):
        "optional extra: the Triton fingerprint kernel, imported on the first GPU tensor "
        "(pip install bitmatch[triton])",
    ("bitmatch.adapters.vllm", "bitmatch.kernels.order"):
        "vLLM imports this plugin in every process it starts: the kernels load only when it is enabled",
    ("bitmatch.adapters.vllm", "bitmatch.adapters.vllm.checks"):
        "vLLM imports this plugin in every process it starts: the checks (torch, bitmatch.models) load when enabled",
    ("bitmatch.adapters.vllm", "bitmatch.adapters.vllm.sampler"):
        "optional extra: the sampler module imports vllm at its top (pip install bitmatch[vllm])",
    ("bitmatch.adapters.vllm", "bitmatch.adapters.vllm.sampler_v2"):
        "optional extra: imports vLLM's V2 model runner, which only some vLLM versions ship",
    ("bitmatch.adapters.verl", "bitmatch.adapters.verl.check"):
        "cycle: check.py imports require_plugin from this __init__ at its top",
    ("bitmatch.adapters.verl", "bitmatch.adapters.verl.plugin"):
        "importing the plugin registers it with verl (and logs verl's absence): only when required",
    ("bitmatch.adapters.verl.actor", "bitmatch.adapters.verl.rollout"): VERL,
    ("bitmatch.adapters.verl.check", "bitmatch.adapters.verl.rollout"):
        "cycle: rollout.py imports check at its top (and rollout needs verl, an optional extra)",
    ("bitmatch.adapters.verl.plugin", "bitmatch.adapters.verl.actor"): PLUGIN,
    ("bitmatch.adapters.verl.plugin", "bitmatch.adapters.verl.check"): PLUGIN,
    ("bitmatch.adapters.verl.plugin", "bitmatch.adapters.verl.rollout"): VERL,
}

# (using module, "defining_module._name"): why another module reads the private name
PRIVATE_USES = {
}

# (core module, adapter module): why a module of bitmatch.sync / engine / models / kernels reaches up
# into bitmatch.adapters (an adapter is glue on top of the core; the core names none)
ADAPTER_IMPORTS = {
}
