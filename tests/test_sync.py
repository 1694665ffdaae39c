"""bitmatch.sync: in-process and vLLM-colocate transports, names, versions, failure modes."""
from __future__ import annotations

import pytest
import torch

import bitmatch.sync as sync
from bitmatch.adapters.vllm import VllmColocateSender
from bitmatch.precision import compute_cast
from bitmatch.sync import names
from sync_helpers import FakeVllmQwen3, tiny_qwen3


def cast_state(model, dtype=torch.bfloat16):
    return {k: compute_cast(p.detach(), dtype) for k, p in model.named_parameters()}


def assert_holds(engine, master):
    for k, p in engine.named_parameters():
        want = compute_cast(master.get_parameter(k).detach(), p.dtype)
        assert torch.equal(p.view(torch.int16), want.view(torch.int16)), k


# ---- fingerprints ------------------------------------------------------------------------------

def test_fingerprint_is_exact_bytes_and_streams_over_row_blocks():
    t = torch.randn(6, 5).to(torch.bfloat16)
    u = t.clone()
    assert sync.fingerprint(t) == sync.fingerprint(u)
    u.view(torch.int16)[3, 2] ^= 1  # one mantissa bit
    assert sync.fingerprint(t) != sync.fingerprint(u)
    assert sync.fingerprint(t) == sync.fingerprints({"x": t.float()})["x"]
    # hash of a row block of a merged tensor == hash of the source tensor
    a, b = torch.randn(2, 5).to(torch.bfloat16), torch.randn(3, 5).to(torch.bfloat16)
    m = torch.cat([a, b])
    assert sync.fingerprint(m[2:5]) == sync.fingerprint(b)


# ---- names: both ways ----------------------------------------------------------------------------

@pytest.mark.parametrize("tie", [False, True])
def test_vllm_layout_maps_every_parameter_once(tie):
    hf = tiny_qwen3(tie=tie)
    fake = FakeVllmQwen3(hf)
    hf_shapes = {k: tuple(v.shape) for k, v in hf.named_parameters()}
    eng_shapes = {k: tuple(v.shape) for k, v in fake.named_parameters()}
    lay = names.build_layout("Qwen3ForCausalLM", hf_shapes, eng_shapes)
    assert set(lay.hf_to_engine) == set(hf_shapes)
    for eng, parts in lay.engine_to_hf().items():  # rows covered exactly once, no gap
        rows = 0
        for hf_name, slot in parts:
            assert slot.row_start == rows
            rows += slot.rows
        assert rows == (eng_shapes[eng][0] if eng_shapes[eng] else 1)
    qkv = lay.hf_to_engine["model.layers.1.self_attn.k_proj.weight"]
    assert (qkv.engine_name, qkv.row_start, qkv.rows) == ("model.layers.1.self_attn.qkv_proj.weight", 64, 32)


def test_vllm_layout_refuses_gaps_and_strays():
    hf = {k: tuple(v.shape) for k, v in tiny_qwen3().named_parameters()}
    eng = {k: tuple(v.shape) for k, v in FakeVllmQwen3(tiny_qwen3()).named_parameters()}
    with pytest.raises(ValueError, match="missing shard"):
        names.build_layout("Qwen3ForCausalLM", {k: v for k, v in hf.items() if "layers.0.mlp.up_proj" not in k})
    with pytest.raises(ValueError, match="no HF source"):
        names.build_layout("Qwen3ForCausalLM", hf, {**eng, "model.extra.weight": (3,)})
    with pytest.raises(ValueError, match="mapped shape"):
        names.build_layout("Qwen3ForCausalLM", hf, {**eng, "model.norm.weight": (63,)})
    with pytest.raises(ValueError, match="no model family serves architecture .GPT2LMHeadModel"):
        names.build_layout("GPT2LMHeadModel", hf)
    for arch in ("Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM"):
        assert names.build_layout(arch, hf, eng).engine_shapes == names.build_layout(
            "Qwen3ForCausalLM", hf).engine_shapes


# ---- in-process ------------------------------------------------------------------------------------

def test_inprocess_copy_round_trip_and_refusal_before_first_update():
    master = tiny_qwen3(seed=0, dtype=torch.float32)
    engine = tiny_qwen3(seed=1, dtype=torch.bfloat16)
    rx = sync.receive(engine)
    with pytest.raises(sync.WeightsNotReadyError):
        sync.require_ready(engine)
    man = sync.publish(master, 1, to=rx)
    assert sync.require_ready(engine, 1) == 1 and rx.version == 1
    assert man.tensors.keys() == dict(engine.named_parameters()).keys()
    assert_holds(engine, master)
    sync.verify(engine, man)
    assert {k: s.fingerprint for k, s in man.tensors.items()} == sync.fingerprints(master)


