"""Batch-invariant linear: out[M, N] = x[M, K] @ weight[N, K]^T (+ bias), in x.dtype.

Canonical order (fixes the bits; independent of M):
  K is cut into SPLIT chunks of K_CHUNK elements (SPLIT = split_for(N, K), a function of the
  weight shape only). Each chunk is a sequential tensor-core accumulation in fp32 starting from
  zero; the chunk sums are added in chunk order to 0.0; then + bias (fp32) and one rounding.
Tile shapes (BM, BN, BK, warps, stages) do not change the bits (DESIGN section 4: sequential
K accumulation on tensor cores gives the same bits for every tile config), so they are chosen
per M from a fixed table (never autotuned at run time). Small M may run the SPLIT chunks on
separate programs ("split" mode: fp32 partials + an ordered reduce) or in one program
("fused" mode: two accumulators); both give the same bits.
"""
import torch
import triton
import triton.language as tl

from .. import order
from . import interpreting, sm_count


def split_for(N: int, K: int) -> int:
    """K chunks of a weight of shape (N, K) under the active canonical order (kernels/order.py:
    ``linear_split_table``, stamped into every weight manifest); any shape not listed: 1."""
    o = order.current()
    s = o.split_table.get((N, K), 1)
    # a chunk must hold whole aligned blocks (its length a multiple of every BK in the tables)
    while s > 1 and (K % s != 0 or (K // s) % o.linear_chunk_align != 0):
        s -= 1
    return max(s, 1)


# (max_M, BM, BN, BK, GROUP_M, warps, stages, mode); first row with M <= max_M is used.
# mode "split" is used only when split_for(N, K) > 1, else falls back to "fused"; mode "tma" runs
# the persistent TMA kernel below with the row's tiles (bf16 / fp16 operands only).
CONFIG_TABLE = [
    (16, 16, 64, 128, 8, 4, 4, "split"),
    (32, 32, 64, 128, 8, 4, 4, "split"),
    (64, 64, 64, 128, 8, 4, 4, "split"),
    (128, 64, 128, 64, 8, 4, 4, "split"),
    (256, 128, 128, 64, 8, 8, 3, "fused"),
    (1 << 62, 128, 256, 64, 8, 8, 3, "fused"),
]


# Per weight shape (N, K): the fastest config per M bucket of a sweep on the target GPU
# (benchmarks/ops/gpu_ops.py --sweep); bucket bounds are the swept M values. Tuning rule: any tile
# shape may win, since tiles never change the bits (each K chunk is one sequential accumulation
# whatever BM / BN / BK); the sweep checks every candidate's bits against the others of the same
# split, and a config whose bits differ is a bug, not a choice.
def _t(rows):
    return [(m, *c) for m, c in rows]


CONFIG_TABLES = {
    # M <= 256 rows: timed inside CUDA graphs (decode launches are graph replays); larger M: eager.
    (6144, 4096): _t([(8, (16, 32, 128, 8, 4, 6, "fused")), (32, (32, 32, 256, 8, 4, 4, "fused")),
                      (64, (64, 64, 128, 8, 4, 4, "fused")), (128, (64, 64, 64, 8, 4, 6, "fused")),
                      (256, (128, 64, 64, 8, 4, 4, "fused")), (512, (128, 128, 64, 8, 8, 3, "fused")),
                      (1024, (128, 128, 128, 8, 8, 3, "fused")),
                      (1 << 62, (256, 128, 64, 8, 8, 3, "fused"))]),
    (4096, 4096): _t([(8, (16, 32, 128, 8, 4, 6, "split")), (32, (32, 64, 128, 8, 4, 4, "split")),
                      (64, (64, 64, 128, 8, 4, 4, "split")), (128, (64, 64, 64, 8, 4, 6, "split")),
                      (256, (64, 128, 64, 8, 4, 4, "split")), (512, (128, 128, 64, 8, 8, 3, "fused")),
                      (1 << 62, (128, 128, 64, 8, 8, 4, "fused"))]),
    (24576, 4096): _t([(8, (16, 64, 128, 8, 4, 4, "fused")), (32, (32, 64, 128, 8, 4, 4, "fused")),
                       (64, (64, 128, 64, 8, 4, 4, "fused")), (512, (128, 128, 64, 8, 8, 3, "fused")),
                       (1 << 62, (256, 128, 64, 8, 8, 3, "fused"))]),
    (4096, 12288): _t([(8, (16, 128, 128, 8, 4, 4, "split")), (32, (16, 64, 128, 8, 4, 4, "split")),
                       (64, (64, 64, 64, 8, 4, 6, "split")), (128, (64, 128, 64, 8, 4, 4, "split")),
                       (256, (128, 128, 64, 8, 8, 3, "split")), (512, (64, 128, 64, 8, 4, 4, "fused")),
                       (1024, (128, 256, 64, 8, 8, 4, "split")), (4096, (128, 128, 64, 8, 8, 4, "fused")),
                       (1 << 62, (128, 128, 128, 8, 8, 3, "fused"))]),
    (151936, 4096): _t([(8, (16, 64, 256, 8, 4, 3, "fused")), (32, (32, 64, 128, 8, 4, 4, "fused")),
                        (64, (64, 128, 64, 8, 4, 4, "fused")), (512, (128, 128, 64, 8, 8, 3, "fused")),
                        (1 << 62, (256, 128, 64, 8, 8, 3, "fused"))]),
}


# The DeepSeek-V4 mid config's decode projections at 33..64 rows (benchmarks/families/deepseek_v4_layer.py
# --sections tiles on an H100: the decode step's own linears, graph-timed, every candidate's bits
# equal to the table's): small output tiles and long K blocks, so a weight of a few MB is read by
# enough programs. Swept for bf16 operands only (fp32 ones would need twice the shared memory);
# other M buckets keep the generic rows (not swept).
def _decode_rows(cfg):
    return ([r for r in CONFIG_TABLE if r[0] <= 32] + [(64, *cfg, "fused")]
            + [r for r in CONFIG_TABLE if r[0] > 64])


HALF_TABLES = {
    (512, 2048): _decode_rows((16, 16, 256, 8, 4, 4)),
    (1024, 2048): _decode_rows((16, 32, 128, 8, 4, 4)),
    (2048, 2048): _decode_rows((64, 32, 256, 8, 4, 3)),
    (64, 2048): _decode_rows((16, 16, 256, 8, 4, 4)),
    (32, 2048): _decode_rows((16, 16, 256, 8, 4, 4)),
    (2048, 1024): _decode_rows((64, 32, 256, 8, 4, 3)),
    (4096, 512): _decode_rows((64, 32, 128, 8, 4, 4)),
}


# fp32 operands at decode M on few columns (the MoE routers' fp32 logits, HF's parity; N <= 1024,
# where 64 x 64 tiles leave most SMs idle): an IEEE fp32 dot is FMA code, not tensor cores, so a
# program's time is its tile's multiply-adds and the launch wants the smallest tiles (V4's routers
# per tile and K split: benchmarks/families/deepseek_v4_decode_ops.py; every tile's bits equal there).
F32_DECODE_TABLE = [(64, 16, 16, 128, 8, 4, 1, "split")] + [r for r in CONFIG_TABLE if r[0] > 64]


def config_for(M: int, N: int, K: int, dtype: torch.dtype | None = None):
    table = CONFIG_TABLES.get((N, K))
    if table is None and dtype in (torch.bfloat16, torch.float16):
        table = HALF_TABLES.get((N, K))
    if table is None and dtype == torch.float32 and N <= 1024:  # a router's few columns
        table = F32_DECODE_TABLE
    for row in table or CONFIG_TABLE:
        if M <= row[0]:
            return row[1:]
    return CONFIG_TABLE[-1][1:]


@triton.jit
def chunk_acc(x_ptr, w_ptr, offs_m, offs_n, M, N, K, k_begin, K_CHUNK, stride_xm, stride_wn,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
               INTERP: tl.constexpr, PREC: tl.constexpr):
    """Sequential fp32 accumulation of one K chunk [k_begin, k_begin + K_CHUNK), from zero."""
    offs_k = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    mask_m = offs_m[:, None] < M
    mask_n = offs_n[None, :] < N
    a_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k_begin + offs_k)[None, :]
    b_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + (k_begin + offs_k)[:, None]
    for kk in range(0, K_CHUNK, BK):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=mask_m, other=0.0)
            b = tl.load(b_ptrs, mask=mask_n, other=0.0)
        else:
            kmask = (k_begin + kk + offs_k) < K
            a = tl.load(a_ptrs, mask=mask_m & kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=mask_n & kmask[:, None], other=0.0)
        if INTERP:
            acc += tl.dot(a.to(tl.float64), b.to(tl.float64)).to(tl.float32)
        else:
            acc = tl.dot(a, b, acc, input_precision=PREC)
        a_ptrs += BK
        b_ptrs += BK
    return acc


