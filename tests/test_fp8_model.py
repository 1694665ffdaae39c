"""FP8 mode end to end (CPU reference backend): the engine's sampled-token logprobs with
``EngineConfig(quantization="fp8")`` equal ``token_logprobs(..., quantization="fp8")`` bit for bit
for dense and Qwen3-MoE tiny models over mixed batches and schedules; controls (the bf16 trainer, a
per-tensor-scaled quantizer) differ; the straight-through gradient reaches the master weights; a
weight update (in place, or through bitmatch.sync) re-quantizes; every mode not reproduced is
refused by name."""
from __future__ import annotations

import copy

import pytest
import torch

import bitmatch
import bitmatch.kernels as K
from bitmatch.context import ForwardContext
from bitmatch.engine import Engine, EngineConfig, SamplingParams
from bitmatch.engine.graphs import graph_safe
from bitmatch.kernels.fp8 import code_to_e4m3, e4m3_code, quantize_fp8_blocks
from bitmatch.models import forward_hidden, fp8_mode, lora
from bitmatch.models.registry import families
from bitmatch.sync import SyncError
from bitmatch.testing.models import pad_batch, random_prompts, tiny_model
from test_engine import mixed_params, temperature_of

FP8 = EngineConfig(quantization="fp8", max_num_seqs=3, max_num_batched_tokens=16, block_size=16)


def engine_vs_trainer(model, outs, params, quantization="fp8", batch=3):
    """(tokens compared, tokens whose fp32 bits differ): every sampled token's engine logprob against
    the trainer's, rescored in padded batches of ``batch`` per temperature."""
    n = bad = 0
    for t in sorted({temperature_of(p) for p in params}):
        idx = [i for i, p in enumerate(params) if temperature_of(p) == t]
        for s in range(0, len(idx), batch):
            group = [outs[i] for i in idx[s:s + batch]]
            seqs = [o.prompt_token_ids + o.outputs[0].token_ids for o in group]
            ids, mask = pad_batch(seqs, "right")
            with torch.no_grad():
                lp = bitmatch.token_logprobs(model, ids, mask, temperature=t, quantization=quantization)
            for b, o in enumerate(group):
                p, c = len(o.prompt_token_ids), len(o.outputs[0].token_ids)
                ref = lp[b, p - 1:p + c - 1]
                got = torch.tensor(o.outputs[0].logprobs, dtype=torch.float32)
                n += c
                bad += int((got.view(torch.int32) != ref.view(torch.int32)).sum())
    return n, bad