def test_inprocess_shared_tensors_fingerprint_only_no_copy():
    model = tiny_qwen3(seed=0, dtype=torch.bfloat16)  # trainer and engine share this module
    rx = sync.receive(model)
    ptrs = {k: p.data_ptr() for k, p in model.named_parameters()}
    sync.publish(model, 7, to=rx)
    man = rx.state.manifest
    assert rx.version == 7 and man is not None
    assert {k: p.data_ptr() for k, p in model.named_parameters()} == ptrs
    sync.verify(model, man)
    # the trainer changes a weight without publishing: verify names the tensor
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] += 1
    with pytest.raises(sync.FingerprintMismatchError, match="layers.0.mlp.up_proj"):
        sync.verify(model, man)


def test_switch_waits_for_running_generation():
    import threading
    master, engine = tiny_qwen3(seed=0), tiny_qwen3(seed=1, dtype=torch.bfloat16)
    rx = sync.receive(engine)
    sync.publish(master, 1, to=rx)
    with rx.state.generation(1) as v:
        th = threading.Thread(target=sync.publish, args=(tiny_qwen3(seed=2), 2), kwargs={"to": rx})
        th.start()
        th.join(0.3)
        assert v == 1 and rx.version == 1 and th.is_alive()  # staged, waiting for the step to end
        assert_holds(engine, master)
    th.join(10)
    assert rx.require_ready(2) == 2


class FlippingSender(sync.InProcessSender):
    """Flips one bit of one tensor on its way into the staging buffer."""
    victim = "model.layers.1.mlp.down_proj.weight"

    def _write(self, name, dst, src):
        dst.copy_(src)
        if name == self.victim:
            dst[5] ^= 0x01


def test_inprocess_bit_flip_detected_previous_version_kept_generation_refused():
    m1, m2 = tiny_qwen3(seed=0), tiny_qwen3(seed=2)
    engine = tiny_qwen3(seed=1, dtype=torch.bfloat16)
    rx = sync.receive(engine)
    sync.publish(m1, 1, to=rx)
    with pytest.raises(sync.FingerprintMismatchError) as ei:
        sync.publish(m2, 2, to=FlippingSender(rx))
    e = ei.value
    assert e.name == FlippingSender.victim and e.expected != e.got
    assert e.expected in str(e) and e.got in str(e) and e.name in str(e)
    assert rx.version == 1
    assert_holds(engine, m1)  # nothing of version 2 leaked in
    with pytest.raises(sync.WeightsNotReadyError, match="down_proj"):
        sync.require_ready(engine)
    sync.publish(m2, 2, to=rx)  # the next full update succeeds
    assert sync.require_ready(engine, 2) == 2
    assert_holds(engine, m2)


def test_wrong_shape_and_dtype_are_clear_value_errors():
    engine = tiny_qwen3(seed=1, dtype=torch.bfloat16)
    rx = sync.receive(engine, initial_version=0)
    bad = dict(tiny_qwen3(seed=0).named_parameters())
    name = "model.layers.0.self_attn.o_proj.weight"
    bad[name] = torch.zeros(64, 63)
    with pytest.raises(ValueError, match=r"o_proj.weight.*shape"):
        sync.publish(bad, 1, to=rx)
    with pytest.raises(ValueError, match=r"dtype float32 does not match"):
        sync.publish(tiny_qwen3(seed=0), 1, to=rx, dtype=torch.float32)
    missing = {k: v for k, v in bad.items() if k != name}
    with pytest.raises(ValueError, match="missing"):
        sync.publish(missing, 1, to=rx)
    assert rx.require_ready(0) == 0  # rejected before anything was staged: still ready at v0


def test_stale_weight_version_detected():
    master = tiny_qwen3(seed=0)
    engine = tiny_qwen3(seed=1, dtype=torch.bfloat16)
    rx = sync.receive(engine)
    sync.publish(master, 4, to=rx)
    # trainer steps to 5 but the update does not arrive (here: it is never sent)
    with pytest.raises(sync.WeightVersionError):
        sync.require_ready(engine, expected_version=5)
    rollouts = sync.stamp_weight_version([{"ids": [1]}, {"ids": [2]}], sync.require_ready(engine))
    with pytest.raises(sync.WeightVersionError, match="version 4, trainer expects 5.*one step stale"):
        sync.check_weight_version(rollouts, 5)
    sync.check_weight_version(rollouts, 4)
    with pytest.raises(sync.WeightVersionError, match="no weight version"):
        sync.check_weight_version([{"ids": [1]}], 4)


# ---- vLLM colocate (fake vLLM model: NOT real vLLM) ----------------------------------------------

