"""The ``bitmatch`` rollout for verl: ``bitmatch.Engine`` inside the hybrid worker.

``actor_rollout_ref.rollout.name=bitmatch`` makes ``ActorRolloutRefWorker.init_model`` build
``BitmatchRollout`` (worker side, ``_ROLLOUT_REGISTRY``). It holds a rollout copy of the model
(``bitmatch.sync.RolloutCopy``: ``rollout.dtype``, except the parameters the family reads in fp32)
that only ever changes through ``bitmatch.sync``: verl's
``update_weights`` hands it the actor's per-tensor weights (fp32 masters, HF names) once per step,
``publish`` casts them with the one cast, fingerprints every tensor, the receiver re-fingerprints
what it staged and switches atomically to version ``global_steps``; the engine refuses to sample
until a verified version is in place, and every output carries the version it was sampled with.

Two ways in: ``generate_sequences(DataProto)`` (the whole batch, laid out as verl's agent loop
lays it out: left-padded prompts, right-padded responses, ``rollout_log_probs``) and the async
token-in-token-out ``generate(prompt_ids, sampling_params, request_id) -> TokenOutput`` of a
verl rollout server. ``BitmatchReplica`` is the driver-side entry (``RolloutReplicaRegistry``).
"""
from __future__ import annotations

import asyncio
import logging

import torch

import bitmatch
import bitmatch.sync as bsync
from bitmatch.adapters.verl import check, require_plugin

logger = logging.getLogger("bitmatch.verl")

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}
# the newest BitmatchRollout of this process (the step check locates against it); one entry, so a
# process that builds rollouts repeatedly does not keep every old copy alive
LIVE: list = []


def _base():
    from verl.workers.rollout.base import BaseRollout
    return BaseRollout


def check_rollout_config(cfg):
    """Refuse settings the bitmatch rollout cannot honour bit for bit, naming the config key."""
    k = "actor_rollout_ref.rollout"
    if not cfg.calculate_log_probs:
        raise ValueError(f"bitmatch verl: set {k}.calculate_log_probs=True (without rollout logprobs nothing "
                         "proves the rollout matches the actor)")
    if not (cfg.temperature > 0 and cfg.do_sample):
        raise ValueError(f"bitmatch verl: {k}.temperature={cfg.temperature}, do_sample={cfg.do_sample}: sampling "
                         "with T > 0 is required (verl's actor scores tokens at the rollout temperature)")
    if cfg.top_k not in (-1, 0) or cfg.top_p != 1.0:
        raise ValueError(f"bitmatch verl: {k}.top_k={cfg.top_k}, top_p={cfg.top_p}: verl's actor scores the full "
                         "vocabulary, so a masked rollout distribution cannot match it; use top_k=-1 top_p=1.0")
    if cfg.dtype not in _DTYPES:
        raise ValueError(f"bitmatch verl: {k}.dtype={cfg.dtype!r}; use bfloat16 (the actor's FSDP param_dtype) or "
                         "float32")
    if max(cfg.tensor_model_parallel_size, cfg.data_parallel_size, cfg.pipeline_model_parallel_size) != 1:
        raise ValueError(f"bitmatch verl: {k}.tensor/data/pipeline_model_parallel_size must be 1 (one embedded "
                         "engine per worker)")


