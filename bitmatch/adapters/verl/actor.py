"""The actor (and ref) side: verl's FSDP2 engine on bitmatch kernels, logprobs in fp32.

Stock verl 0.9.1 (``verl/workers/engine/fsdp/transformer_impl.py``) runs the forward under
``torch.autocast(param_dtype)`` and turns the logits into logprobs with
``logprobs_from_logits(logits / T)``, the division done in the logits dtype (bf16): no fp32
rollout logprob can equal that. After ``ActorRolloutRefWorker.init_model`` built the engines,
``patch_engine`` makes each one:
- run its FSDP2 module on bitmatch kernels (``bitmatch.patch(module, compute_dtype=param_dtype)``;
  FSDP2's mixed-precision policy already hands the forward bf16 casts of the fp32 masters, the
  same round-to-nearest cast ``bitmatch.sync.publish`` sends to the rollout);
- skip verl's autocast around the forward (the kernels choose their own dtypes; autocast would
  only recast the stock ops verl still runs on the logits);
- compute ``log_probs`` with ``bitmatch.kernels.token_logprobs(logits, next_tokens, T)``: fp32
  ``log_softmax(logits.float() / T)``, T per token from verl's own ``temperature`` field, and the
  entropy of that same distribution. Gradients flow through both (the PPO loss trains on them).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import types

import torch

import bitmatch
import bitmatch.kernels as K
from bitmatch import switch
from bitmatch.adapters.verl import check, require_plugin
from bitmatch.models import check_supported

logger = logging.getLogger("bitmatch.verl")

_ORIG_INIT_MODEL = None


def _bitmatch_options(rollout_cfg) -> dict:
    ek = rollout_cfg.get("engine_kwargs", None) or {}
    return dict(ek.get("bitmatch", None) or {})


def actor_enabled(config) -> bool:
    """Whether ``actor_rollout_ref`` config asks for bitmatch on the actor: the bitmatch rollout
    (unless ``engine_kwargs.bitmatch.patch_actor=false``, the control), or the vLLM rollout with
    the bitmatch vLLM plugin on (``BITMATCH=1``)."""
    rollout = config.rollout
    name = rollout.get("name", None)
    if name == "bitmatch":
        return bool(_bitmatch_options(rollout).get("patch_actor", True))
    return name == "vllm" and switch.enabled()


def check_engine_config(engine, where: str):
    """Refuse what the bitmatch actor path cannot compute bit for bit, naming the setting."""
    ec, mc = engine.engine_config, engine.model_config
    if ec.strategy != "fsdp2":
        raise ValueError(f"bitmatch verl: {where}.strategy={ec.strategy!r} is not supported; set "
                         f"actor_rollout_ref.{where}.strategy=fsdp2")
    if getattr(mc, "use_fused_kernels", False):
        raise ValueError("bitmatch verl: actor_rollout_ref.model.use_fused_kernels=True computes verl's own fused "
                         "logprobs; set it False (bitmatch computes them)")
    if getattr(ec, "ulysses_sequence_parallel_size", 1) != 1:
        raise ValueError("bitmatch verl: Ulysses sequence parallelism is not supported; set "
                         f"actor_rollout_ref.{where}.ulysses_sequence_parallel_size=1")
    if getattr(mc, "lora_rank", 0):
        raise ValueError("bitmatch verl: LoRA (actor_rollout_ref.model.lora_rank > 0) is not supported by the verl "
                         "adapter yet; train full weights, or use the TRL adapter for LoRA")


def patch_engine(engine, where: str = "actor"):
    """Put one verl ``FSDPEngineWithLMHead`` on bitmatch kernels (in place); returns the engine."""
    if getattr(engine, "_bitmatch_patched", False):
        return engine
    check_engine_config(engine, where)
    check_supported(engine.module)
    dtype = getattr(engine, "_autocast_dtype", torch.bfloat16)
    bitmatch.patch(engine.module, compute_dtype=dtype)
    engine._autocast_dtype = torch.float32   # forward_step then runs without autocast (see module doc)
    engine.prepare_model_outputs = types.MethodType(prepare_model_outputs, engine)
    engine._bitmatch_patched = True
    if where == "actor":
        check.activate()
    return engine


def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
    """bitmatch's ``FSDPEngineWithLMHead.prepare_model_outputs``: ``log_probs`` (and ``entropy``)
    as jagged tensors over each sequence's tokens, fp32 ``token_logprobs`` at verl's temperature.
    Invariance: each token's value depends only on its sequence prefix and its temperature."""
    import verl.utils.tensordict_utils as tu
    from verl.utils.dataset.dataset_utils import DatasetPadMode

    def flag(key, default=False):
        return tu.get_non_tensor_data(data=micro_batch, key=key, default=default)

    for key, what in (("use_fused_kernels", "actor_rollout_ref.model.use_fused_kernels=False"),
                      ("distillation_use_topk", "no top-k distillation"),
                      ("calculate_sum_pi_squared", "actor_rollout_ref.actor.calculate_sum_pi_squared=False")):
        if flag(key):
            raise ValueError(f"bitmatch verl: {key}=True is not supported by the bitmatch actor; use {what}")
    if flag("pad_mode", DatasetPadMode.NO_PADDING) != DatasetPadMode.NO_PADDING:
        raise NotImplementedError(f"bitmatch verl: pad_mode {flag('pad_mode')} is not supported (verl's own "
                                  "engine implements only NO_PADDING)")
    cu = micro_batch["input_ids"].offsets()
    n = int(cu[-1])
    labels = output_args["input_ids_rmpad_rolled"].reshape(-1)[:n]
    if isinstance(output.logits, torch.distributed.tensor.DTensor):
        raise ValueError("bitmatch verl: tensor-parallel logits (DTensor) are not supported; use FSDP2 without TP")
    if flag("use_remove_padding", True):
        logits = output.logits.squeeze(0)[:n]          # packed tokens, then verl's tail padding
        temp = output_args["temperature_rmpad"].reshape(-1)[:n]
    else:
        lens = cu.diff().tolist()
        logits = torch.cat([output.logits[b, :m] for b, m in enumerate(lens)])
        temp = torch.repeat_interleave(output_args["temperature"].reshape(-1).float(),
                                       torch.as_tensor(lens, device=logits.device))
    temp = temp.to(device=logits.device, dtype=torch.float32)
    out = {}
    if not flag("distillation_only"):
        lp = K.token_logprobs(logits, labels.to(logits.device), temp)
        out["log_probs"] = torch.nested.nested_tensor_from_jagged(lp, cu)
    if flag("calculate_entropy"):
        # entropy of the same fp32 distribution (a metric / bonus: its bits are not part of the contract)
        logp = torch.log_softmax(logits.float() / temp.unsqueeze(-1), dim=-1)
        ent = -(logp.exp() * logp).sum(-1)
        out["entropy"] = torch.nested.nested_tensor_from_jagged(ent, cu)
    return out


