"""Tensor parallelism on several GPUs: the gather-only layout's bits and cost beside the stock one.

  python benchmarks/parallel/tp_layout.py --out DIR --world 2                  # 2 GPUs of one host, NCCL
  python benchmarks/parallel/tp_layout.py --out DIR --world 2 --device cpu --smoke   # gloo: the logic only
  python benchmarks/parallel/tp_layout.py --out DIR --world 1                  # one GPU: the shard linears only
  python benchmarks/parallel/tp_layout.py --out DIR --world 2 --layout dp_ep   # Qwen3-MoE, data-parallel attention + EP

Spawns ``--world`` processes (one GPU each, NCCL; gloo on CPU). Every rank builds the same seeded
random Qwen3 (default: Qwen3-1.7B widths, fewer layers) and, on its own device:
- TP = 1: ``bitmatch.token_logprobs`` of a left/right-padded batch (the trainer's bits);
- the gather-only layout (``parallel.enable_tensor_parallel``): the same call through the shard;
  mismatches against TP = 1 (the claim: 0);
- the stock layout (``row_parallel="allreduce"``: o_proj / down_proj split over K, partials summed
  by NCCL's all-reduce, Megatron's and vLLM's layer): mismatches (the control: > 0);
- the forward's time (packed prefill of the batch, no grad) for the three, and the embedded
  engine's rollout (the same prompts and seeds) at TP = 1 with CUDA graphs, TP = 1 eager and
  TP = world eager in both layouts (tokens and logprobs compared with TP = 1's).
The cost of the fixed-order layout is the ratio gather / allreduce at the same TP degree; the
single-GPU kernels are unchanged (no canonical order moved), so TP = 1 speed is today's. Rank 0
writes ``tp_layout.json``.

``--layout dp_ep``: a Qwen3-MoE (hidden 2048, 128 experts top-8, fewer layers), each rank its own
batch and prompts (``enable_expert_parallel``): every rank's trainer logprobs and rollout against
one process holding every expert (the claim: 0 mismatches), the stock EP combine (each rank's
partial all-reduced: the control), and the forward / rollout time of the three; written to
``tp_dp_ep.json``.

``--world 1`` (one GPU) times what a rank's row-parallel layer computes in each layout at Qwen3-8B
widths (o_proj 4096 x 4096, down_proj 4096 x 12288) for TP 2, 4, 8: the gather layout's
``shard_linear`` [T, K] x [N / TP, K] (full K, the full weight's K split) against the stock
partial [T, K / TP] x [N, K / TP] on cuBLAS (``torch.nn.functional.linear``) and on bitmatch's
linear: the single-GPU cost of the layout, collectives aside, written to ``tp_shard_linear.json``.
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common, the groups
import _common

# Qwen3-1.7B's widths (28 layers there)
FULL = dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
            vocab_size=151936, tie_word_embeddings=True)
SMOKE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             vocab_size=256, tie_word_embeddings=True)


def build(a, device):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(num_hidden_layers=a.layers, max_position_embeddings=8192, rope_theta=1e6,
                      **(SMOKE if a.smoke else FULL))
    torch.manual_seed(a.seed)
    with torch.device(device):
        m = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    return m.eval()


MOE_FULL = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936)
MOE_SMOKE = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256)


def build_moe(a, device):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(num_hidden_layers=a.layers, max_position_embeddings=8192, rope_theta=1e6,
                         norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                         **(MOE_SMOKE if a.smoke else MOE_FULL))
    torch.manual_seed(a.seed)
    with torch.device(device):
        m = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    return m.eval()


def batch(a, vocab, device, offset=0):
    g = torch.Generator().manual_seed(a.seed + 1 + offset)
    ids = torch.randint(3, vocab, (a.batch, a.seq), generator=g)
    mask = torch.ones_like(ids)
    mask[1 % a.batch, : a.seq // 4] = 0  # left padding
    mask[2 % a.batch, a.seq - a.seq // 3:] = 0  # right padding
    return ids.to(device), mask.to(device)


def mismatches(x, y):
    return int((x.view(torch.int32) != y.view(torch.int32)).sum())


def rollout(model, prompts, a, **kw):
    import bitmatch

    def params(i):
        return bitmatch.SamplingParams(temperature=1.0, max_tokens=a.new, ignore_eos=True, seed=1000 + i)

    eng = _common.engine(model, model.device, max_num_seqs=len(prompts), **kw)
    _common.engine_run(eng, prompts[:2], params)  # warm: compile, capture
    wall, steps, out = _common.engine_run(eng, prompts, params)
    return {"tokens_per_s": len(prompts) * a.new / wall, "decode_step_ms": _common.decode_ms(steps, a.new)}, out


def compare_rollouts(ref, got):
    toks = sum(x != y for (ta, _), (tb, _) in zip(ref, got) for x, y in zip(ta, tb))
    lps = sum(torch.tensor(la, dtype=torch.float32).view(torch.int32).ne(
        torch.tensor(lb, dtype=torch.float32).view(torch.int32)).sum().item()
        for (ta, la), (tb, lb) in zip(ref, got) if ta == tb)
    return {"token_mismatches": int(toks), "logprob_mismatches_on_equal_tokens": int(lps)}


def dp_rollout(model, prompts, a, ep):
    """Every rank's engine stepped together (``step_data_parallel``) on its own prompts."""
    import bitmatch
    from bitmatch.parallel import step_data_parallel

    eng = bitmatch.Engine(model, max_num_seqs=len(prompts))
    ids = [eng.add_request(p, bitmatch.SamplingParams(temperature=1.0, max_tokens=a.new, ignore_eos=True,
                                                      seed=1000 + i)) for i, p in enumerate(prompts)]
    done = {}
    _common.sync()
    t0 = time.perf_counter()
    while (finished := step_data_parallel(eng, ep)) is not None:
        for o in finished:
            done[o.request_id] = (list(o.outputs[0].token_ids), list(o.outputs[0].logprobs))
    _common.sync()
    return {"tokens_per_s": len(prompts) * a.new / (time.perf_counter() - t0)}, [done[i] for i in ids]