def test_vllm_colocate_round_trip_through_load_weights():
    master = tiny_qwen3(seed=0)
    fake = FakeVllmQwen3(master)
    tx = VllmColocateSender(model=fake, bucket_bytes=8192)
    man = sync.publish(master, 3, to=tx)
    assert tx.require_ready(3) == 3 and fake.loads > 1  # bucketed
    sync.verify(fake, man, layout="vllm")
    c = cast_state(master)
    qkv = fake.holder["model.layers.0.self_attn.qkv_proj.weight"]
    want = torch.cat([c[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(qkv.view(torch.int16), want.view(torch.int16))


class CorruptingFake(FakeVllmQwen3):
    def load_weights(self, weights):
        weights = list(weights)
        super().load_weights(weights)
        for name, _ in weights:
            if name == "model.layers.1.self_attn.v_proj.weight":
                self.holder["model.layers.1.self_attn.qkv_proj.weight"].data.view(torch.int16)[-1, 0] ^= 1


def test_vllm_colocate_corrupt_load_detected_and_rolled_back():
    m1, m2 = tiny_qwen3(seed=0), tiny_qwen3(seed=2)
    fake = CorruptingFake(m1)
    tx = VllmColocateSender(model=fake)
    fake.__class__ = FakeVllmQwen3
    man1 = sync.publish(m1, 1, to=tx)
    fake.__class__ = CorruptingFake
    with pytest.raises(sync.FingerprintMismatchError) as ei:
        sync.publish(m2, 2, to=tx)
    assert ei.value.name == "model.layers.1.self_attn.v_proj.weight"
    fake.__class__ = FakeVllmQwen3
    with pytest.raises(sync.WeightsNotReadyError, match="v_proj"):
        sync.require_ready(fake)
    assert tx.state.version == 1
    # the restored bytes are version 1's (a plain dict: verify without the readiness check)
    sync.verify(dict(fake.named_parameters()), man1, layout="vllm", arch="Qwen3ForCausalLM")
    sync.publish(m2, 2, to=tx)
    assert sync.require_ready(fake, 2) == 2


def test_vllm_receiver_layout_writes_merged_tensors():
    master = tiny_qwen3(seed=0)
    fake = FakeVllmQwen3(master)
    rx = sync.receive(fake, layout="vllm", arch="Qwen3ForCausalLM")
    man = sync.publish(master, 1, to=rx)
    sync.verify(fake, man, layout="vllm")


# ---- logprobs after an update equal the trainer's (needs the engine and model path) ---------------

def _engine_api():
    try:
        from bitmatch.engine import Engine, SamplingParams
        from bitmatch.logprobs import token_logprobs
    except ImportError as e:  # pragma: no cover
        pytest.skip(f"bitmatch.engine / bitmatch.logprobs not importable yet: {e}")
    return Engine, SamplingParams, token_logprobs


@pytest.mark.parametrize("transport", ["inprocess", "tcp"])
def test_logprobs_after_update_equal_trainers(transport):
    Engine, SamplingParams, token_logprobs = _engine_api()
    from bitmatch.testing.models import tiny_model
    master = tiny_model("qwen3", dtype=torch.float32, seed=0)
    trainer = tiny_model("qwen3", dtype=torch.float32, seed=0)
    for p in trainer.parameters():
        p.data = compute_cast(p.data, torch.bfloat16)  # the trainer's compute weights
    engine_model = tiny_model("qwen3", dtype=torch.bfloat16, seed=5)  # stale
    stale = tiny_model("qwen3", dtype=torch.bfloat16, seed=5)  # control: the same check must fail on it
    rx = sync.receive(engine_model)
    if transport == "inprocess":
        sync.publish(master, 1, to=rx)
    else:
        with sync.serve(rx, "t0k") as srv:
            sync.publish(master, 1, to=sync.TcpSender(*srv.address, "t0k", bucket_bytes=1 << 16))
    version = sync.require_ready(engine_model, 1)
    engine = Engine(engine_model, block_size=16, seed=0)
    prompts = [[1, 5, 9, 20], [1, 7, 7, 7, 7, 30, 31]]
    outs = engine.generate(prompts, SamplingParams(temperature=0.9, max_tokens=6, ignore_eos=True),
                           use_tqdm=False)
    rollouts = sync.stamp_weight_version([{"output": o} for o in outs], version)  # TRL-style dicts
    sync.check_weight_version(rollouts, 1)
    for o in outs:
        ids = torch.tensor([o.prompt_token_ids + list(o.outputs[0].token_ids)])
        lp = token_logprobs(trainer, ids, temperature=0.9)[0, len(o.prompt_token_ids) - 1:]
        got = torch.tensor(o.outputs[0].logprobs, dtype=torch.float32)
        assert torch.equal(lp.detach().view(torch.int32), got.view(torch.int32)), (lp, got)
        lp_stale = token_logprobs(stale, ids, temperature=0.9)[0, len(o.prompt_token_ids) - 1:]
        assert not torch.equal(lp_stale.detach(), got)
