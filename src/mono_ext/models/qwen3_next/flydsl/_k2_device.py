"""Device code of the FlyDSL K2 (see ``k2.py`` for the contract). Imports flydsl."""

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl._mlir.dialects import llvm
from flydsl.expr import range_constexpr, rocdl
from flydsl.expr.typing import Int32, Int64, Stream, Vector

from mono_ext.kernels.flydsl.limits import BLOCK, GFX950, WAVES
from mono_ext.kernels.flydsl.primitives import (
    gptr,
    load_word,
    pack_tagged,
    seq_tag,
    step_seq,
    store_tagged,
    word_addr,
)
from mono_ext.kernels.flydsl.primitives import wait_tagged as _wait_tagged
from mono_ext.runtime import health as _h

WAVE = GFX950.wave_size
_NULL_STREAM = Stream(None)
_NEG_INF = -3.0e38


def _f32_of(word):
    return fx.Int32(word).bitcast(fx.Float32)


def _bits(x):
    return x.bitcast(fx.Int32)


def _bf16_lo(word):
    return (word << fx.Int32(16)).bitcast(fx.Float32)


def _bf16_hi(word):
    return (word & fx.Int32(-65536)).bitcast(fx.Float32)


def _rne16(x):
    bits = fx.Uint32(x.bitcast(fx.Int32))
    bits = bits + fx.Uint32(0x7FFF) + ((bits >> fx.Uint32(16)) & fx.Uint32(1))
    return bits >> fx.Uint32(16)


def _bf16x2(lo, hi):
    """Two fp32 -> one Int32 of two bf16 (round to nearest even)."""
    return fx.Int32((_rne16(hi) << fx.Uint32(16)) | _rne16(lo))


def _load_bf16(addr):
    return _bf16_lo(fx.Int32(fx.generic_load(gptr(addr, fx.Uint16, 2))))


def _store_bf16(addr, x):
    fx.generic_store(gptr(addr, fx.Uint16, 2), fx.Uint16(_rne16(x)))


def _sigmoid(x):
    return fx.Float32(1.0) / (fx.Float32(1.0) + fx.math.exp(-x))


def _silu(x):
    return x * _sigmoid(x)


def _fence_workgroup():
    llvm.FenceOp(llvm.AtomicOrdering.acq_rel, syncscope="workgroup")


def _wave_sum(x):
    for off in (32, 16, 8, 4, 2, 1):
        x = x + x.shuffle_xor(off, WAVE)
    return x