def dp_ep_worker(rank, a, ep, device):
    """--layout dp_ep on this rank: its own batch and prompts, one process vs the two EP combines."""
    import bitmatch
    from bitmatch.context import ForwardContext
    from bitmatch.models import forward_hidden
    from bitmatch.parallel import disable_tensor_parallel, enable_expert_parallel

    rec = _common.Recorder(os.path.join(a.out, "tp_dp_ep.json"), a) if rank == 0 else None
    model = build_moe(a, device)
    ids, mask = batch(a, model.config.vocab_size, device, offset=rank)
    flat = ids.reshape(-1)
    t = int(flat.numel())
    ctx = ForwardContext(positions=torch.arange(a.seq, device=device).repeat(a.batch),
                         cu_seqlens=torch.arange(0, t + 1, a.seq, device=device, dtype=torch.int32),
                         max_query_len=a.seq, max_seq_len=a.seq)
    g = torch.Generator().manual_seed(a.seed + 2 + rank)
    prompts = [torch.randint(3, model.config.vocab_size, (a.prompt_len,), generator=g).tolist()
               for _ in range(a.rollout_batch)]
    res = {"world": a.world, "backend": dist.get_backend(), "tokens_per_rank": t}
    with torch.no_grad():
        ref = bitmatch.token_logprobs(model, ids, mask)
        res["one_process_forward_ms"] = _common.cuda_ms(lambda: forward_hidden(model, flat, ctx), iters=a.iters)
    res["one_process_rollout"], ref_out = rollout(model, prompts, a, enforce_eager=True)
    for layout in ("gather", "allreduce"):
        enable_expert_parallel(model, ep, row_parallel=layout)
        try:
            with torch.no_grad():
                got = bitmatch.token_logprobs(model, ids, mask)
                dist.barrier()
                row = {"trainer_logprob_mismatches": mismatches(got, ref), "of": int(mask[:, 1:].sum()),
                       "forward_ms": _common.cuda_ms(lambda: forward_hidden(model, flat, ctx), iters=a.iters)}
            dist.barrier()
            row["rollout"], out = dp_rollout(model, prompts, a, ep)
            row["rollout"].update(compare_rollouts(ref_out, out))
        finally:
            disable_tensor_parallel(model)
        flags = [None] * a.world
        dist.all_gather_object(flags, (row["trainer_logprob_mismatches"], row["rollout"]["token_mismatches"],
                                       row["rollout"]["logprob_mismatches_on_equal_tokens"]))
        row["mismatches_per_rank"] = flags
        res["slot_order" if layout == "gather" else "stock_allreduce"] = row
    res["forward_slot_order_over_stock_time"] = res["slot_order"]["forward_ms"] / res["stock_allreduce"]["forward_ms"]
    res["forward_slot_order_over_one_process_time"] = res["slot_order"]["forward_ms"] / res["one_process_forward_ms"]
    if rec is not None:
        rec.put("dp_ep", res)
        print(res, flush=True)


