"""DeepSeek-V4 attention on bitmatch.kernels: one path for the trainer (packed prefill) and the
engine (paged caches). See ``deepseek_v4`` for the layer and the family.

Op order of one attention block (x = input_layernorm of the collapsed streams, [T, hidden]):
    q_res = rms_norm(linear(x, Wqa), q_a_norm);  q = rms_norm_unweighted(linear(q_res, Wqb) [T, H, D])
    kv    = rms_norm(linear(x, Wkv), kv_norm)    [T, D]   (the single K = V head)
    q, kv = apply_rotary_interleaved(., cos, sin)         (last rope_dim channels; sliding layers the
                                                            "main" rope, compressed layers "compress")
    compressor (CSA / HCA): raw projections C = linear(x, Wc), Z = linear(x, Wz) per token; entry c
        = rope(rms_norm(compress_windows(window c [, c-1])), position c*m), computed ONCE, in the
        step that computes its window's last token, and stored at the address of that token
        (closing_entries: every row's window is pooled from rows read through the step's KeyRows,
        and only closing rows' entries are ever read, so nothing is picked out on the host)
    CSA: indexer entries likewise at index_head_dim; selected = indexer_select(q_idx, keys, w =
        linear(x, Ww) * H_i^-0.5) [T, top_k]; HCA: every entry c complete at t ((c+1)*m <= t+1)
    o = sink_attention_rows(q, kv store, entry store, selected, sinks)   all rows, one call
    o = apply_rotary_interleaved(o, cos, sin, inverse=True)             (de-rotate: K = V)
    o = linear(cat_g linear(o_g, Woa_g), Wob)                           (grouped output projection)

One code path for both sides: the kv / raw / entry stores are the paged caches (engine, through
the block table) or the step's own rows (trainer, packed from position 0), the same addressing
(``KeyRows``), the same kernels. No per-sequence loop and no host read on the Triton backend, so
a decode step can run in a CUDA graph.

Engine caches (cache groups of kind "paged", per token, at the token's slot): "swa" (kv),
"hca" (kv, C, Z, entry), "csa" (kv, C, Z, entry, C_idx, Z_idx, entry_idx). A token's state depends
only on the tokens up to it, so prefix caching stays correct; an entry slot is read back only at a
window's closing position, so what a non-closing row writes there is never used.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

import bitmatch.kernels as K
from bitmatch.kernels import KeyRows
from bitmatch.models.dense import fused_linear, linear, plain_module, rms_norm
from bitmatch.precision import cast_param

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
GROUP_OF = {SLIDING: "swa", CSA: "csa", HCA: "hca"}
# the attention block reads nothing back to the host on the Triton backend (tests/test_dsv4_batched.py
# probes a decode step): DeepseekV4Family.cuda_graph_safe reads this to opt the family into graphs
HOST_READ_FREE = True
CACHE_NAMES = {"swa": ("kv",), "hca": ("kv", "ckv", "cgate", "entry"),
               "csa": ("kv", "ckv", "cgate", "entry", "ikv", "igate", "ientry")}


def _kernels():
    """The kernels package: ops are read as ``K.op`` at call time (``kernels.override`` swaps them)."""
    return K


def cache_tensors(spec, group: str, dtype) -> tuple:
    """((shape, dtype), ...) per token for ``group`` (see CACHE_NAMES)."""
    d, di = spec.head_dim, spec.index_head_dim
    shapes = {"kv": d, "ckv": 2 * d if group == "csa" else d, "cgate": 2 * d if group == "csa" else d,
              "entry": d, "ikv": 2 * di, "igate": 2 * di, "ientry": di}
    return tuple(((shapes[n],), dtype) for n in CACHE_NAMES[group])


def sequences(ctx, positions) -> KeyRows:
    """How every row of the step finds the positions of its own sequence (``KeyRows``): the paged
    caches through the block table (engine), or the packed step rows (trainer: each sequence's
    rows contiguous from position 0). Device ops only; the bound on positions is a host int
    (``ctx.max_seq_len``: the longest sequence; else the block table's width, or T), so a decode
    step can be a CUDA graph."""
    T = positions.shape[0]
    if ctx.paged:
        bs = next(iter(next(iter(ctx.caches.values())).values()))[0].shape[1]
        return KeyRows.paged(ctx.block_table, bs, ctx.query_start_loc, T, max_len=ctx.max_seq_len)
    if ctx.cu_seqlens is None:
        raise ValueError("bitmatch: ForwardContext needs cu_seqlens (packed prefill) or slot_mapping (paged)")
    # the longest sequence (a host int) bounds positions: the indexer's scores are [T, longest / m],
    # not [T, T / m] (every visible column is inside either bound, so the selection is the same)
    rows = KeyRows.packed(positions, max_len=ctx.max_seq_len)
    cu = ctx.cu_seqlens.to(positions.device)
    seq = torch.searchsorted(cu[1:].contiguous(), torch.arange(T, device=cu.device, dtype=cu.dtype), right=True)
    # compressed windows sit at absolute positions from the sequence start: a packed row must be a
    # whole sequence from position 0 (a prefill continuing a cache runs through the engine)
    ok = (rows.row_start == cu.long()[seq.clamp(max=cu.shape[0] - 2)]).all()
    msg = "bitmatch deepseek_v4: packed sequences must have positions 0..n-1 (compressed windows start at position 0)"
    if _kernels().host_readable(positions):
        if T and not bool(ok):
            raise ValueError(msg)
    elif T:
        _kernels().check_on_device(ok, msg)
    return rows


def rope_lookup(spec, ctx, rows: KeyRows):
    """rope_at(positions, kind) -> (cos, sin) fp32 of ``kernels.rotary_cos_sin`` with the step's host
    bound ``rows.max_len`` (positions < it): the kernel gathers the rows from its table with no read
    back, on every backend, so the engine's first prefill builds the table and its decode steps read
    nothing back (the kernel keeps every table a captured graph may read). Same bits as without the
    bound (a row depends only on its position)."""
    K = _kernels()
    windows = {}  # (id(positions), rate) -> (positions, cos, sin): the tensor kept, so its id stays its own

    def rope_at(positions, kind, window_rate=None):
        """cos/sin at ``positions``; with ``window_rate`` m, at each row's window start (position
        + 1 - m, clamped at 0), looked up once per step for every compressed layer of that rate."""
        if window_rate is not None:
            key = (id(positions), window_rate)
            if key not in windows:
                windows[key] = (positions, *rope_at((positions + 1 - window_rate).clamp(min=0), kind))
            return windows[key][1:]
        base, scaling = spec.rope_main if kind == "main" else spec.rope_compress
        return K.rotary_cos_sin(positions, spec.rope_dim, base, scaling, dtype=torch.float32,
                                max_position_embeddings=spec.max_position_embeddings, max_seq_len=rows.max_len)
    return rope_at


@dataclass
class QueryHeads:
    """The query heads one attention block computes, and their output projection: all of them
    (``all_heads``, one process) or a tensor-parallel rank's whole output groups
    (``deepseek_v4_tp``). Everything else in the block (the K = V head, the
    compressors, the indexer) is the same for any heads: a head's bits depend only on its own
    q_b rows, its sink and the shared keys, and an output group only on its own heads.

    ``enter``: applied to every replicated tensor the heads read (q_res, the K = V store, the entries):
    the identity, or the tensor-parallel copy whose backward sums the ranks' gradients."""
    q_b: Callable          # q_res [T, q_lora_rank] -> [T, heads * head_dim]
    sinks: torch.Tensor    # fp32 [heads]
    o_a: torch.Tensor      # [groups, o_lora_rank, heads_per_group * head_dim] in the compute dtype
    o_b: Callable          # [T, groups * o_lora_rank] -> [T, hidden]
    enter: Callable = lambda t: t