def _block_sum(sm, x, tid):
    """Sum of ``x`` over the workgroup, every thread given it, through ``sm.red_f`` (a
    2 * WAVES fp32 array of the kernel's shared memory struct)."""
    x = _wave_sum(x)
    fx.gpu.barrier()
    fx.ptr_store(x, sm.red_f.ptr + tid // WAVE)  # every lane of a wave: the same value
    fx.gpu.barrier()
    t = fx.Float32(0.0)
    for i in range_constexpr(WAVES):
        t = t + fx.ptr_load(sm.red_f.ptr + i)
    return t


def _mfma(a, b, acc):
    ty = Vector.make_type(4, fx.Float32)
    return Vector(rocdl.mfma_f32_16x16x16bf16_1k(ty, [a, b, acc]), (4,), fx.Float32)


def _tab(tab, i: int):
    """Entry ``i`` of a device table of byte addresses (loaded where a stage needs it, so the
    addresses do not sit in SGPRs for the whole launch)."""
    return fx.generic_load(gptr(tab + 8 * i, fx.Int64, 8))


def _rt(rtab):
    """scratch, xs, peers, ctrl, health: the runtime table (``k2.RT_ENTRIES``)."""
    return tuple(_tab(rtab, i) for i in range(5))


def _x_words(xa, ga, gated, mask):
    """Four bf16 of a batch row (two Int32 words), gated: bf16(x * sigmoid(g)), fp32 math."""
    xw = fx.generic_load(gptr(xa, fx.Int32, 8), count=2)
    if not gated:
        return xw[0] & mask, xw[1] & mask
    gw = fx.generic_load(gptr(ga, fx.Int32, 8), count=2)
    out = []
    for j in range(2):
        lo = _bf16_lo(xw[j]) * _sigmoid(_bf16_lo(gw[j]))
        hi = _bf16_hi(xw[j]) * _sigmoid(_bf16_hi(gw[j]))
        out.append(_bf16x2(lo, hi) & mask)
    return out[0], out[1]


def k2_launch(b):
    """A fresh ``@flyc.jit`` launch of the K2 build ``b`` (a ``k2.K2Build``)."""
    s = b.shape
    W, H, IN, E, K = b.width, s.hidden, s.in_dim, s.experts, s.top_k
    IM, IS, TP = s.moe_inter, s.shared_inter, s.tp
    EPS, NORM_TOPK, GATED, SYSTEM, G = float(s.eps), bool(s.norm_topk), b.gated, b.system, b.grid
    KS1 = b.out_proj_splits
    KC = IN // KS1  # out_proj K columns per split
    NHB = H // (16 * WAVES)  # 64-row blocks of H
    IW = s.act_words
    PR = W * K
    NIB = IM // (16 * WAVES)  # routed gate_up: 64 act elements per task
    NSB = IS // (16 * WAVES)
    EC = -(-E // BLOCK)  # experts per lane in the top-k
    lay = b.layout
    RID = {r.name: lay.region_id(r.name) for r in lay.program.regions}
    OFF = dict(lay.offsets)
    WORDS = {r.name: r.words for r in lay.program.regions}
    PEER = {r.name: r.peer for r in lay.program.regions}
    XS_BF = G * W * H * 4  # byte offset of the bf16 rows in xs

    @fx.struct
    class Smem:
        red_f: fx.Array[fx.Float32, 2 * WAVES, 16]
        red_i: fx.Array[fx.Int32, 2 * WAVES, 16]

    def put(scratch, peers, name, idx, value, tag, parity, rank):
        """Tagged word ``idx`` of region ``name``: a local write (local regions, and every
        region at TP 1), or a push into this rank's slot on every rank (peer regions)."""
        word = pack_tagged(value, tag)
        if not PEER[name]:
            store_tagged(word_addr(scratch, OFF[name] + idx), word, False)
        else:
            own = (parity * TP + rank) * WORDS[name] + idx
            for p in range_constexpr(TP):
                base = fx.generic_load(gptr(peers + 8 * p, fx.Int64, 8))
                store_tagged(word_addr(base, OFF[name] + own), word, SYSTEM)

    def get(scratch, name, idx, tag, ctrl, health):
        """Bounded wait for local word ``idx``; its Int32 value."""
        w = _wait_tagged(word_addr(scratch, OFF[name] + idx), tag, ctrl, health, RID[name], idx)
        return fx.Int32(w)

    def get_sum(scratch, mine, name, idx, tag, parity, ctrl, health):
        """fp32 sum over ranks 0..TP-1 of word ``idx`` of a (peer at TP > 1) region."""
        if TP == 1:
            return _f32_of(get(scratch, name, idx, tag, ctrl, health))
        acc = fx.Float32(0.0)
        for src in range_constexpr(TP):
            i = (parity * TP + src) * WORDS[name] + idx
            w = _wait_tagged(word_addr(mine, OFF[name] + i), tag, ctrl, health, RID[name], i)
            acc = acc + _f32_of(w)
        return acc

    def block_max(sm, x, tid):
        for off in (32, 16, 8, 4, 2, 1):
            o = x.shuffle_xor(off, WAVE)
            x = (o > x).select(o, x)
        fx.gpu.barrier()
        fx.ptr_store(x, sm.red_f.ptr + tid // WAVE)  # every lane of a wave: the same value
        fx.gpu.barrier()
        t = fx.ptr_load(sm.red_f.ptr + 0)
        for i in range_constexpr(1, WAVES):
            o = fx.ptr_load(sm.red_f.ptr + i)
            t = (o > t).select(o, t)
        return t

    def block_argmax(sm, v, idx, tid):
        """(max, its index) over the CTA; ties to the lower index."""
        for off in (32, 16, 8, 4, 2, 1):
            ov = v.shuffle_xor(off, WAVE)
            oi = idx.shuffle_xor(off, WAVE)
            take = (ov > v) | ((ov == v) & (oi < idx))
            v = take.select(ov, v)
            idx = take.select(oi, idx)
        fx.gpu.barrier()
        fx.ptr_store(v, sm.red_f.ptr + tid // WAVE)  # every lane of a wave: the same pair
        fx.ptr_store(idx, sm.red_i.ptr + tid // WAVE)
        fx.gpu.barrier()
        tv = fx.ptr_load(sm.red_f.ptr + 0)
        ti = fx.ptr_load(sm.red_i.ptr + 0)
        for i in range_constexpr(1, WAVES):
            ov = fx.ptr_load(sm.red_f.ptr + i)
            oi = fx.ptr_load(sm.red_i.ptr + i)
            take = (ov > tv) | ((ov == tv) & (oi < ti))
            tv = take.select(ov, tv)
            ti = take.select(oi, ti)
        return tv, ti

    def wave_dot_f32x(w_row, x_row, n, lane):
        """sum_k bf16 w[k] * fp32 x[k] over ``n`` (multiple of 8) columns, wave-wide."""
        acc = fx.Float32(0.0)
        for it in range_constexpr(-(-n // (8 * WAVE))):
            c = lane + it * WAVE  # 8-column chunk of this lane
            ok = c < n // 8
            cc = ok.select(c, 0)
            wv = fx.generic_load(gptr(w_row + fx.Int64(cc) * 16, fx.Int32, 16), count=4)
            xv = fx.generic_load(gptr(x_row + fx.Int64(cc) * 32, fx.Float32, 16), count=8)
            part = fx.Float32(0.0)
            for j in range_constexpr(4):
                ww = wv[j]
                part = part + _bf16_lo(ww) * xv[2 * j] + _bf16_hi(ww) * xv[2 * j + 1]
            acc = acc + ok.select(part, fx.Float32(0.0))
        return _wave_sum(acc)

    @flyc.jit
    def mfma_rows(w_base, ld: int, k_lo, n_k: int, x_base, ldx: int, lane, gate_base,
                  gated: bool):  # fmt: skip
        """16 weight rows (from ``w_base``, ``ld`` columns) x W batch rows (bf16 at
        ``x_base``, ``ldx`` columns) over columns [k_lo, k_lo + n_k): lane's 4 fp32 of D."""
        row = lane % 16
        kq = lane // 16
        col_ok = row < W
        colc = col_ok.select(row, 0)
        mask = col_ok.select(fx.Int32(-1), fx.Int32(0))
        acc = Vector.filled((4,), 0.0, fx.Float32)
        for k0 in range(k_lo, k_lo + n_k, 16):
            k = k0 + 4 * kq
            a = fx.generic_load(gptr(w_base + fx.Int64(row * ld + k) * 2, fx.Int16, 8), count=4)
            xa = x_base + fx.Int64(colc * ldx + k) * 2
            ga = gate_base + fx.Int64(colc * ldx + k) * 2
            x0, x1 = _x_words(xa, ga, gated, mask)
            bv = Vector.from_elements([x0, x1], fx.Int32).bitcast(fx.Int16)
            acc = _mfma(a, bv, acc)
        return acc

    def own_buffer(scratch, peers, rank):
        """This rank's peer buffer (TP > 1); the scratch otherwise (unused then)."""
        if TP == 1:
            return scratch
        return fx.generic_load(gptr(peers + fx.Int64(rank) * 8, fx.Int64, 8))

    def all_total(sm, tot, tid):
        """Softmax denominator over every expert (only without top-k renormalisation)."""
        if NORM_TOPK:
            return tot
        return _block_sum(sm, tot, tid)

    def down_row(w2, s_down, exs, pj, h):
        """Byte address of row ``h`` of pair ``pj``'s down plane (pj == K: the shared one)."""
        if pj < K:
            return w2 + (fx.Int64(exs[pj]) * (H * IM) + fx.Int64(h * IM)) * 2
        return s_down + fx.Int64(h * IS) * 2

    @flyc.kernel(known_block_size=[BLOCK, 1, 1])
    def k2(
        o_in: Int64,
        gate: Int64,
        residual: Int64,
        out_hidden: Int64,
        out_residual: Int64,
        wtab: Int64,
        rtab: Int64,
        layer: Int32,
        layers_per_step: Int32,
    ):
        tid = fx.thread_idx.x
        bid = fx.block_idx.x
        lane = tid % WAVE
        wave = tid // WAVE
        scratch, xs, peers, ctrl, health = _rt(rtab)
        sm = fx.SharedAllocator().allocate(Smem).peek()
        seq = step_seq(ctrl, layer, layers_per_step)
        tag = seq_tag(seq)
        parity = fx.Int32(seq & fx.Int64(1))
        rank = fx.Int32(fx.generic_load(gptr(ctrl + 8 * _h.CTRL_RANK, fx.Int64, 8)))
        mine = own_buffer(scratch, peers, rank)

        # -- out_proj: 64 rows x K split per task, MFMA; tagged fp32 partials -> p1 --------
        w_o = _tab(wtab, 0)
        for t in range(bid, NHB * KS1, G):
            hb = t % NHB
            ks = t // NHB
            row0 = hb * 64 + wave * 16
            acc = mfma_rows(w_o + fx.Int64(row0 * IN) * 2, IN, ks * KC, KC, o_in, IN, lane,
                            gate, GATED)  # fmt: skip
            col = lane % 16
            if col < W:
                for i in range_constexpr(4):
                    idx = (ks * W + col) * H + row0 + 4 * (lane // 16) + i
                    put(scratch, peers, "p1", idx, _bits(acc[i]), tag, parity, rank)

        # -- residual: sum splits (and ranks), + residual -> out_residual, resid ---------
        scratch, xs, peers, ctrl, health = _rt(rtab)
        for e in range(bid * BLOCK + tid, W * H, G * BLOCK):
            r = _load_bf16(residual + fx.Int64(e) * 2)
            acc = fx.Float32(0.0)
            for ks in range_constexpr(KS1):
                acc = acc + get_sum(scratch, mine, "p1", ks * W * H + e, tag, parity, ctrl, health)
            r = r + acc
            _store_bf16(out_residual + fx.Int64(e) * 2, r)
            put(scratch, peers, "resid", e, _bits(r), tag, parity, rank)

        # -- norm_router: every CTA normalises every row into its private xs -------------
        scratch, xs, peers, ctrl, health = _rt(rtab)
        ln_w = _tab(wtab, 1)
        xs_f = xs + fx.Int64(bid) * (W * H * 4)
        xs_b = xs + XS_BF + fx.Int64(bid) * (W * H * 2)
        for row in range(W):
            ss = fx.Float32(0.0)
            for h in range(tid, H, BLOCK):
                x = _f32_of(get(scratch, "resid", row * H + h, tag, ctrl, health))
                ss = ss + x * x
            inv = fx.math.rsqrt(_block_sum(sm, ss, tid) / fx.Float32(H) + fx.Float32(EPS))
            for h in range(tid, H, BLOCK):
                x = _f32_of(fx.Int32(load_word(word_addr(scratch, OFF["resid"] + row * H + h))))
                y = x * inv * (fx.Float32(1.0) + _load_bf16(ln_w + fx.Int64(h) * 2))
                fx.generic_store(gptr(xs_f + fx.Int64(row * H + h) * 4, fx.Float32, 4), y)
                _store_bf16(xs_b + fx.Int64(row * H + h) * 2, y)
        _fence_workgroup()
        fx.gpu.barrier()
        _fence_workgroup()
        # router logits: one (expert, row) dot per wave task
        router = _tab(wtab, 2)
        for d in range(bid * WAVES + wave, E * W, G * WAVES):
            ex = d % E
            row = d // E
            lg = wave_dot_f32x(router + fx.Int64(ex * H) * 2, xs_f + fx.Int64(row * H) * 4, H,
                               lane)  # fmt: skip
            if lane == 0:
                put(scratch, peers, "logits", row * E + ex, _bits(lg), tag, parity, rank)

        # -- topk_gate_up: routed (pair, 64-element block) tasks, then shared blocks -----
        scratch, xs, peers, ctrl, health = _rt(rtab)
        xs_f = xs + fx.Int64(bid) * (W * H * 4)
        xs_b = xs + XS_BF + fx.Int64(bid) * (W * H * 2)
        w13 = _tab(wtab, 3)
        s_gu = _tab(wtab, 5)
        s_gate = _tab(wtab, 7)
        for t in range(bid, PR * NIB + NSB, G):
            if t < PR * NIB:
                p = t // NIB
                ib = t % NIB
                row = p // K
                j = p % K
                # the row's logits (EC per lane), softmax max and sum, k rounds of argmax
                lv = []
                for c in range_constexpr(EC):
                    ex = tid + c * BLOCK
                    ok = ex < E
                    w = get(scratch, "logits", row * E + ok.select(ex, 0), tag, ctrl, health)
                    lv.append(ok.select(_f32_of(w), fx.Float32(_NEG_INF)))
                m = lv[0]
                for c in range_constexpr(1, EC):
                    m = (lv[c] > m).select(lv[c], m)
                m = block_max(sm, m, tid)
                q = []
                tot = fx.Float32(0.0)
                for c in range_constexpr(EC):
                    ex = tid + c * BLOCK
                    qc = (ex < E).select(fx.math.exp(lv[c] - m), fx.Float32(0.0))
                    q.append(qc)
                    tot = tot + qc
                tot = all_total(sm, tot, tid)
                picked = fx.Float32(0.0)
                e_sel = fx.Int32(0)
                v_sel = fx.Float32(0.0)
                for rnd in range_constexpr(K):
                    bv = q[0]
                    bi = tid
                    for c in range_constexpr(1, EC):
                        take = q[c] > bv
                        bv = take.select(q[c], bv)
                        bi = take.select(tid + c * BLOCK, bi)
                    v, ix = block_argmax(sm, bv, bi, tid)
                    picked = picked + v
                    hit = j == rnd
                    e_sel = hit.select(ix, e_sel)
                    v_sel = hit.select(v, v_sel)
                    for c in range_constexpr(EC):
                        q[c] = (ix == tid + c * BLOCK).select(fx.Float32(-1.0), q[c])
                wgt = v_sel / (picked if NORM_TOPK else tot)
                if (ib == 0) & (tid == 0):
                    put(scratch, peers, "ids", p, e_sel, tag, parity, rank)
                xrow = xs_f + fx.Int64(row * H) * 4
                g_base = w13 + fx.Int64(e_sel) * (2 * IM * H * 2)
                i0 = ib * 64 + wave * 16
                for ii in range(0, 16, 2):
                    i = i0 + ii
                    g0 = wave_dot_f32x(g_base + fx.Int64(i * H) * 2, xrow, H, lane)
                    u0 = wave_dot_f32x(g_base + fx.Int64((IM + i) * H) * 2, xrow, H, lane)
                    g1 = wave_dot_f32x(g_base + fx.Int64((i + 1) * H) * 2, xrow, H, lane)
                    u1 = wave_dot_f32x(g_base + fx.Int64((IM + i + 1) * H) * 2, xrow, H, lane)
                    a0 = _silu(g0) * u0 * wgt
                    a1 = _silu(g1) * u1 * wgt
                    if lane == 0:
                        put(scratch, peers, "act", p * IW + i // 2, _bf16x2(a0, a1), tag, parity,
                            rank)  # fmt: skip
            else:
                sb = t - PR * NIB
                i0 = sb * 64 + wave * 16
                accg = mfma_rows(s_gu + fx.Int64(i0 * H) * 2, H, 0, H, xs_b, H, lane, xs_b, False)
                accu = mfma_rows(s_gu + fx.Int64((IS + i0) * H) * 2, H, 0, H, xs_b, H, lane, xs_b,
                                 False)  # fmt: skip
                col = lane % 16
                sg = fx.Float32(0.0)
                for row in range(W):
                    d = wave_dot_f32x(s_gate, xs_f + fx.Int64(row * H) * 4, H, lane)
                    sg = (col == row).select(_sigmoid(d), sg)
                if col < W:
                    r0 = i0 + 4 * (lane // 16)
                    for hp in range_constexpr(2):
                        a0 = _silu(accg[2 * hp]) * accu[2 * hp] * sg
                        a1 = _silu(accg[2 * hp + 1]) * accu[2 * hp + 1] * sg
                        idx = (PR + col) * IW + r0 // 2 + hp
                        put(scratch, peers, "act", idx, _bf16x2(a0, a1), tag, parity, rank)

        # -- down: (64 H rows, batch row) tasks over the row's pairs + its shared expert --
        scratch, xs, peers, ctrl, health = _rt(rtab)
        w2 = _tab(wtab, 4)
        s_down = _tab(wtab, 6)
        for t in range(bid, NHB * W, G):
            hb = t % NHB
            row = t // NHB
            exs = []
            for j in range_constexpr(K):
                exs.append(get(scratch, "ids", row * K + j, tag, ctrl, health))
            # wait for this lane's words of every pair of the row (the dots re-load them)
            for pj in range_constexpr(K + 1):
                p = row * K + pj if pj < K else PR + row
                ni = IM if pj < K else IS
                for it in range_constexpr(-(-ni // (8 * WAVE))):
                    c = lane + it * WAVE
                    if c < ni // 8:
                        for q4 in range_constexpr(4):
                            get(scratch, "act", p * IW + c * 4 + q4, tag, ctrl, health)
            for r in range(16):
                h = hb * 64 + wave * 16 + r
                acc = fx.Float32(0.0)
                for pj in range_constexpr(K + 1):
                    p = row * K + pj if pj < K else PR + row
                    ni = IM if pj < K else IS
                    w_row = down_row(w2, s_down, exs, pj, h)
                    part = fx.Float32(0.0)
                    for it in range_constexpr(-(-ni // (8 * WAVE))):
                        c = lane + it * WAVE
                        ok = c < ni // 8
                        cc = ok.select(c, 0)
                        wv = fx.generic_load(gptr(w_row + fx.Int64(cc) * 16, fx.Int32, 16),
                                             count=4)  # fmt: skip
                        sub = fx.Float32(0.0)
                        for q4 in range_constexpr(4):
                            aw = fx.Int32(
                                load_word(word_addr(scratch, OFF["act"] + p * IW + cc * 4 + q4))
                            )
                            sub = sub + _bf16_lo(wv[q4]) * _bf16_lo(aw)
                            sub = sub + _bf16_hi(wv[q4]) * _bf16_hi(aw)
                        part = part + ok.select(sub, fx.Float32(0.0))
                    acc = acc + part
                acc = _wave_sum(acc)
                if lane == 0:
                    if TP == 1:
                        _store_bf16(out_hidden + fx.Int64(row * H + h) * 2, acc)
                    else:
                        put(scratch, peers, "p4", row * H + h, _bits(acc), tag, parity, rank)

        # -- moe_out (TP > 1): rank sum of the MoE partials -> out_hidden -----------------
        scratch, xs, peers, ctrl, health = _rt(rtab)
        if TP > 1:
            for e in range(bid * BLOCK + tid, W * H, G * BLOCK):
                acc = get_sum(scratch, mine, "p4", e, tag, parity, ctrl, health)
                _store_bf16(out_hidden + fx.Int64(e) * 2, acc)

    @flyc.jit
    def launch(
        o_in: Int64,
        gate: Int64,
        residual: Int64,
        out_hidden: Int64,
        out_residual: Int64,
        wtab: Int64,
        rtab: Int64,
        layer: Int32,
        layers_per_step: Int32,
        stream: Stream = _NULL_STREAM,
    ):
        k2(o_in, gate, residual, out_hidden, out_residual, wtab, rtab, layer,
           layers_per_step).launch(grid=(G, 1, 1), block=(BLOCK, 1, 1), stream=stream)  # fmt: skip

    return launch