def worker(rank, a, store):
    device = torch.device("cuda", rank) if a.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{store}",
                            rank=rank, world_size=a.world)
    import bitmatch
    from bitmatch.context import ForwardContext
    from bitmatch.models import forward_hidden
    from bitmatch.parallel import (
        TPGroup,
        disable_tensor_parallel,
        enable_tensor_parallel,
        token_logprobs as tp_logprobs,
    )

    tp = TPGroup.current()
    if a.layout == "dp_ep":
        dp_ep_worker(rank, a, tp, device)
        dist.barrier()
        dist.destroy_process_group()
        return
    rec = _common.Recorder(os.path.join(a.out, "tp_layout.json"), a) if rank == 0 else None
    res = {"world": a.world, "backend": dist.get_backend()}
    model = build(a, device)
    ids, mask = batch(a, model.config.vocab_size, device)
    t = int(ids.numel())
    flat = ids.reshape(-1)
    ctx = ForwardContext(positions=torch.arange(a.seq, device=device).repeat(a.batch),
                         cu_seqlens=torch.arange(0, t + 1, a.seq, device=device, dtype=torch.int32),
                         max_query_len=a.seq, max_seq_len=a.seq)
    g = torch.Generator().manual_seed(a.seed + 2)
    prompts = [torch.randint(3, model.config.vocab_size, (a.prompt_len,), generator=g).tolist()
               for _ in range(a.rollout_batch)]

    with torch.no_grad():
        ref = bitmatch.token_logprobs(model, ids, mask)
        res["tp1_forward_ms"] = _common.cuda_ms(lambda: forward_hidden(model, flat, ctx), iters=a.iters)
    res["tp1_rollout_graphs"], ref_out = rollout(model, prompts, a)
    res["tp1_rollout_eager"], out = rollout(model, prompts, a, enforce_eager=True)
    res["tp1_rollout_eager"].update(compare_rollouts(ref_out, out))
    for layout in ("gather", "allreduce"):
        shard = enable_tensor_parallel(model, tp, row_parallel=layout)
        try:
            with torch.no_grad():
                got = tp_logprobs(shard, ids, mask)
                dist.barrier()
                ms = _common.cuda_ms(lambda: forward_hidden(model, flat, ctx), iters=a.iters)
            row = {"trainer_logprob_mismatches": mismatches(got, ref), "of": int(mask[:, 1:].sum()),
                   "forward_ms": ms}
            dist.barrier()
            row["rollout"], out = rollout(model, prompts, a, enforce_eager=True)
            row["rollout"].update(compare_rollouts(ref_out, out))
        finally:
            disable_tensor_parallel(model)
        res[f"tp{a.world}_{layout}"] = row
        # every rank must agree on the gathered bits (the layout's claim is per rank)
        flags = [None] * a.world
        dist.all_gather_object(flags, row["trainer_logprob_mismatches"])
        row["mismatches_per_rank"] = flags
    g_ms, s_ms = res[f"tp{a.world}_gather"]["forward_ms"], res[f"tp{a.world}_allreduce"]["forward_ms"]
    res["forward_gather_over_allreduce_time"] = g_ms / s_ms
    res["rollout_gather_over_allreduce_tokens_per_s"] = (res[f"tp{a.world}_gather"]["rollout"]["tokens_per_s"]
                                                         / res[f"tp{a.world}_allreduce"]["rollout"]["tokens_per_s"])
    res["tokens"] = t
    if rec is not None:
        rec.put("tp_layout", res)
        print(res, flush=True)
    dist.barrier()
    dist.destroy_process_group()