class BitmatchRollout(_base()):
    """verl ``BaseRollout`` on ``bitmatch.Engine``; weights only through ``bitmatch.sync``."""

    def __init__(self, config, model_config, device_mesh, *args, **kwargs):
        require_plugin()
        super().__init__(config, model_config, device_mesh)
        cfg = self.config
        check_rollout_config(cfg)
        self.dtype = _DTYPES[cfg.dtype]
        opts = dict((cfg.engine_kwargs or {}).get("bitmatch", None) or {})
        self.engine_kwargs = {k: v for k, v in opts.items() if k not in ("patch_actor",)}
        self.copy = self._build_copy()
        self.model, self.receiver = self.copy.model, self.copy.receiver
        self.engine = None
        self.version = None
        self.actor_engine = None   # set by the actor patch in a hybrid worker (the step check locates with it)
        self.tokenizer = self.model_config.tokenizer
        LIVE[:] = [self]
        check.activate()

    def _build_copy(self):
        dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        return bsync.RolloutCopy.from_config(self.model_config.hf_config, self.dtype, dev)

    # -- verl's control surface ------------------------------------------------------------
    async def resume(self, tags: list[str]):
        """Nothing to page in: the rollout copy and the KV cache stay allocated (no sleep mode)."""

    async def release(self):
        """Kept allocated (see resume)."""

    async def update_weights(self, weights, wire_format: str = "named_tensors", **kwargs):
        """Receive the actor's weights as one verified version (``global_steps``, else the next)."""
        if wire_format != "named_tensors":
            raise ValueError(f"bitmatch verl: weight wire_format {wire_format!r} is not supported; set "
                             "actor_rollout_ref.rollout.checkpoint_engine.backend=naive")
        if kwargs.get("peft_config") is not None:
            raise ValueError("bitmatch verl: LoRA adapters are not supported by the bitmatch rollout")
        self.receive_weights(weights, kwargs.get("global_steps"))

    def receive_weights(self, weights, version=None):
        v = int(version) if version is not None else (0 if self.version is None else self.version + 1)
        self.copy.publish(v, [(n, t) for n, t in weights])
        self.version = v
        if self.engine is None:
            kw = dict(seed=int(getattr(self.config, "seed", 0) or 0))
            kw.update(self.engine_kwargs)
            self.engine = bitmatch.Engine(self.model, self.tokenizer, **kw)

    # -- generation --------------------------------------------------------------------------
    def _sampling(self, max_tokens: int, overrides: dict | None = None):
        cfg = self.config
        o = dict(overrides or {})
        t = float(o.pop("temperature", cfg.temperature))
        if t != cfg.temperature:
            raise ValueError(f"bitmatch verl: per-request temperature {t} differs from "
                             f"actor_rollout_ref.rollout.temperature={cfg.temperature}, which the actor scores with")
        eos = self.model_config.hf_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.append(int(self.tokenizer.eos_token_id))
        return bitmatch.SamplingParams(temperature=t, max_tokens=int(max_tokens), stop_token_ids=sorted(set(eos)),
                                       ignore_eos=True, seed=o.pop("seed", None))

    def _require_engine(self):
        if self.engine is None:
            raise RuntimeError("bitmatch verl: the rollout has no weights yet: verl must call update_weights "
                               "(checkpoint_manager.update_weights) before the first generation")

    async def generate(self, prompt_ids, sampling_params: dict, request_id: str, **kwargs):
        """Token-in-token-out, as verl's rollout servers (``TokenOutput`` with fp32 log_probs)."""
        from verl.workers.rollout.replica import TokenOutput
        self._require_engine()
        sp = dict(sampling_params or {})
        max_tokens = sp.pop("max_tokens", sp.pop("max_new_tokens", self.config.response_length))
        for k in ("logprobs", "repetition_penalty", "top_k", "top_p"):
            v = sp.pop(k, None)
            if k in ("top_k", "top_p") and v not in (None, -1, 0, 1.0):
                raise ValueError(f"bitmatch verl: per-request {k}={v} is not supported")
        out = self.engine.generate([list(map(int, prompt_ids))], self._sampling(max_tokens, sp), use_tqdm=False)[0]
        c = out.outputs[0]
        return TokenOutput(token_ids=list(c.token_ids), log_probs=list(c.logprobs), stop_reason="completed",
                           num_preempted=out.num_preemptions, extra_fields={"weight_version": out.weight_version})

    def generate_sequences(self, prompts):
        """A verl batch of left-padded prompts (``input_ids``, ``attention_mask``) -> the agent loop's
        layout: prompts, responses (right-padded to response_length), response_mask, input_ids,
        attention_mask, position_ids, rollout_log_probs (fp32, 0 at padding); meta_info weight_version."""
        from tensordict import TensorDict
        from verl import DataProto
        from verl.utils.model import compute_position_id_with_mask

        self._require_engine()
        ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
        R = int(self.config.response_length)
        pad = self.tokenizer.pad_token_id if self.tokenizer is not None else 0
        plist = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
        outs = self.engine.generate(plist, self._sampling(R), use_tqdm=False)
        bsync.check_weight_version(list(outs), self.version)
        B = len(outs)
        resp = torch.full((B, R), pad, dtype=ids.dtype)
        rmask = torch.zeros((B, R), dtype=mask.dtype)
        rlp = torch.zeros((B, R), dtype=torch.float32)
        for i, o in enumerate(outs):
            c = o.outputs[0]
            n = len(c.token_ids)
            resp[i, :n] = torch.tensor(c.token_ids, dtype=ids.dtype)
            rmask[i, :n] = 1
            rlp[i, :n] = torch.tensor(c.logprobs, dtype=torch.float32)
        attn = torch.cat([mask, rmask], dim=1)
        batch = TensorDict({"prompts": ids, "responses": resp, "response_mask": rmask,
                            "input_ids": torch.cat([ids, resp], dim=1), "attention_mask": attn,
                            "position_ids": compute_position_id_with_mask(attn), "rollout_log_probs": rlp},
                           batch_size=B)
        return DataProto(batch=batch, non_tensor_batch=dict(prompts.non_tensor_batch),
                         meta_info={**prompts.meta_info, "weight_version": self.version})