@pytest.mark.parametrize("name,cfg,n,max_tokens", [
    ("qwen3-hd64-gqa4-tied", FP8, 4, 3),
    ("qwen2-hd64-gqa1-bias-sw", EngineConfig(quantization="fp8", max_num_seqs=1, enable_chunked_prefill=False), 3, 3),
    ("qwen3moe-e8-k2", FP8, 3, 3),
])
def test_engine_equals_trainer_in_fp8(name, cfg, n, max_tokens):
    model = tiny_model(name, dtype=torch.bfloat16, seed=1)
    params = mixed_params(n, max_tokens)
    engine = Engine(model, config=cfg)   # held: the last engine's close drops what it derived
    outs = engine.generate(random_prompts(n, 2, 18, seed=7), params, use_tqdm=False)
    q_proj = model.model.layers[0].self_attn.q_proj
    kept = fp8_mode.kept_weights_of(q_proj)
    assert kept and kept[torch.bfloat16][0].dtype == torch.float8_e4m3fn, "the engine ran no FP8 projection"
    assert torch.equal(kept[torch.bfloat16][0].view(torch.uint8),
                       quantize_fp8_blocks(q_proj.weight)[0].view(torch.uint8))
    sparse = [layer.mlp.experts for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    for ex in sparse:   # Qwen3-MoE: the routed experts run FP8 too, quantized per expert
        q, sc = fp8_mode.kept_weights_of(ex, "gate_up_proj")[torch.bfloat16]
        assert q.shape == ex.gate_up_proj.shape and sc.shape[0] == ex.gate_up_proj.shape[0]
        assert torch.equal(q.view(torch.uint8), quantize_fp8_blocks(ex.gate_up_proj)[0].view(torch.uint8))
    assert graph_safe(model, "fp8") == (not sparse)   # the FP8 expert loop reads ids on the host: eager
    engine.close()
    assert not fp8_mode.kept_weights_of(q_proj), "the engine's close kept its FP8 bytes"
    n_tok, bad = engine_vs_trainer(model, outs, params)
    assert n_tok > 0 and bad == 0, f"{bad} of {n_tok} tokens differ"
    # control: the bf16 trainer scores the FP8 rollout with other bits
    n_tok, bad = engine_vs_trainer(model, outs, params, quantization=None)
    assert bad > n_tok // 2, f"control: only {bad} of {n_tok} tokens differ between the bf16 trainer and FP8 engine"


def _per_tensor_master(x, weight, bias=None, *, scale_fmt="float"):
    """Control: one scale for the whole weight (per-tensor FP8), not one per 128 x 128 block."""
    w = weight.detach().float()
    s = (w.abs().max() / 448.0).reshape(1)
    q = code_to_e4m3(e4m3_code(w / s))
    grid = s.expand(-(-w.shape[0] // 128), -(-w.shape[1] // 128)).contiguous()
    return K.fp8_linear(x, q, grid, bias)


def test_control_per_tensor_scale_differs(monkeypatch):
    model = bitmatch.patch(tiny_model("qwen3-hd64-gqa4-tied", dtype=torch.bfloat16, seed=2), quantization="fp8")
    ids = torch.tensor([[4, 9, 17, 30, 5]])
    with torch.no_grad():   # the patched HF forward runs the patch's mode
        fp8_logits = model(ids).logits
        assert not torch.equal(fp8_logits, bitmatch.patch(model)(ids).logits)
        assert torch.equal(fp8_logits, bitmatch.patch(model, quantization="fp8")(ids).logits)
    params = [SamplingParams(temperature=1.0, max_tokens=4, seed=i) for i in range(3)]
    outs = Engine(model, max_num_seqs=3).generate(random_prompts(3, 4, 16, seed=3), params, use_tqdm=False)
    n_tok, bad = engine_vs_trainer(model, outs, params, quantization=None)  # None: the patch's "fp8"
    assert n_tok > 0 and bad == 0
    with torch.no_grad():  # the weights' block scales differ from their tensor scale here
        model.model.layers[0].self_attn.q_proj.weight[:128] *= 4
    outs = Engine(model, max_num_seqs=3).generate(random_prompts(3, 4, 16, seed=3), params, use_tqdm=False)
    monkeypatch.setattr(K, "fp8_linear_master", _per_tensor_master)
    n_tok, bad = engine_vs_trainer(model, outs, params)
    assert bad > n_tok // 2, f"control: a per-tensor scale changed only {bad} of {n_tok} tokens"


@pytest.mark.parametrize("master", [torch.bfloat16, torch.float32])
def test_straight_through_gradient_reaches_master(master):
    lin = torch.nn.Linear(192, 160, bias=False, dtype=master)
    x = torch.randn(7, 192, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(7, 160, dtype=torch.bfloat16)
    with fp8_mode.projections("fp8"):
        y = fp8_mode.linear(lin, x, torch.bfloat16)
    wq, sw = quantize_fp8_blocks(lin.weight.detach().to(torch.bfloat16))
    assert torch.equal(y.view(torch.int16), K.fp8_linear(x.detach(), wq, sw).view(torch.int16))
    y.backward(g)
    assert lin.weight.grad is not None and lin.weight.grad.dtype == master
    assert torch.equal(lin.weight.grad, (g.t() @ x.detach()).to(master))   # grad_w = g^T x, straight through
    # and through a whole model: every projection's master gets a finite gradient
    model = tiny_model("qwen3moe-e4-k1-step2", dtype=master, seed=4)
    ids, mask = pad_batch(random_prompts(2, 4, 10, seed=5), "left")
    lp = bitmatch.token_logprobs(model, ids, mask, quantization="fp8", compute_dtype=torch.bfloat16)
    lp.sum().backward()
    for name, p in model.named_parameters():
        if name.endswith(("_proj.weight", "experts.gate_up_proj", "experts.down_proj", "mlp.gate.weight")):
            assert p.grad is not None and bool(torch.isfinite(p.grad).all()) and p.grad.abs().sum() > 0, name


def test_weight_update_requantizes():
    model = tiny_model("qwen3-hd64-gqa4-tied", dtype=torch.bfloat16, seed=6)
    engine = Engine(model, config=FP8)
    params = mixed_params(3, 3, seed=1)
    prompts = random_prompts(3, 3, 14, seed=8)
    engine.generate(prompts, params, use_tqdm=False)
    q_proj = model.model.layers[1].mlp.down_proj
    before = fp8_mode.kept_weights_of(q_proj)[torch.bfloat16][0].clone()
    with torch.no_grad():   # an optimizer step on the shared master weights
        for name, p in model.named_parameters():
            if name.endswith("_proj.weight"):
                p.add_(torch.randn_like(p) * 0.02)
    outs = engine.generate(prompts, params, use_tqdm=False)
    after = fp8_mode.kept_weights_of(q_proj)[torch.bfloat16][0]
    assert not torch.equal(before.view(torch.uint8), after.view(torch.uint8)), "the FP8 bytes were not re-quantized"
    n_tok, bad = engine_vs_trainer(model, outs, params)
    assert n_tok > 0 and bad == 0


def test_sync_records_fp8_and_refuses_mixing():
    trainer = tiny_model("qwen3-hd64-gqa4-tied", dtype=torch.bfloat16, seed=9)
    rollout = copy.deepcopy(trainer)
    rx = bitmatch.sync.receive(rollout, quantization="fp8")
    with pytest.raises(SyncError, match="quantization=None.*quantization='fp8'"):
        bitmatch.sync.publish(trainer, 1, to=rx)   # a bf16 sender into an FP8 receiver
    with torch.no_grad():
        trainer.model.layers[0].self_attn.o_proj.weight.mul_(1.5)
    man = bitmatch.sync.publish(trainer, 2, to=rx, quantization="fp8")
    assert man.quantization == "fp8" and rx.state.manifest.quantization == "fp8"
    assert bitmatch.sync.Manifest.from_json(man.to_json()).digest() == man.digest()
    params = [SamplingParams(temperature=0.8, max_tokens=3, seed=i) for i in range(2)]
    outs = Engine(rollout, config=FP8).generate(random_prompts(2, 3, 12, seed=1), params, use_tqdm=False)
    assert all(o.weight_version == 2 for o in outs)
    n_tok, bad = engine_vs_trainer(trainer, outs, params)
    assert n_tok > 0 and bad == 0
    with pytest.raises(ValueError, match="receiver .* quantization='fp8'"):   # a bf16 engine on an FP8 receiver
        Engine(rollout, max_num_seqs=2).generate([[1, 2, 3]], params[0], use_tqdm=False)


def test_sync_over_tcp_carries_the_mode():
    trainer = tiny_model("qwen3-hd64-gqa4-tied", dtype=torch.bfloat16, seed=9)
    token = "fp8-test-token"
    rx_fp8 = bitmatch.sync.receive(copy.deepcopy(trainer), quantization="fp8")
    rx_bf16 = bitmatch.sync.receive(copy.deepcopy(trainer))
    with bitmatch.sync.serve(rx_fp8, token) as a, bitmatch.sync.serve(rx_bf16, token) as b:
        man = bitmatch.sync.publish(trainer, 1, to=bitmatch.sync.TcpSender(*a.address, token), quantization="fp8")
        assert man.quantization == "fp8" and man.digest() == rx_fp8.state.manifest.digest()
        with pytest.raises(SyncError, match="quantization='fp8'.*quantization=None"):   # an FP8 sender, a bf16 receiver
            bitmatch.sync.publish(trainer, 1, to=bitmatch.sync.TcpSender(*b.address, token), quantization="fp8")
        with pytest.raises(SyncError, match="quantization=None.*quantization='fp8'"):   # the reverse
            bitmatch.sync.publish(trainer, 2, to=bitmatch.sync.TcpSender(*a.address, token))
    assert rx_fp8.version == 1 and rx_bf16.version is None


def test_refused_by_name():
    model = tiny_model("qwen3-hd64-gqa4-tied", dtype=torch.bfloat16, seed=0)
    ids = torch.tensor([[1, 5, 7, 9]])
    for bad in ("int8", "fp8_e5m2", "FP8", 8):
        with pytest.raises(ValueError, match="quantization=.*not supported"):
            bitmatch.token_logprobs(model, ids, quantization=bad)
        with pytest.raises(ValueError, match="quantization=.*not supported"):
            EngineConfig(quantization=bad)
        with pytest.raises(ValueError, match="quantization=.*not supported"):
            bitmatch.patch(copy.deepcopy(model), quantization=bad)
        with pytest.raises(ValueError, match="quantization=.*not supported"):
            bitmatch.sync.receive(copy.deepcopy(model), quantization=bad)
    assert Engine(model, quantization="fp8", max_num_seqs=1).quantization == "fp8"  # vLLM's keyword is taken
    for fam in families():
        if "fp8" not in fam.quantizations:
            assert fam.name in ("nemotron_h", "deepseek_v4")
            with pytest.raises(ValueError, match=f"not wired for the '{fam.name}' family"):
                fp8_mode.check_model(model, fam, "fp8", "token_logprobs")
    v4 = tiny_model("deepseek_v4", dtype=torch.bfloat16, seed=0)
    ctx = ForwardContext(positions=torch.arange(3), cu_seqlens=torch.tensor([0, 3], dtype=torch.int32),
                         quantization="fp8")
    for who, call in [("patch", lambda: bitmatch.patch(v4, quantization="fp8")),
                      ("token_logprobs", lambda: bitmatch.token_logprobs(v4, ids, quantization="fp8")),
                      ("Engine", lambda: Engine(v4, quantization="fp8", max_num_seqs=1)),
                      ("forward_hidden", lambda: forward_hidden(v4, ids[0, :3], ctx))]:   # never bf16 in silence
        with pytest.raises(ValueError, match=f"{who}: quantization='fp8' is not wired for the 'deepseek_v4'"):
            call()
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="PEFT LoRA layers"):
        bitmatch.token_logprobs(lora, ids, quantization="fp8")
    with pytest.raises(ValueError, match="PEFT LoRA layers"):
        Engine(lora, quantization="fp8")


@pytest.mark.interpreter
def test_trainer_and_engine_linear_agree_on_triton():
    """The trainer's path (fp8_linear_master) and the engine's (kept bytes + fp8_linear) on the Triton
    backend (the interpreter on CPU): the same bits, and the kept bytes are the reference quantizer's."""
    lin = torch.nn.Linear(192, 200, dtype=torch.bfloat16)
    x = torch.randn(5, 192, dtype=torch.bfloat16)
    with K.use_backend("triton"), fp8_mode.projections("fp8"):
        trainer = fp8_mode.linear(lin, x.requires_grad_(True), torch.bfloat16).detach()
        with torch.no_grad(), lora.kept_weights(True):
            engine = fp8_mode.linear(lin, x.detach(), torch.bfloat16)
    q, _ = fp8_mode.kept_weights_of(lin)[torch.bfloat16]
    assert torch.equal(q.view(torch.uint8), quantize_fp8_blocks(lin.weight)[0].view(torch.uint8))
    assert torch.equal(trainer.view(torch.int16), engine.view(torch.int16))