LINEARS = {"o_proj": (4096, 4096), "down_proj": (4096, 12288)}  # Qwen3-8B (N, K)


def shard_linears(a):
    """Per-rank row-parallel linear time in the two layouts (one device, no collective)."""
    import torch.nn.functional as F

    import bitmatch.kernels as K
    from bitmatch.parallel import shard_linear

    dev = torch.device(a.device)
    rec = _common.Recorder(os.path.join(a.out, "tp_shard_linear.json"), a)
    shapes = {"tiny": (64, 256)} if a.smoke else LINEARS
    tokens = (1, 8) if a.smoke else (1, 64, 512, 4096)
    timer = _common.cuda_ms if dev.type == "cpu" else (lambda fn: _common.triton_bench(fn))
    rows = []
    for name, (n, k) in shapes.items():
        g = torch.Generator(device=dev).manual_seed(a.seed)
        w = (torch.randn(n, k, generator=g, device=dev) / k ** 0.5).to(torch.bfloat16)
        for t in tokens:
            x = torch.randn(t, k, generator=g, device=dev).to(torch.bfloat16)
            full = timer(lambda: K.linear(x, w))
            for tp in (2, 4, 8):
                w_rows, w_cols = w[: n // tp].contiguous(), w[:, : k // tp].contiguous()
                x_cols = x[:, : k // tp].contiguous()
                row = {"linear": name, "N": n, "K": k, "tokens": t, "tp": tp, "tp1_ms": full,
                       "gather_rows_ms": timer(lambda: shard_linear(x, w_rows, None, n)),
                       "stock_cols_cublas_ms": timer(lambda: F.linear(x_cols, w_cols)),
                       "stock_cols_bitmatch_ms": timer(lambda: K.linear(x_cols, w_cols))}
                row["gather_over_stock_cublas_time"] = row["gather_rows_ms"] / row["stock_cols_cublas_ms"]
                row["gather_over_tp1_share_time"] = row["gather_rows_ms"] / (full / tp)
                rows.append(row)
                rec.put("shard_linear", rows)
    print(rows[-1], flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layout", default="tp", choices=("tp", "dp_ep"),
                    help="tp: Qwen3 dense at TP = world; dp_ep: Qwen3-MoE, data-parallel attention + EP = world")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--smoke", action="store_true", help="tiny widths (with --device cpu: the script's logic only)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 8; smoke 2)")
    ap.add_argument("--batch", type=int, default=None, help="trainer batch rows (default 4; smoke 3)")
    ap.add_argument("--seq", type=int, default=None, help="trainer row length (default 1024; smoke 12)")
    ap.add_argument("--rollout-batch", type=int, default=None, help="prompts (default 64; smoke 3)")
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 128; smoke 5)")
    ap.add_argument("--new", type=int, default=None, help="sampled tokens per prompt (default 32; smoke 3)")
    ap.add_argument("--iters", type=int, default=None, help="timed forwards (default 10; smoke 1)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    defaults = dict(layers=(8, 2), batch=(4, 3), seq=(1024, 12), rollout_batch=(64, 3), prompt_len=(128, 5),
                    new=(32, 3), iters=(10, 1))
    for k, (full, smoke) in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, smoke if a.smoke else full)
    if a.world == 1:
        os.makedirs(a.out, exist_ok=True)
        shard_linears(a)
        return
    if a.device == "cuda" and torch.cuda.device_count() < a.world:
        raise SystemExit(f"tp_layout: --world {a.world} needs {a.world} GPUs, found {torch.cuda.device_count()}")
    os.makedirs(a.out, exist_ok=True)
    store = os.path.join(a.out, f".rendezvous-{os.getpid()}-{time.time_ns()}")
    mp.spawn(worker, args=(a, store), nprocs=a.world, join=True)
    if os.path.exists(store):
        os.remove(store)


if __name__ == "__main__":
    main()
