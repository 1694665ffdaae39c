"""The sync Receiver against a careless user and a token holder (issue 53, items 1, 2, 5, 6, 10):
replaced parameters, incremental updates into vLLM's merged tensors, missing or forged order
stamps, writes during a publish, writes into a tensor already finished. Each test fails on the
code before the fix (its control) and names the tensor the receiver refuses."""
from __future__ import annotations

import pytest
import torch

import bitmatch.sync as sync
import bitmatch.sync.transport_inprocess as tip
from bitmatch.engine import Engine, SamplingParams
from bitmatch.precision import compute_cast
from bitmatch.sync import hash as H, transport_tcp as T
from bitmatch.sync.names import build_layout
from bitmatch.testing.models import tiny_model
from sync_helpers import FakeVllmQwen3, bf16_target, bits_equal, tiny_qwen3, two_tensor_state

TOKEN = "trust-receiver-token"


def state(seed, n=4000):
    return two_tensor_state(seed, n, 10)


def hf_bits_equal(model, master):
    """Every parameter of ``model`` holds compute_cast(master's) bit for bit."""
    src = dict(master.named_parameters())
    return all(torch.equal(p.detach().view(torch.int16), compute_cast(src[k].detach(), p.dtype).view(torch.int16))
               for k, p in model.named_parameters())


def bump(model, *names):
    with torch.no_grad():
        for k, p in model.named_parameters():
            if not names or k in names:
                p.mul_(1.5).add_(0.25)


# ---- item 1: a parameter replaced under the receiver ----------------------------------------------------

def test_offload_and_reload_rebind_and_the_next_publish_reaches_the_engine():
    master, engine = tiny_qwen3(seed=0), tiny_qwen3(seed=1, dtype=torch.bfloat16)
    rx = sync.receive(engine)
    sync.publish(master, 1, to=rx)
    engine.to(torch.float32)
    engine.to(torch.bfloat16)  # an offload and reload (colocated sleep / wake): new storage, same bytes
    assert rx.require_ready(1) == 1  # the same verified bytes: re-bound, not refused
    bump(master)
    man2 = sync.publish(master, 2, to=rx)
    sync.verify(engine, man2)  # control: before the fix the update went into the orphaned tensors
    assert hf_bits_equal(engine, master) and sync.require_ready(engine, 2) == 2


def test_engine_after_offload_and_reload_samples_with_the_published_weights():
    """The issue's symptom: outputs stamped v2 while the engine computed with v1's bytes."""
    sp = SamplingParams(temperature=0.9, max_tokens=6, ignore_eos=True, seed=7)
    prompts = [[1, 5, 9, 13], [1, 40]]
    trainer = tiny_model("qwen3-hd64-gqa4-tied", dtype=torch.float32, seed=1, num_hidden_layers=1)
    rollout = tiny_model("qwen3-hd64-gqa4-tied", dtype=torch.bfloat16, seed=0, num_hidden_layers=1)
    rx, eng = sync.receive(rollout), Engine(rollout, num_gpu_blocks=16)
    sync.publish(trainer, 1, to=rx)
    eng.generate(prompts, sp, use_tqdm=False)
    rollout.to(torch.float32)
    rollout.to(torch.bfloat16)
    bump(trainer)
    man2 = sync.publish(trainer, 2, to=rx)
    outs = eng.generate(prompts, sp, use_tqdm=False)
    fresh = tiny_model("qwen3-hd64-gqa4-tied", dtype=torch.bfloat16, seed=0, num_hidden_layers=1)
    sync.publish(trainer, 2, to=sync.receive(fresh))
    want = Engine(fresh, num_gpu_blocks=16).generate(prompts, sp, use_tqdm=False)
    assert {(o.weight_version, o.weight_fingerprint) for o in outs} == {(2, man2.digest())}
    assert [o.outputs[0].logprobs for o in outs] == [o.outputs[0].logprobs for o in want]


@pytest.mark.parametrize("how", ["load_state_dict_assign", "data", "dict_entry"])
def test_a_parameter_replaced_by_other_bytes_is_refused_by_name(how):
    if how == "dict_entry":
        master, engine = state(1), bf16_target(state(1))
        rx = sync.receive(engine)
        sync.publish(master, 1, to=rx)
        engine["b.weight"] = torch.zeros_like(engine["b.weight"])
        name = "b.weight"
    else:
        master, engine = tiny_qwen3(seed=0), tiny_qwen3(seed=1, dtype=torch.bfloat16)
        rx = sync.receive(engine)
        sync.publish(master, 1, to=rx)
        name = "model.layers.1.mlp.down_proj.weight"
        if how == "data":
            engine.get_parameter(name).data = torch.zeros_like(engine.get_parameter(name))
        else:
            engine.load_state_dict({k: torch.zeros_like(v) if k == name else v.clone()
                                    for k, v in engine.state_dict().items()}, assign=True)
    with pytest.raises(sync.WeightsNotReadyError, match=f"{name}.*replaced"):
        rx.require_ready()
    with pytest.raises(sync.WeightsNotReadyError):  # stays refused until a full update
        rx.require_ready()
    man2 = sync.publish(master, 2, to=rx)  # the fix the error names: publish again
    sync.verify(engine, man2)
    assert rx.require_ready(2) == 2