def all_heads(attn, spec, dtype) -> QueryHeads:
    """Every head of ``attn`` (the one-process block)."""
    g = spec.o_groups
    return QueryHeads(q_b=lambda q_res: linear(attn.q_b_proj, q_res, dtype),
                      sinks=cast_param(attn.sinks, torch.float32),
                      o_a=cast_param(plain_module(attn.o_a_proj, "self_attn.o_a_proj (the grouped output "
                                                        "projection)").weight, dtype).view(
                          g, -1, spec.num_heads * spec.head_dim // g),
                      o_b=lambda y: linear(attn.o_b_proj, y, dtype))


def _flat(t):
    return t.view(-1, *t.shape[2:])


def closing_entries(mod, raw_kv, raw_gate, rows, positions, rate, overlap, dtype, rope_at, closing_only=False):
    """[T, D]: for every row, the entry of the window ending at its position (pooled from the raw
    projections ``raw_kv``/``raw_gate`` [S, C] read through ``rows``, RMS-normed, rotated at the
    window's first position: HF's compressor / indexer compressor). Only rows closing a window
    ((t+1) % rate == 0) give a real entry; the others are never read (an entry is read at the
    address of its window's closing position only), so no row is picked out on the host.
    ``closing_only`` (the trainer: every sequence packed from position 0, so at most T // rate rows
    close a window): only the closing rows are computed (``nonzero_static``, no host read), the
    others are zeros; a closing row's entry is its own window's, so its bits are the same."""
    t_all = positions.long()
    T = t_all.shape[0]
    if closing_only and T < rate:  # no window closes in the step
        return raw_kv.new_zeros((T, mod.kv_norm.weight.shape[0]), dtype=dtype)
    if not closing_only:
        return _pooled_entries(mod, raw_kv, raw_gate, rows, t_all, rate, overlap, dtype, rope_at)
    pick = torch.nonzero_static((t_all + 1) % rate == 0, size=T // rate, fill_value=T)[:, 0]
    at = pick.clamp(max=max(T - 1, 0))  # the padding computes row T-1's window, then lands on row T
    ent = _pooled_entries(mod, raw_kv, raw_gate, rows.take(at), t_all[at], rate, overlap, dtype, rope_at)
    full = ent.new_zeros((T + 1, ent.shape[1]))
    return full.index_copy(0, pick, ent)[:T]


def _pooled_entries(mod, raw_kv, raw_gate, rows, t_all, rate, overlap, dtype, rope_at):
    K = _kernels()
    bias = cast_param(mod.position_bias, torch.float32)
    pooled = K.compress_rows(raw_kv, raw_gate, bias, t_all, rows, rate=rate, overlap=overlap)
    normed = rms_norm(mod.kv_norm, pooled, dtype)
    cos, sin = rope_at(t_all, "compress", window_rate=rate)
    return K.apply_rotary_interleaved(normed, cos, sin)


def _entry_store(mod, names, store, cache, rows, ctx, rate, overlap, dtype, rope_at):
    """The entry store [S, D] of this layer: the engine writes every row's entry at the row's slot
    (closing rows real, the rest never read) and reads the cache; the trainer's store is the step."""
    kv_name, gate_name, entry_name = names
    ent = closing_entries(mod, store[kv_name], store[gate_name], rows, ctx.positions, rate, overlap, dtype, rope_at,
                          closing_only=cache is None)
    if cache is None:
        return ent
    _flat(cache[entry_name]).index_copy_(0, ctx.slot_mapping, ent.detach())
    return _flat(cache[entry_name])


def attention(attn, x, input_pos, rope, rope_at, ctx, spec, layer_idx, dtype, seqs, rec=None, prefix="self_attn",
              heads: QueryHeads | None = None):
    """One DeepSeek-V4 attention block on rows x [T, hidden] -> [T, hidden], over ``heads`` (default:
    all of them). Invariance: a head's output rows are the same bits whichever heads run beside it."""
    K = _kernels()
    lt = spec.layer_types[layer_idx]
    cos, sin = rope["main" if lt == SLIDING else "compress"]
    T = x.shape[0]
    D = spec.head_dim
    heads = all_heads(attn, spec, dtype) if heads is None else heads
    q_res = rms_norm(attn.q_a_norm, linear(attn.q_a_proj, x, dtype), dtype)
    q = heads.q_b(heads.enter(q_res)).view(T, -1, D)
    q = K.rms_norm(q, torch.ones(D, dtype=dtype, device=x.device), spec.rms_eps)  # HF's unweighted q_b_norm
    q = K.apply_rotary_interleaved(q, cos, sin)
    kv = K.apply_rotary_interleaved(rms_norm(attn.kv_norm, linear(attn.kv_proj, x, dtype), dtype), cos, sin)
    if rec is not None:
        rec(f"{prefix}.q", q)
        rec(f"{prefix}.kv", kv)
    step = {"kv": kv}
    comp = attn.compressor
    if comp is not None:
        # the engine's paged steps: kv and gate as one GEMM on a fused copy (linear segments: the
        # same bits), kept on the attention module, which refresh_fused brings up to date
        step["ckv"], step["cgate"] = fused_linear(attn, "compressor_kv_gate", (comp.kv_proj, comp.gate_proj), x,
                                                   dtype, fuse=ctx.paged)
    # the indexer's selection is piecewise constant (no gradient, HF's neither): its projections and
    # index keys run without a graph, so the trainer saves none of their activations (same bits)
    if lt == CSA:
        idx = comp.indexer
        with torch.no_grad():
            step["ikv"], step["igate"] = fused_linear(attn, "indexer_kv_gate", (idx.kv_proj, idx.gate_proj), x,
                                                       dtype, fuse=ctx.paged)
            iq = linear(idx.q_b_proj, q_res, dtype).view(T, spec.index_n_heads, spec.index_head_dim)
            iq = K.apply_rotary_interleaved(iq, cos, sin)
            iw = linear(idx.scorer.weights_proj, x, dtype).float() * (spec.index_n_heads ** -0.5)
    cache, store = None, step
    if ctx.paged:
        group = GROUP_OF[lt]
        cache = dict(zip(CACHE_NAMES[group], ctx.cache(group, layer_idx)))
        for name, val in step.items():
            _flat(cache[name]).index_copy_(0, ctx.slot_mapping, val.detach())
        store = {name: _flat(t) for name, t in cache.items()}
    rows = seqs
    entries, selected, m = None, None, 0
    if comp is not None:
        m = spec.compress_rates[lt]
        entries = _entry_store(comp, ("ckv", "cgate", "entry"), store, cache, rows, ctx, m, lt == CSA, dtype, rope_at)
    if lt == CSA:
        with torch.no_grad():
            ikeys = _entry_store(comp.indexer, ("ikv", "igate", "ientry"), store, cache, rows, ctx, m, True, dtype,
                                 rope_at)
            selected = K.indexer_select(iq, ctx.positions, ikeys, iw, rows, rate=m, top_k=spec.index_topk,
                                        softmax_scale=spec.index_head_dim ** -0.5)
        if rec is not None:  # per query token: the selected entry indices ascending, -1 padded
            rec(f"{prefix}.indexer", selected.long())
    o = K.sink_attention_rows(q, ctx.positions, heads.enter(store["kv"]), heads.sinks, rows,
                              scale=spec.scale, window=spec.sliding_window,
                              entries=None if entries is None else heads.enter(entries), rate=m, selected=selected)
    o = K.apply_rotary_interleaved(o, cos, sin, inverse=True)
    if rec is not None:
        rec(f"{prefix}.attn", o)
    w_a = heads.o_a
    g = w_a.shape[0]
    og = o.reshape(T, g, w_a.shape[2])
    # g launches of the invariant linear (no host read): a grouped invariant GEMM is future work
    grouped = torch.cat([K.linear(og[:, i], w_a[i]) for i in range(g)], dim=-1)
    out = heads.o_b(grouped)
    if rec is not None:
        rec(f"{prefix}.o_proj", out)
    return out