@triton.jit
def _linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, ws_ptr, M, N, K, K_CHUNK,
                   stride_xm, stride_wn, stride_om,
                   HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, PARTIAL: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                   EVEN_K: tl.constexpr, INTERP: tl.constexpr, PREC: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if PARTIAL:
        # one chunk per program: fp32 partial into ws[s, M, N]; _reduce_kernel adds them in order
        s = tl.program_id(1)
        acc = chunk_acc(x_ptr, w_ptr, offs_m, offs_n, M, N, K, s * K_CHUNK, K_CHUNK,
                         stride_xm, stride_wn, BM, BN, BK, EVEN_K, INTERP, PREC)
        ws = ws_ptr + s.to(tl.int64) * M * N + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(ws, acc, mask=mask)
    else:
        total = tl.zeros((BM, BN), dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            acc = chunk_acc(x_ptr, w_ptr, offs_m, offs_n, M, N, K, s * K_CHUNK, K_CHUNK,
                             stride_xm, stride_wn, BM, BN, BK, EVEN_K, INTERP, PREC)
            total = total + acc
        if HAS_BIAS:
            bias = tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
            total = total + bias[None, :]
        out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _reduce_kernel(ws_ptr, b_ptr, out_ptr, total_n, N, stride_om, HAS_BIAS: tl.constexpr,
                   SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total_n
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        total = total + tl.load(ws_ptr + (offs + s * total_n), mask=mask, other=0.0)
    if HAS_BIAS:
        total = total + tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    # out may be a column slice of a wider output (fused projections): row stride stride_om
    tl.store(out_ptr + (offs // N) * stride_om + offs % N, total.to(out_ptr.dtype.element_ty), mask=mask)


# The interpreter computes each K block's dot exactly (float64) and rounds it once, so there the
# block size is part of the bits; on the GPU (one sequential accumulation) it is not. One block
# size for every M keeps the interpreter's bits independent of the batch as the GPU's are.
INTERP_BK = 64


def _launch(x, weight, bias, cfg, split, out=None):
    M, K = x.shape
    N = weight.shape[0]
    BM, BN, BK, GROUP_M, warps, stages, mode = cfg
    interp = interpreting(x)
    if interp:
        BK = INTERP_BK
    if out is None:
        out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    if M == 0:
        return out
    k_chunk = K // split if split > 1 else triton.cdiv(K, BK) * BK
    even_k = (K % BK == 0) and (k_chunk % BK == 0)
    prec = "ieee" if (x.dtype == torch.float32 or interp) else "tf32"
    has_bias = bias is not None
    b_arg = bias if has_bias else x
    grid0 = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    kw = {} if interp else dict(num_warps=warps, num_stages=stages)
    if split > 1 and mode == "split":
        ws = torch.empty((split, M, N), device=x.device, dtype=torch.float32)
        _linear_kernel[(grid0, split)](x, weight, b_arg, out, ws, M, N, K, k_chunk,
                                       x.stride(0), weight.stride(0), out.stride(0),
                                       HAS_BIAS=has_bias, SPLIT=split, PARTIAL=True,
                                       BM=BM, BN=BN, BK=BK, GROUP_M=GROUP_M, EVEN_K=even_k,
                                       INTERP=interp, PREC=prec, **kw)
        BLOCK = 1024
        _reduce_kernel[(triton.cdiv(M * N, BLOCK),)](ws, b_arg, out, M * N, N, out.stride(0), HAS_BIAS=has_bias,
                                                     SPLIT=split, BLOCK=BLOCK,
                                                     **({} if interp else dict(num_warps=4)))
    else:
        _linear_kernel[(grid0, 1)](x, weight, b_arg, out, out, M, N, K, k_chunk,
                                   x.stride(0), weight.stride(0), out.stride(0),
                                   HAS_BIAS=has_bias, SPLIT=split, PARTIAL=False,
                                   BM=BM, BN=BN, BK=BK, GROUP_M=GROUP_M, EVEN_K=even_k,
                                   INTERP=interp, PREC=prec, **kw)
    return out


# ---------------------------------------------------------------- persistent TMA path
# Same canonical order as _linear_kernel's fused mode (SPLIT chunks, each a sequential
# tensor-core accumulation from zero, summed in chunk order onto 0.0, + bias, one rounding), but
# operands arrive by TMA (zero-filled past the edges, which adds exact zeros like the masked
# loads) and a persistent grid of one program per SM walks the output tiles. Used for large M
# where the table below names a config; the harness (benchmarks/ops/gpu_ops.py inv_linear) checks
# its bits against the table kernel's on every Qwen3-8B shape.
# (min_M, BM, BN, BK, GROUP_M, warps, stages) per weight shape, rows in decreasing min_M: the
# first row with M >= min_M wins; M below the last row uses the table kernel. Tuning rule as for
# CONFIG_TABLES: the fastest of benchmarks/ops/gpu_ops.py time_linear_tma per M, kept only with 0 rows
# differing from the table kernel. A split weight (two accumulators) spills registers at 128x256
# tiles, hence 128x128 for the o and down projections (the chunk sum kept in a scratch tile
# instead, one accumulator, was slower still: h200_h100_linear_tma_m4096_spill.json).
TMA_CONFIGS = [(128, 256, 64, 8, 8, 3), (128, 128, 64, 8, 8, 4), (256, 128, 64, 8, 8, 3)]
_W, _S, _T = TMA_CONFIGS
# the same tiles with the tile and K loops flattened into one pipeline (_linear_tma_flat_kernel;
# one K chunk only: a split weight runs the loop nest whatever the row says)
TMA_FLAT_CONFIGS = [(*c, "flat") for c in TMA_CONFIGS] + [(128, 256, 64, 8, 8, 4, "flat")]
TMA_TABLE = {
    (6144, 4096): [(4096, *_W), (1024, *_S), (512, *_W)],
    (4096, 4096): [(1024, *_T), (512, *_S)],
    (24576, 4096): [(512, *_W)],
    (4096, 12288): [(1024, *_T), (512, *_S)],
    (151936, 4096): [(512, *_W)],
    # the trainer's unfused k / v and gate / up (the engine fuses them into the rows above), which
    # ran the table kernel at 0.77-0.81 of cuBLAS in training
    (1024, 4096): [(16384, *_T), (4096, *_W, "flat"), (512, *_S)],
    (12288, 4096): [(1024, *_W), (512, *_S)],
}


@triton.jit
def _tile_origin(tile, num_pid_m, num_pid_in_group, GROUP_M: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """First row and column of output tile ``tile`` in the grouped (GROUP_M) tile order."""
    group_id = tile // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((tile % num_pid_in_group) % group_size_m)
    pid_n = (tile % num_pid_in_group) // group_size_m
    return pid_m * BM, pid_n * BN


@triton.jit
def _store_tile(total, out_ptr, b_ptr, om, on, M, N, stride_om, HAS_BIAS: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr):
    """+ bias (fp32), one rounding to the output dtype, masked store of the tile at (om, on)."""
    offs_n = on + tl.arange(0, BN)
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        total = total + bias[None, :]
    offs_m = om + tl.arange(0, BM)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _linear_tma_kernel(x_desc, w_desc, out_ptr, b_ptr, M, N, K_CHUNK, NUM_PROGS, stride_om,
                       HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr,
                       BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                       INTERP: tl.constexpr):
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    num_tiles = num_pid_m * num_pid_n
    num_pid_in_group = GROUP_M * num_pid_n
    for tile in range(tl.program_id(0), num_tiles, NUM_PROGS):
        om, on = _tile_origin(tile, num_pid_m, num_pid_in_group, GROUP_M, BM, BN)
        total = tl.zeros((BM, BN), dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for kk in range(0, K_CHUNK, BK):
                a = x_desc.load([om, s * K_CHUNK + kk])
                b = w_desc.load([on, s * K_CHUNK + kk])
                if INTERP:
                    acc += tl.dot(a.to(tl.float64), b.T.to(tl.float64)).to(tl.float32)
                else:
                    acc = tl.dot(a, b.T, acc)
            total = total + acc
        _store_tile(total, out_ptr, b_ptr, om, on, M, N, stride_om, HAS_BIAS, BM, BN)


@triton.jit
def _linear_tma_flat_kernel(x_desc, w_desc, out_ptr, b_ptr, M, N, K, NUM_PROGS, stride_om,
                            HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                            BK: tl.constexpr, GROUP_M: tl.constexpr, INTERP: tl.constexpr):
    """One K chunk (SPLIT = 1): the tile loop and the K loop flattened into one software
    pipeline (tl.range(flatten=True)), so the next tile's first loads overlap this tile's
    epilogue. Each output element is still one sequential accumulation over K from zero."""
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    num_tiles = num_pid_m * num_pid_n
    num_pid_in_group = GROUP_M * num_pid_n
    k_tiles = tl.cdiv(K, BK)
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGS, flatten=True):
        om, on = _tile_origin(tile, num_pid_m, num_pid_in_group, GROUP_M, BM, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(k_tiles):
            a = x_desc.load([om, ki * BK])
            b = w_desc.load([on, ki * BK])
            if INTERP:
                acc += tl.dot(a.to(tl.float64), b.T.to(tl.float64)).to(tl.float32)
            else:
                acc = tl.dot(a, b.T, acc)
        # the chunk sum onto 0.0, as the other kernels do (-0.0 + 0.0 = +0.0 keeps the bits)
        total = tl.zeros((BM, BN), dtype=tl.float32) + acc
        _store_tile(total, out_ptr, b_ptr, om, on, M, N, stride_om, HAS_BIAS, BM, BN)


def tma_supported(x, weight):
    """TMA needs 16-byte aligned row strides and 2-byte types (bf16/fp16) for this kernel."""
    M, K = x.shape
    N = weight.shape[0]
    return (x.dtype in (torch.bfloat16, torch.float16) and K % 8 == 0 and N % 8 == 0
            and x.is_contiguous() and weight.is_contiguous())


def _launch_tma(x, weight, bias, cfg, split, out=None):
    from triton.tools.tensor_descriptor import TensorDescriptor
    M, K = x.shape
    N = weight.shape[0]
    BM, BN, BK, GROUP_M, warps, stages = cfg[:6]
    flat = len(cfg) > 6 and cfg[6] == "flat"
    if not tma_supported(x, weight):
        raise ValueError(f"bitmatch.kernels.linear: the TMA path needs bf16/fp16, K and N "
                         f"multiples of 8 and contiguous inputs; got {x.dtype}, K={K}, N={N}")
    interp = interpreting(x)
    if out is None:
        out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    if M == 0:
        return out
    # the same chunking as _launch: SPLIT equal chunks, or one chunk of whole BK blocks
    k_chunk = K // split if split > 1 else triton.cdiv(K, BK) * BK
    if split > 1 and k_chunk % BK:
        raise ValueError(f"bitmatch.kernels.linear: K chunk {k_chunk} is not a multiple of BK={BK}")
    x_desc = TensorDescriptor.from_tensor(x, [BM, BK])
    w_desc = TensorDescriptor.from_tensor(weight, [BN, BK])
    tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    progs = min(tiles, sm_count(x.device))
    kw = {} if interp else dict(num_warps=warps, num_stages=stages)
    if flat and split == 1:
        _linear_tma_flat_kernel[(progs,)](x_desc, w_desc, out, bias if bias is not None else x, M, N,
                                          k_chunk, progs, out.stride(0), HAS_BIAS=bias is not None,
                                          BM=BM, BN=BN, BK=BK, GROUP_M=GROUP_M, INTERP=interp, **kw)
        return out
    _linear_tma_kernel[(progs,)](x_desc, w_desc, out, bias if bias is not None else x, M, N,
                                 k_chunk, progs, out.stride(0), HAS_BIAS=bias is not None, SPLIT=split, BM=BM,
                                 BN=BN, BK=BK, GROUP_M=GROUP_M, INTERP=interp, **kw)
    return out




def tma_config_for(M, N, K):
    for row in TMA_TABLE.get((N, K), ()):
        if M >= row[0]:
            return row[1:]
    return None


def linear(x, weight, bias=None, *, split=None, out=None):
    """x [M, K] @ weight[N, K]^T (+ bias[N]) -> [M, N] in x.dtype (inputs contiguous).
    split: the canonical K split (default split_for(N, K)); out: an [M, N] view to write into."""
    M, K = x.shape
    N = weight.shape[0]
    split = split_for(N, K) if split is None else split
    cfg = tma_config_for(M, N, K)
    if cfg is not None and tma_supported(x, weight):
        return _launch_tma(x, weight, bias, cfg, split, out)
    cfg = config_for(M, N, K, x.dtype)
    if cfg[-1] == "tma":  # a table row that picks the persistent TMA kernel for its M bucket
        if tma_supported(x, weight):
            return _launch_tma(x, weight, bias, cfg[:6], split, out)
        cfg = CONFIG_TABLE[-1][1:]  # same bits (tiles never change them), pointer loads
    return _launch(x, weight, bias, cfg, split, out)


def linear_segments(x, weight, bias, segments):
    """x @ weight^T for weight = the row concatenation of weights of N sizes ``segments``: each
    segment's columns get the bits of ``linear`` on its own weight (its own split_for(N_i, K)).
    Adjacent segments with the same split run as one launch (the K order of an output element
    does not depend on N or the tile: each element is its own fixed sequence of fp32 dots);
    segments with another split get their own launch into their column slice of the output."""
    M, K = x.shape
    out = torch.empty((M, weight.shape[0]), device=x.device, dtype=x.dtype)
    groups, n0 = [], 0
    for n in segments:
        s = split_for(n, K)
        if groups and groups[-1][2] == s:
            groups[-1][1] += n
        else:
            groups.append([n0, n0 + n, s])
        n0 += n
    for a, b, s in groups:
        linear(x, weight[a:b], None if bias is None else bias[a:b], split=s, out=out[:, a:b])
    return out
