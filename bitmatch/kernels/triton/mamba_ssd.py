"""The Mamba2 SSD scan on the Triton backend: a chunked scan whose products run on tensor cores,
on the canonical chunk schedule of kernels/mamba.py (chunks at ABSOLUTE positions, chunk c holds
positions [cQ, (c+1)Q), S_c the fp32 state at its start).

Invariance: a token's y has the same bits in a full prefill, any chunked-prefill split, a one-token
decode, and next to any other sequences in the launch: every call evaluates the token's row of its
chunk with the same kernel binary, the same tile shapes and the same K order on the same operand
values, and S_c comes from one formula over the whole chunk.

Canonical order (Triton; ``op_versions["mamba"]``, bump it when anything below changes). One
program per (sequence, head, block of BP of the head's P channels) walks the chunks the call
touches, its rows of S_c [BP, N] fp32 in registers.
Per chunk, with t = cQ + l, positions before the call from the cache's open-chunk buffer, positions
after the call's last token exact zeros:
- dt_s = clamp(round(softplus(round(dt_raw + dt_bias))), min=dt_min) in fp32 (HF's rounding points);
  Acum = tl.cumsum(dt * A) over the chunk's Q positions (one [Q] scan: an element sees only the
  positions before it, so the zeros after the call cannot change it).
- rows in tiles of BM aligned to the chunk start; for the tile holding l:
  acc = dot(C_tile, S_c^T) * exp(Acum_l), then for K blocks k = 0 .. ceil((m+1)BM / BK) - 1 in order:
  acc = dot(W, x_k, acc), W[l, s] = dot(C_tile, B_k^T)[l, s] * exp(min(Acum_l - Acum_s, 0)) * dt_s
  for s <= l, exact 0 above the diagonal; y_t = acc_l + D * x_t.
- when the chunk's last position is in the call: S_{c+1} = dot over K blocks in order of
  (x_s * exp(Acum_{Q-1} - Acum_s) * dt_s)^T B_s, accumulated onto exp(Acum_{Q-1}) * S_c.
Dot operands are x's dtype (bf16: W, S_c^T and x*decay rounded to bf16, fp32 accumulate, as
mamba_ssm; fp32: "ieee" fp32 dots). The config (BM, BK, BP, warps, stages, PRELOAD, XEARLY) is
fixed per (dtype, P, N, Q) and call kind (a decode call runs 16-row tiles and issues its C and
first K block with the state's load; XEARLY, for one sequence: the token's own x and B rows with
it too), never autotuned: BK and the K-block walk fix a row's bits, and warps pick the MMA
instructions; the row tile does not change them (DESIGN section 4), and every config change is
checked by prefill == decode on the GPU before it lands.
Every call, cached or not, runs the same binary: the cache is a runtime flag, integer arguments are
not value-specialised, misaligned inputs are copied to aligned ones and a misaligned cache is
refused, so no launch compiles a variant. A token's row never depends on the tile's other rows;
the positions after the token (real in a prefill, zeros in a decode) reach it only through exact
zeros of W, so only a row whose every term is zero could differ, in the sign of that zero.

Cache (seq_start / cache / state_slots of kernels.mamba_chunk_scan): the kernel reads S_c and the
open chunk's x / B / dt before the call's first position, writes S back when a chunk closed, and
writes the x of the call's positions in its open chunk (the program's own columns); B rows are
shared by a group's heads and dt rows by a head's P blocks. A call that closes no chunk for a
sequence writes only rows after the ones any program reads (rows before p0), so the scan writes
that sequence's B and dt rows itself (one program each); a call that closed a chunk may reuse rows
other programs still read, so a second launch copies them (dt as the scan computed it) once every
program has read the old ones. That launch is skipped when the caller knows every sequence has at
most one token (kernels.mamba_chunk_scan given host bounds: the engine's decode steps).
The CPU interpreter (TRITON_INTERPRET=1) computes each dot in float64: its bits are its own, with
the same structure.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import interpreting, sm_count
from ._jit import dot as _dot  # the interpreter's exact-dot switch (kernels/triton/_jit.py)

# Triton specialises a pointer on 16-byte alignment, which picks vector widths and so layouts:
# every float pointer is aligned in every call (inputs copied when not, the cache refused when not,
# see mamba_chunk_scan); the integer metadata is read as scalars and never specialised
_NO_ALIGN = ["cu_ptr", "start_ptr", "slot_ptr"]


@triton.jit
def dt_value(raw, bias, dt_lo, HAS_BIAS: tl.constexpr):
    """dt = clamp(round(softplus(round(raw + bias))), min=dt_lo) in fp32, rounding to raw's dtype
    (dt_lo: dt_min rounded to raw's dtype, by the launcher)."""
    z = raw.to(tl.float32)
    if HAS_BIAS:
        z = (z + bias).to(raw.dtype).to(tl.float32)
    sp = tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(z))).to(raw.dtype).to(tl.float32)
    return tl.where(sp < dt_lo, dt_lo, sp)