def _replica_base():
    from verl.workers.rollout.replica import RolloutReplica
    return RolloutReplica


class BitmatchReplica(_replica_base()):
    """Driver-side entry (``RolloutReplicaRegistry['bitmatch']``). The engine lives inside each
    hybrid worker (``BitmatchRollout``): there is no separate server process to launch, so only
    the hybrid mode exists; its server handle forwards to the worker, whose rollout ``generate``
    is reached through Ray's ``__ray_call__``. tests/test_verl_ray.py runs it under verl's own
    ``RayPPOTrainer.fit`` (CPU, declared GPUs)."""

    async def launch_servers(self):
        require_plugin()
        check.activate()
        from verl.workers.rollout.replica import RolloutMode
        if self.rollout_mode != RolloutMode.HYBRID:
            raise ValueError(f"bitmatch verl: rollout mode {self.rollout_mode} is not supported; the bitmatch engine "
                             "runs inside the actor workers (hybrid engine: actor_rollout_ref.hybrid_engine=True)")
        if len(self.workers) != 1:
            raise ValueError("bitmatch verl: one worker per replica (rollout tensor_model_parallel_size=1)")
        self._server_handle = _WorkerServer(self.workers[0])
        self.servers = [self._server_handle]   # what RolloutReplica.sleep / wake_up / ... call
        self._server_address = None

    def rollout_worker_use_gpu(self) -> bool:
        return torch.cuda.is_available()


# the control methods verl's RolloutReplica and agent loop call on a server (verl 0.9.1
# workers/rollout/replica.py): nothing to do for an engine that stays allocated
CONTROL_METHODS = ("wake_up", "sleep", "clear_kv_cache", "release_kv_cache", "resume_kv_cache",
                   "abort_all_requests", "resume_generation", "start_profile", "stop_profile")


class _WorkerServer:
    """What verl's agent loop calls on a server handle (``.generate.remote(...)`` and the
    control methods), forwarded to the hybrid worker's ``BitmatchRollout``."""

    def __init__(self, worker):
        self.worker = worker
        self.generate = _Remote(worker, "generate")
        for name in CONTROL_METHODS:
            setattr(self, name, _Remote(worker, None))


def _rollout_of(w):
    """The ``BitmatchRollout`` in a Ray worker: the hybrid worker's own, or the one inside the
    colocated ``WorkerDict`` that ``RayPPOTrainer`` builds (``worker_dict["actor_rollout_ref"]``)."""
    for cand in (w, *getattr(w, "worker_dict", {}).values()):
        if getattr(cand, "rollout", None) is not None:
            return cand.rollout
    raise RuntimeError(f"bitmatch verl: no rollout in the Ray worker {type(w).__name__}")


class _Remote:
    def __init__(self, worker, method):
        self.worker, self.method = worker, method

    def remote(self, *args, **kwargs):
        method = self.method

        def call(w):
            # the trainer's WorkerDict is a synchronous Ray actor: its __ray_call__ returns what
            # this returns, so the rollout's coroutine is run to completion here
            return None if method is None else asyncio.run(getattr(_rollout_of(w), method)(*args, **kwargs))
        return self.worker.__ray_call__.remote(call)