def test_a_replaced_parameter_with_other_bytes_is_rewritten_by_the_next_publish():
    """No step between the replacement and the publish: the incremental publish must not keep it."""
    master, engine = tiny_qwen3(seed=0), tiny_qwen3(seed=1, dtype=torch.bfloat16)
    rx = sync.receive(engine)
    sync.publish(master, 1, to=rx)
    name = "model.layers.0.self_attn.o_proj.weight"
    engine.get_parameter(name).data = torch.zeros_like(engine.get_parameter(name))
    man2 = sync.publish(master, 2, to=rx)
    sync.verify(engine, man2)
    assert hf_bits_equal(engine, master) and rx.require_ready(2) == 2


# ---- item 2: incremental publish into vLLM's merged tensors ---------------------------------------------

def poison_freed_memory(nbytes):
    """Fill memory the allocator may hand out next with NaNs, so stale staging bytes cannot
    pass for the live ones by chance."""
    for _ in range(8):
        torch.full((nbytes // 2,), float("nan"), dtype=torch.bfloat16)


@pytest.mark.parametrize("changed", ["self_attn.q_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"])
def test_incremental_publish_keeps_the_unchanged_rows_of_a_merged_tensor(changed):
    master = tiny_qwen3(seed=0)
    fake = FakeVllmQwen3(master)
    rx = sync.receive(fake, layout="vllm")
    sync.publish(master, 1, to=rx)
    bump(master, f"model.layers.0.{changed}.weight")
    poison_freed_memory(1 << 16)
    man2 = sync.publish(master, 2, to=rx)
    sync.verify(fake, man2, layout="vllm")  # control: the other rows came from an uninitialised bank
    ref = FakeVllmQwen3(master)
    ref.load_weights((k, compute_cast(v.detach(), torch.bfloat16)) for k, v in master.named_parameters())
    assert all(torch.equal(p.view(torch.int16), ref.holder[k].view(torch.int16)) for k, p in fake.holder.items())
    assert rx.require_ready(2) == 2


@pytest.mark.parametrize("changed", ["model.layers.0.self_attn.k_proj.weight",
                                     "model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.up_proj.weight"])
def test_incremental_publish_into_a_moe_vllm_layout(changed):
    """The dense layers' merged tensors and the experts (renamed to FusedMoE's w13 / w2, not
    merged with another HF tensor: never affected, checked all the same)."""
    master = tiny_model("qwen3moe-e8-k2", dtype=torch.float32, seed=0)
    shapes = {k: tuple(v.shape) for k, v in master.named_parameters()}
    engine = {k: torch.zeros(s, dtype=torch.bfloat16)
              for k, s in build_layout("Qwen3MoeForCausalLM", shapes).engine_shapes.items()}
    rx = sync.receive(engine, layout="vllm", arch="Qwen3MoeForCausalLM")
    sync.publish(master, 1, to=rx)
    with torch.no_grad():
        master.get_parameter(changed).mul_(1.5)
    poison_freed_memory(1 << 16)
    man2 = sync.publish(master, 2, to=rx)
    sync.verify(engine, man2, layout="vllm", arch="Qwen3MoeForCausalLM")
    assert rx.require_ready(2) == 2


# ---- item 5: the canonical-order stamp is required and checked field by field ---------------------------

def forged_stamp(rx):
    stamp = dict(rx.order())
    field = next(k for k, v in stamp.items() if isinstance(v, int) and not isinstance(v, bool) and k != "fingerprint")
    stamp[field] += 1  # the fingerprint still claims the receiver's order
    return stamp, field


@pytest.mark.parametrize("case", ["missing", "forged", "string"])
def test_inprocess_update_without_a_true_order_stamp_is_refused(case, monkeypatch):
    m1, m2 = state(1), state(2)
    live = bf16_target(m1)
    rx = sync.receive(live)
    sync.publish(m1, 1, to=rx)
    stamp, field = forged_stamp(rx)
    bad = {"missing": None, "forged": stamp, "string": "reference"}[case]
    monkeypatch.setattr(tip, "sender_order", lambda w: bad)
    match = {"missing": "no canonical-order stamp", "forged": field, "string": "must be an object"}[case]
    with pytest.raises(sync.CanonicalOrderError, match=match):
        sync.publish(m2, 2, to=rx)
    assert rx.version == 1 and bits_equal(live, m1) and rx.state.manifest.order == rx.order()


def crafted_client(address):
    return T.TcpSender(*address, TOKEN, timeout=5)._connect()


def wire_specs(m):
    return {k: {"shape": list(v.shape), "dtype": "bfloat16", "fingerprint": None} for k, v in m.items()}


def test_tcp_begin_without_an_order_stamp_is_refused():
    m1, m2 = state(1), state(2)
    live = bf16_target(m1)
    rx = sync.receive(live)
    with sync.serve(rx, TOKEN) as srv:
        sync.publish(m1, 1, to=sync.TcpSender(*srv.address, TOKEN))
        ch = crafted_client(srv.address)
        ch.send({"type": "begin", "version": 2, "hash": "bmh1", "tensors": wire_specs(m2)})
        r = ch.recv()
        ch.sock.close()
    assert r["ok"] is False and "no canonical-order stamp" in r["error"], r
    assert rx.version == 1 and bits_equal(live, m1)


# ---- item 6: a write during the publish, after the tensor was checked -----------------------------------

def test_a_write_after_the_check_during_a_zero_copy_publish_is_not_sealed(monkeypatch):
    live = bf16_target(state(1))
    rx = sync.receive(live)
    sync.publish(live, 1, to=rx)  # zero copy: the engine runs on these very tensors
    orig = sync.Update.commit

    def commit(self, digest=None):  # the trainer's thread writes after the tensor was checked
        live["a.weight"].add_(1.0)
        return orig(self, digest)

    monkeypatch.setattr(sync.Update, "commit", commit)
    with pytest.raises(sync.SyncError, match="a.weight.*written"):  # control: sealed as verified before
        sync.publish(live, 2, to=rx)
    monkeypatch.undo()
    with pytest.raises(sync.WeightsNotReadyError):
        rx.require_ready()
    man3 = sync.publish(live, 3, to=rx)
    sync.verify(live, man3)
    assert rx.require_ready(3) == 3


# ---- item 10: a finished tensor is sealed -----------------------------------------------------------------

@pytest.mark.parametrize("verify_after_commit", [True, False])
def test_a_write_into_a_finished_tensor_is_refused(verify_after_commit):
    m1, m2 = state(1), state(2)
    live = bf16_target(m1)
    rx = sync.Receiver(live, verify_after_commit=verify_after_commit)
    sync.publish(m1, 1, to=rx)
    specs = {k: sync.TensorSpec(tuple(v.shape), torch.bfloat16) for k, v in m2.items()}
    with pytest.raises(sync.SyncError, match="a.weight.*finished"):
        with rx.begin(2, specs, order=rx.order()) as upd:
            for k, v in m2.items():
                b = compute_cast(v, torch.bfloat16).reshape(-1).view(torch.uint8)
                upd.buffer(k).copy_(b)
                upd.finish(k, H.fingerprint(b))
            upd.buffer("a.weight")[:8].fill_(7)  # control: accepted, switched, then failed or silent
            upd.commit()
    assert rx.version == 1 and bits_equal(live, m1)


def test_a_tcp_frame_into_a_finished_tensor_is_refused():
    m1, m2 = state(1), state(2)
    live = bf16_target(m1)
    rx = sync.receive(live)
    with sync.serve(rx, TOKEN) as srv:
        sync.publish(m1, 1, to=sync.TcpSender(*srv.address, TOKEN))
        ch = crafted_client(srv.address)
        ch.send({"type": "begin", "version": 2, "hash": "bmh1", "order": rx.order(), "tensors": wire_specs(m2)})
        assert ch.recv()["ok"]
        for k, v in m2.items():
            b = compute_cast(v, torch.bfloat16).reshape(-1).view(torch.uint8)
            ch.send({"type": "bucket", "segments": [[k, 0, b.numel()]], "finished": {k: H.fingerprint(b)}},
                    memoryview(b.numpy()))
        ch.send({"type": "bucket", "segments": [["a.weight", 0, 8]], "finished": {}}, b"\x07" * 8)
        r = ch.recv()  # control: before the fix the frame was taken without a word (no reply)
        ch.sock.close()
    assert r["ok"] is False and "a.weight" in r["error"] and "finished" in r["error"], r
    assert rx.version == 1 and bits_equal(live, m1)