@contextlib.contextmanager
def _root_owns_embeddings():
    """verl's FSDP2 wrapping (``fsdp_utils._select_fsdp2_wrap_targets``) makes untied ``embed_tokens``
    and ``lm_head`` FSDP units of their own, unsharded only when their own ``forward`` runs; bitmatch
    reads their weights inside the causal LM's forward (the embedding gather and the logits are
    bitmatch ops), so while the engines are built they stay in the root unit, unsharded with it."""
    import verl.utils.fsdp_utils as fu

    orig = fu._select_fsdp2_wrap_targets

    def targets(model, cls_names):
        skip = {id(m) for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in ("embed_tokens", "lm_head")}
        return [m for m in orig(model, cls_names) if id(m) not in skip]

    fu._select_fsdp2_wrap_targets = targets
    try:
        yield
    finally:
        fu._select_fsdp2_wrap_targets = orig


def _init_model(self, *args, **kwargs):
    """``ActorRolloutRefWorker.init_model``, then the actor / ref engines onto bitmatch."""
    if not actor_enabled(self.config):
        return _ORIG_INIT_MODEL(self, *args, **kwargs)
    from bitmatch.adapters.verl.rollout import BitmatchRollout
    require_plugin()
    with _root_owns_embeddings():
        res = _ORIG_INIT_MODEL(self, *args, **kwargs)
    for where, w in (("actor", self.actor), ("ref", self.ref)):
        if w is not None:
            patch_engine(w.engine, where)
    if self.actor is not None and isinstance(getattr(self, "rollout", None), BitmatchRollout):
        self.rollout.actor_engine = self.actor.engine   # what the step check locates against
    logger.info("bitmatch: actor%s on bitmatch kernels (fp32 token_logprobs)", " and ref" if self.ref else "")
    return res


def install():
    """Wrap ``ActorRolloutRefWorker.init_model`` (once)."""
    global _ORIG_INIT_MODEL
    from verl.workers.engine_workers import ActorRolloutRefWorker

    cur = ActorRolloutRefWorker.init_model
    if getattr(cur, "_bitmatch", False):
        return
    # keep verl's @register metadata (dispatch mode) on the wrapper: the worker group reads it
    _ORIG_INIT_MODEL = cur
    wrapped = functools.wraps(cur)(_init_model)
    wrapped._bitmatch = True
    ActorRolloutRefWorker.init_model = wrapped