@triton.jit
def _chunk_rows(in_ptr, in_row, in_col, buf_ptr, buf_row, cq, rows, p0, pend, t0, cols):
    """Values [len(rows), len(cols)] of chunk positions cq + rows: the call's inputs from p0 on, the
    open-chunk buffer before p0, exact zeros from pend on."""
    q = cq + rows
    # one load through a selected pointer: a merge of two loads would hold both tiles in registers
    src = tl.where((q >= p0)[:, None], in_ptr + (t0 + q - p0)[:, None] * in_row + in_col + cols[None, :],
                   buf_ptr + rows[:, None] * buf_row + cols[None, :])
    return tl.load(src, mask=(q < pend)[:, None], other=0.0)


@triton.jit
def _c_rows(C_ptr, c_row, c_col, t0, cq, p0, rows, lo, hi, offs_n):
    """C of chunk rows ``rows`` (the call's tokens in [lo, hi); other rows exact zeros)."""
    row_in = (rows >= lo) & (rows < hi)
    tok = t0 + (cq + rows - p0)
    return tl.load(C_ptr + tok[:, None] * c_row + c_col + offs_n[None, :], mask=row_in[:, None], other=0.0)


@triton.jit
def _own_rows(x_ptr, B_ptr, t0, cq, p0, rows, lo, hi, own_chunk, h, pb, H: tl.constexpr, P: tl.constexpr,
              G: tl.constexpr, N: tl.constexpr, g, offs_p, offs_n):
    """x of the call's tokens among chunk rows ``rows`` in this program's columns (y's D term, the
    open chunk's buffer) and, in a group's lead program, their B rows when the call writes that
    buffer itself (``own_chunk``: the chunk stays open and is the call's first); zeros elsewhere."""
    row_in = (rows >= lo) & (rows < hi)
    tok = t0 + (cq + rows - p0)
    xr = tl.load(x_ptr + tok[:, None] * (H * P) + h * P + offs_p[None, :], mask=row_in[:, None], other=0.0)
    lead = (pb == 0) & (h % (H // G) == 0)
    own = row_in & own_chunk & lead
    Bm = tl.load(B_ptr + tok[:, None] * (G * N) + g * N + offs_n[None, :], mask=own[:, None], other=0.0)
    return xr, Bm


@triton.jit
def _w_dot(acc, Cm, Bk, xk, rows, cols, a_m, acum, dtc, BM: tl.constexpr, BK: tl.constexpr, INTERP: tl.constexpr,
           PREC: tl.constexpr):
    """acc + W x_k for one K block: W[l, s] = dot(C_l, B_s) * exp(min(Acum_l - Acum_s, 0)) * dt_s
    for s <= l, exact zeros above the diagonal."""
    a_k = tl.gather(acum, cols, 0)
    d_k = tl.gather(dtc, cols, 0)
    cb = _dot(Cm, tl.trans(Bk), tl.zeros((BM, BK), tl.float32), INTERP, PREC)
    w = cb * tl.exp(tl.minimum(a_m[:, None] - a_k[None, :], 0.0)) * d_k[None, :]
    w = tl.where(rows[:, None] >= cols[None, :], w, 0.0)
    return _dot(w.to(xk.dtype), xk, acc, INTERP, PREC)


@triton.jit(do_not_specialize=["has_cache"], do_not_specialize_on_alignment=_NO_ALIGN)
def _ssd_kernel(x_ptr, dt_ptr, bias_ptr, A_ptr, B_ptr, C_ptr, D_ptr, y_ptr, cu_ptr, start_ptr, slot_ptr,
                S_ptr, xb_ptr, bb_ptr, db_ptr, dtp_ptr, dt_lo, has_cache,
                H: tl.constexpr, P: tl.constexpr, G: tl.constexpr, N: tl.constexpr, Q: tl.constexpr,
                BM: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr, HAS_BIAS: tl.constexpr,
                HAS_D: tl.constexpr, INTERP: tl.constexpr, PREC: tl.constexpr, PRELOAD: tl.constexpr,
                XEARLY: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    pb = tl.program_id(2)  # this program's BP of the head's P channels (their state rows are independent)
    g = h // (H // G)
    cached = has_cache != 0
    t0 = tl.load(cu_ptr + b).to(tl.int64)
    n = tl.load(cu_ptr + b + 1).to(tl.int64) - t0
    p0 = tl.load(start_ptr + b, mask=cached, other=0).to(tl.int64)
    slot = tl.load(slot_ptr + b, mask=cached, other=0).to(tl.int64)
    pend = p0 + n
    offs_q = tl.arange(0, Q)
    offs_m = tl.arange(0, BM)
    offs_k = tl.arange(0, BK)
    offs_p = pb * BP + tl.arange(0, BP)
    offs_n = tl.arange(0, N)
    A = tl.load(A_ptr + h)
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(bias_ptr + h).to(tl.float32)
    Dh = 0.0
    if HAS_D:
        Dh = tl.load(D_ptr + h)
    s_ptrs = S_ptr + slot * (H * P * N) + h * (P * N) + offs_p[:, None] * N + offs_n[None, :]
    S = tl.load(s_ptrs, mask=(offs_p[:, None] < P) & cached, other=0.0)
    xb = xb_ptr + slot * (Q * H * P) + h * P
    bb = bb_ptr + slot * (Q * G * N) + g * N
    db = db_ptr + slot * (Q * H) + h
    c_first = p0 // Q
    c_end = tl.where(n > 0, (pend + Q - 1) // Q, c_first)
    q = c_first * Q + offs_q
    raw = tl.load(dt_ptr + (t0 + q - p0) * H + h, mask=(q >= p0) & (q < pend), other=0.0)
    dtb = tl.load(db + offs_q * H, mask=q < p0, other=0.0)  # only the first chunk starts before p0
    for c in range(c_first, c_end):
        cq = c * Q
        q = cq + offs_q
        in_call = (q >= p0) & (q < pend)
        dtc = tl.where(in_call, dt_value(raw, bias, dt_lo, HAS_BIAS), dtb)
        acum = tl.cumsum(dtc * A, axis=0)
        # the next chunk's raw dt (all its positions are the call's), in flight while this one runs
        raw = tl.load(dt_ptr + (t0 + q + Q - p0) * H + h, mask=q + Q < pend, other=0.0)
        dtb = tl.zeros_like(dtc)
        lo = (tl.maximum(p0, cq) - cq).to(tl.int32)
        hi = (tl.minimum(pend, cq + Q) - cq).to(tl.int32)
        keep_open = cached & (hi < Q)  # the chunk stays open: the call's rows go to the buffers
        tl.debug_barrier()  # this program's reads of older buffer rows (earlier chunks) are done
        if PRELOAD:  # the first row tile's C and the chunk's first K block, loaded before S is waited on
            Cn = _c_rows(C_ptr, G * N, g * N, t0, cq, p0, lo // BM * BM + offs_m, lo, hi, offs_n)
            B0 = _chunk_rows(B_ptr, G * N, g * N, bb, G * N, cq, offs_k, p0, pend, t0, offs_n)
            x0 = _chunk_rows(x_ptr, H * P, h * P, xb, H * P, cq, offs_k, p0, pend, t0, offs_p)
            if XEARLY:  # the first row tile's own x rows and (group leads) B rows for the buffers
                rows_n = lo // BM * BM + offs_m
                xrn, Bmn = _own_rows(x_ptr, B_ptr, t0, cq, p0, rows_n, lo, hi, keep_open & (c == c_first), h, pb,
                                     H, P, G, N, g, offs_p, offs_n)
        S_op = tl.trans(S).to(x_ptr.dtype.element_ty)
        for m in range(lo // BM, (hi + BM - 1) // BM):
            rows = m * BM + offs_m
            row_in = (rows >= lo) & (rows < hi)
            tok = t0 + (cq + rows - p0)
            if PRELOAD:
                Cm = Cn
            else:
                Cm = _c_rows(C_ptr, G * N, g * N, t0, cq, p0, rows, lo, hi, offs_n)
            a_m = tl.gather(acum, rows, 0)
            acc = _dot(Cm, S_op, tl.zeros((BM, BP), tl.float32), INTERP, PREC) * tl.exp(a_m)[:, None]
            k_end = ((m + 1) * BM + BK - 1) // BK
            k_from = 0
            if PRELOAD:  # the K block k = 0, as the loop below would run it
                acc = _w_dot(acc, Cm, B0, x0, rows, offs_k, a_m, acum, dtc, BM, BK, INTERP, PREC)
                k_from = 1
            for k in range(k_from, k_end):
                cols = k * BK + offs_k
                Bk = _chunk_rows(B_ptr, G * N, g * N, bb, G * N, cq, cols, p0, pend, t0, offs_n)
                xk = _chunk_rows(x_ptr, H * P, h * P, xb, H * P, cq, cols, p0, pend, t0, offs_p)
                acc = _w_dot(acc, Cm, Bk, xk, rows, cols, a_m, acum, dtc, BM, BK, INTERP, PREC)
            if PRELOAD:  # the next row tile's C (none past hi: masked)
                Cn = _c_rows(C_ptr, G * N, g * N, t0, cq, p0, rows + BM, lo, hi, offs_n)
            if PRELOAD and XEARLY:  # this tile's own rows were loaded with the state; the next tile's now
                xr, Bm = xrn, Bmn
                xrn, Bmn = _own_rows(x_ptr, B_ptr, t0, cq, p0, rows + BM, lo, hi, keep_open & (c == c_first), h, pb,
                                     H, P, G, N, g, offs_p, offs_n)
            else:
                xr = tl.load(x_ptr + tok[:, None] * (H * P) + h * P + offs_p[None, :], mask=row_in[:, None], other=0.0)
            if HAS_D:
                acc = acc + Dh * xr.to(tl.float32)
            tl.store(y_ptr + tok[:, None] * (H * P) + h * P + offs_p[None, :], acc, mask=row_in[:, None])
            # an open chunk's rows for the next call's replay: x in this program's columns; dt, shared
            # by the head's P blocks, staged per token for the stash launch
            keep = row_in & keep_open
            tl.store(xb + rows[:, None] * (H * P) + offs_p[None, :], xr.to(xb_ptr.dtype.element_ty),
                     mask=keep[:, None])
            d_rows = tl.gather(dtc, rows, 0)
            tl.store(dtp_ptr + tok * H + h, d_rows, mask=keep & (pb == 0))
            # a call that closes no chunk (every decode call) writes only rows after every row any
            # program reads from the buffers (those before p0): its dt rows (the head's first P
            # block) and B rows (the group's first head) go straight in; a call that closed one
            # leaves its open rows to the stash launch, which runs after every read
            own = keep & (c == c_first)
            tl.store(db + rows * H, d_rows, mask=own & (pb == 0))
            lead = (pb == 0) & (h % (H // G) == 0)
            if not (PRELOAD and XEARLY):
                Bm = tl.load(B_ptr + tok[:, None] * (G * N) + g * N + offs_n[None, :], mask=(own & lead)[:, None],
                             other=0.0)
            tl.store(bb + rows[:, None] * (G * N) + offs_n[None, :], Bm, mask=(own & lead)[:, None])
        if hi == Q:  # the chunk closes in this call: S_{c+1} from all Q positions
            a_last = tl.sum(tl.where(offs_q == Q - 1, acum, 0.0), axis=0)
            S = S * tl.exp(a_last)
            for k in range(0, Q // BK):
                cols = k * BK + offs_k
                Bk = _chunk_rows(B_ptr, G * N, g * N, bb, G * N, cq, cols, p0, pend, t0, offs_n)
                xk = _chunk_rows(x_ptr, H * P, h * P, xb, H * P, cq, cols, p0, pend, t0, offs_p)
                wk = tl.exp(a_last - tl.gather(acum, cols, 0)) * tl.gather(dtc, cols, 0)
                xw = (xk.to(tl.float32) * wk[:, None]).to(xk.dtype)
                S = _dot(tl.trans(xw), Bk, S, INTERP, PREC)
    closed = (pend // Q) > c_first  # a boundary was crossed: the slot's state moves on
    tl.store(s_ptrs, S, mask=(offs_p[:, None] < P) & (cached & closed))


@triton.jit
def _stash_kernel(B_ptr, dtp_ptr, cu_ptr, start_ptr, slot_ptr, bb_ptr, db_ptr, Q: tl.constexpr, GN: tl.constexpr,
                  H: tl.constexpr, HB: tl.constexpr, RB: tl.constexpr, BLOCK: tl.constexpr):
    """B and dt rows of the call's positions in each sequence's open chunk -> its buffers (plain
    copies; dt as the scan computed it); program (sequence, row block, column block of B)."""
    b = tl.program_id(0)
    rows = tl.program_id(1) * RB + tl.arange(0, RB)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    t0 = tl.load(cu_ptr + b).to(tl.int64)
    n = tl.load(cu_ptr + b + 1).to(tl.int64) - t0
    p0 = tl.load(start_ptr + b).to(tl.int64)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    pend = p0 + n
    q = (pend // Q) * Q + rows  # the open chunk (none when pend % Q == 0: then q >= pend)
    row_in = (q >= p0) & (q < pend)
    tok = t0 + q - p0
    m = row_in[:, None] & (offs < GN)[None, :]
    v = tl.load(B_ptr + tok[:, None] * GN + offs[None, :], mask=m)
    tl.store(bb_ptr + slot * (Q * GN) + rows[:, None] * GN + offs[None, :], v, mask=m)
    offs_h = tl.arange(0, HB)
    mh = row_in[:, None] & (offs_h < H)[None, :] & (tl.program_id(2) == 0)
    d = tl.load(dtp_ptr + tok[:, None] * H + offs_h[None, :], mask=mh)
    tl.store(db_ptr + slot * (Q * H) + rows[:, None] * H + offs_h[None, :], d, mask=mh)


def few_programs(programs: int | None, sms: int | None) -> bool:
    """A launch of fewer (sequence, head) programs than two per SM: config_for's latency-bound case."""
    return programs is not None and sms is not None and programs < 2 * sms


def config_for(dtype: torch.dtype, P: int, N: int, Q: int, decode: bool = False, programs: int | None = None,
               sms: int | None = None) -> dict:
    """The fixed launch config of (dtype, P, N, Q): part of the canonical order (see module doc).
    From sm_90 compiles (ptxas -v) at Nemotron-H 8B shapes: bf16 64-row tiles (wgmma) with
    32-position K blocks use 255 registers (~150 bytes of spills on 4 warps, ~50 on 8; 64-position
    blocks ~280-600). 4 warps: two programs fit an SM, so a decode launch of thousands of
    (sequence, head) programs overlaps their latencies; a long prefill has one program per head
    either way. fp32 "ieee" dots run on FMAs with their operands in registers: 32-row tiles.
    BP < P splits a head's P channels over P / BP programs (more programs for a long prefill of few
    sequences; each recomputes C B^T).
    ``decode`` (one token per sequence on average: T == sequences) with bf16 / fp16 operands: 16-row
    tiles, the same K blocks. A 64-row tile spent its wgmma on 63 empty rows of a one-token call;
    the row tile does not change a row's bits (each row's K order is fixed by BK and the K-block
    walk, as for linear's tiles and attention's query tiles: DESIGN section 4), which the prefill ==
    decode checks prove (tests/test_mamba_ssd.py in the interpreter, benchmarks/ops/mamba_layer.py on the
    GPU).
    A prefill launch of fewer (sequence, head) ``programs`` than two per SM (``sms``; one or two
    long sequences) splits each head's P channels over two programs: a row's dots over N and K do
    not depend on how many output columns a program holds (BP < P: same bits, checked as above);
    a decode launch that small runs 8 warps."""
    if dtype == torch.float32:
        return dict(BM=min(32, Q), BK=min(32, Q), BP=P, num_warps=8 if P * N >= 4096 else 4, num_stages=2,
                    PRELOAD=False, XEARLY=False)
    few = few_programs(programs, sms)
    BP = P // 2 if (not decode and few and P // 2 >= 16) else P
    # a decode launch of few programs (one sequence) is latency-bound: 8 warps issue its loads
    # sooner (warps split a tile's columns, never a row's K order)
    warps = 8 if decode and few else 4
    # a decode call issues its row's C and the chunk's first K block with the state's load, not
    # after it (one round of dependent loads less; the same operations in the same order)
    # and, that small, the token's own x and B rows with it too (XEARLY; a large launch is faster
    # with them after the K loop: benchmarks/results/mamba_ssd_h100_run8_kall.json)
    return dict(BM=min(16 if decode else 64, Q), BK=min(32, Q), BP=BP, num_warps=warps, num_stages=2,
                PRELOAD=decode, XEARLY=decode and few)


@functools.lru_cache(maxsize=64)
def rounded(v: float, dtype: torch.dtype) -> float:
    """v rounded to dtype (HF clamps dt at dt_min in dt's dtype); cached: a host op per call otherwise."""
    return float(torch.tensor(v).to(dtype))


def aligned(t: torch.Tensor) -> torch.Tensor:
    """t, contiguous and 16-byte aligned (a copy when not): alignment picks a Triton variant."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _index(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 else t.to(torch.int32)


def mamba_chunk_scan(x, dt, A, B, C, D, dt_bias, chunk_size, cu_seqlens, dt_min, seq_start, cache, state_slots,
                     stash=True):
    """``stash=False``: the caller knows no sequence both closes a chunk and leaves open rows in this
    call (one token per sequence: kernels.mamba_chunk_scan with host bounds), so the scan's own
    buffer writes are all there is and the stash launch is skipped."""
    T, H, P = x.shape
    G, N = B.shape[1:]
    Q = chunk_size
    for name, v in (("head_dim", P), ("state", N), ("chunk_size", Q)):
        if v & (v - 1) or v < 16:
            raise NotImplementedError(f"mamba_chunk_scan (Triton): {name}={v} must be a power of two >= 16")
    y = torch.empty(T, H, P, dtype=torch.float32, device=x.device)
    nb = cu_seqlens.shape[0] - 1
    if nb == 0 or T == 0:
        return y
    interp = interpreting(x)
    cfg = config_for(x.dtype, P, N, Q, decode=T == nb, programs=nb * H, sms=sm_count(x.device))
    cu = _index(cu_seqlens)
    xa, Ba = aligned(x), aligned(B)
    has_cache = cache is not None
    if has_cache:
        S, xb, bb, db = cache
        for name, t in zip(("ssm_state", "x_buf", "B_buf", "dt_buf"), cache):
            if t.data_ptr() % 16 or not t.is_contiguous():
                raise ValueError(f"mamba_chunk_scan (Triton): cache {name} must be contiguous and 16-byte aligned "
                                 "(it is updated in place, so it cannot be copied); allocate it on its own")
        start, slots = _index(seq_start), _index(state_slots)
        dtp = torch.empty(T, H, dtype=torch.float32, device=x.device)  # dt of the call, for the stash
    else:  # never read (has_cache = 0 masks the cache off), but of the cache's dtypes: same binary
        S, xb, bb, db, dtp = y, xa, Ba, y, y
        start = slots = cu
    bias = aligned(dt_bias) if dt_bias is not None else y
    Dp = aligned(D) if D is not None else y
    dt_lo = rounded(dt_min, dt.dtype)
    BP = cfg["BP"]
    if P % BP:
        raise NotImplementedError(f"mamba_chunk_scan (Triton): config BP={BP} must divide head_dim={P}")
    _ssd_kernel[(nb, H, P // BP)](xa, aligned(dt), bias, aligned(A), Ba, aligned(C), Dp, y, cu, start, slots,
                                  S, xb, bb, db, dtp, dt_lo, int(has_cache),
                                  H=H, P=P, G=G, N=N, Q=Q, BM=cfg["BM"], BK=cfg["BK"], BP=BP,
                                  HAS_BIAS=dt_bias is not None, HAS_D=D is not None, INTERP=interp,
                                  PREC="ieee" if (x.dtype == torch.float32 or interp) else "tf32",
                                  PRELOAD=cfg["PRELOAD"], XEARLY=cfg["XEARLY"],
                                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if has_cache and stash:  # after the scan: its programs have read the old B and dt rows of the open chunks
        GN = G * N
        RB, BLOCK = 16, min(256, triton.next_power_of_2(GN))
        _stash_kernel[(nb, Q // RB, triton.cdiv(GN, BLOCK))](Ba, dtp, cu, start, slots, bb, db, Q=Q, GN=GN, H=H,
                                                              HB=triton.next_power_of_2(H), RB=RB, BLOCK=BLOCK)
    return y
