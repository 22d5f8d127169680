"""Device code of the FlyDSL K1 attention front (see ``k1.py`` for the contract)."""

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import range_constexpr
from flydsl.expr.typing import Int32, Int64, Stream, Vector

from mono_ext.kernels.flydsl.limits import BLOCK
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
from mono_ext.models.qwen3_next.flydsl._k2_device import (
    _NULL_STREAM,
    WAVE,
    WAVES,
    _block_sum,
    _fence_workgroup,
    _load_bf16,
    _mfma,
    _rt,
    _sigmoid,
    _store_bf16,
    _tab,
    _wave_sum,
    _x_words,
)

__all__ = ["k1_attn_launch"]


def _norm_rows_launch(W, H, EPS):
    """Both fronts' prologue for a build of width ``W``: every row's add (hidden + residual,
    when the layer has one) and Gemma RMSNorm into this CTA's ``xs_b``, CTA 0 also writing
    the sum as the residual out, then the workgroup's stores fenced for its other waves."""

    @flyc.jit
    def norm_rows(sm, hidden, residual, residual_out, ln_w, xs_b, has_residual, tid, bid):
        res_on = has_residual != 0
        res_base = res_on.select(residual, hidden)  # a valid address either way
        res_scale = res_on.select(fx.Float32(1.0), fx.Float32(0.0))
        for row in range(W):
            ss = fx.Float32(0.0)
            for h in range(tid, H, BLOCK):
                e = fx.Int64(row * H + h) * 2
                x = _load_bf16(hidden + e) + res_scale * _load_bf16(res_base + e)
                ss = ss + x * x
            inv = fx.math.rsqrt(_block_sum(sm, ss, tid) / fx.Float32(H) + fx.Float32(EPS))
            for h in range(tid, H, BLOCK):
                e = fx.Int64(row * H + h) * 2
                x = _load_bf16(hidden + e) + res_scale * _load_bf16(res_base + e)
                _store_bf16(
                    xs_b + e, x * inv * (fx.Float32(1.0) + _load_bf16(ln_w + fx.Int64(h) * 2))
                )
                if bid == 0:
                    _store_bf16(residual_out + e, x)
        _fence_workgroup()
        fx.gpu.barrier()
        _fence_workgroup()

    return norm_rows


def k1_attn_launch(b):
    """A fresh ``@flyc.jit`` launch of the attention-front build ``b`` (``k1.K1AttnBuild``)."""
    s = b.shape
    W, H, HQ, HKV, D, RD = b.width, s.hidden, s.hq, s.hkv, s.head_dim, s.rotary_dim
    EPS, G = float(s.eps), b.grid
    HALF = RD // 2
    NROWS = s.qkv_rows
    NT = -(-NROWS // (16 * WAVES))  # 64-row tiles of qkv_proj
    QW = (HQ + HKV) * D  # qk words per row
    lay = b.layout
    OFF = lay.offsets["qk"]
    RID = lay.region_id("qk")

    @fx.struct
    class Smem:
        red_f: fx.Array[fx.Float32, 2 * WAVES, 16]

    norm_rows = _norm_rows_launch(W, H, EPS)

    @flyc.jit
    def mfma_rows(w_base, row0, x_base, lane):
        """16 qkv_proj rows from ``row0`` (clamped to the plane) x W normed rows over H."""
        row = lane % 16
        kq = lane // 16
        col_ok = row < W
        colc = col_ok.select(row, 0)
        mask = col_ok.select(fx.Int32(-1), fx.Int32(0))
        wr = row0 + row
        wrc = (wr < NROWS).select(wr, 0)
        acc = Vector.filled((4,), 0.0, fx.Float32)
        for k0 in range(0, H, 16):
            k = k0 + 4 * kq
            a = fx.generic_load(gptr(w_base + fx.Int64(wrc * H + k) * 2, fx.Int16, 8), count=4)
            xa = x_base + fx.Int64(colc * H + k) * 2
            x0, x1 = _x_words(xa, xa, False, mask)
            bv = Vector.from_elements([x0, x1], fx.Int32).bitcast(fx.Int16)
            acc = _mfma(a, bv, acc)
        return acc

    @flyc.kernel(known_block_size=[BLOCK, 1, 1])
    def k1a(
        hidden: Int64,
        residual: Int64,
        residual_out: Int64,
        positions: Int64,
        q: Int64,
        gate: Int64,
        k: Int64,
        v: Int64,
        wtab: Int64,
        rtab: Int64,
        has_residual: Int32,
        layer: Int32,
        layers_per_step: Int32,
    ):
        tid = fx.thread_idx.x
        bid = fx.block_idx.x
        lane = tid % WAVE
        wave = tid // WAVE
        sm = fx.SharedAllocator().allocate(Smem).peek()
        scratch, xs, rope, ctrl, health = _rt(rtab)
        tag = seq_tag(step_seq(ctrl, layer, layers_per_step))
        ln_w = _tab(wtab, 0)
        xs_b = xs + fx.Int64(bid) * (W * H * 2)
        # -- prologue: add + Gemma norm of every row into this CTA's xs ----------------
        norm_rows(sm, hidden, residual, residual_out, ln_w, xs_b, has_residual, tid, bid)

        # -- qkv_proj: 64-row tiles; gate / v out, raw q / k tagged into qk -------------
        w_qkv = _tab(wtab, 1)
        for t in range(bid, NT, G):
            row0 = t * 64 + wave * 16
            acc = mfma_rows(w_qkv, row0, xs_b, lane)
            col = lane % 16
            for i in range_constexpr(4):
                r = row0 + 4 * (lane // 16) + i
                val = acc[i]
                if (col < W) & (r < NROWS):
                    if r < 2 * HQ * D:
                        head = r // (2 * D)
                        j = r % (2 * D)
                        if j < D:
                            idx = col * QW + head * D + j
                            store_tagged(word_addr(scratch, OFF + idx),
                                         pack_tagged(val.bitcast(fx.Int32), tag), False)  # fmt: skip
                        else:
                            _store_bf16(gate + fx.Int64(col * HQ * D + head * D + j - D) * 2, val)
                    else:
                        if r < (2 * HQ + HKV) * D:
                            idx = col * QW + HQ * D + r - 2 * HQ * D
                            store_tagged(word_addr(scratch, OFF + idx),
                                         pack_tagged(val.bitcast(fx.Int32), tag), False)  # fmt: skip
                        else:
                            kv = r - (2 * HQ + HKV) * D
                            _store_bf16(v + fx.Int64(col * HKV * D + kv) * 2, val)

        # -- norm_rope: one (row, q or k head) per wave -------------------------------
        scratch, xs, rope, ctrl, health = _rt(rtab)
        qn = _tab(wtab, 2)
        kn = _tab(wtab, 3)
        for task in range(bid * WAVES + wave, W * (HQ + HKV), G * WAVES):
            row = task // (HQ + HKV)
            head = task % (HQ + HKV)
            is_q = head < HQ
            nw = is_q.select(qn, kn)
            base = row * QW + head * D
            raws = []
            ss = fx.Float32(0.0)
            for c in range_constexpr(D // WAVE):
                i = lane + c * WAVE
                w = _wait_tagged(word_addr(scratch, OFF + base + i), tag, ctrl, health, RID,
                                 base + i)  # fmt: skip
                x = fx.Int32(w).bitcast(fx.Float32)
                raws.append(x)
                ss = ss + x * x
            inv = fx.math.rsqrt(_wave_sum(ss) / fx.Float32(D) + fx.Float32(EPS))
            pos = fx.generic_load(gptr(positions + fx.Int64(row) * 8, fx.Int64, 8))
            trow = rope + pos * (RD * 4)
            kh = head - HQ
            out = is_q.select(q + fx.Int64(row * HQ * D + head * D) * 2,
                              k + fx.Int64(row * HKV * D + kh * D) * 2)  # fmt: skip
            for c in range_constexpr(D // WAVE):
                i = lane + c * WAVE
                y = raws[c] * inv * (fx.Float32(1.0) + _load_bf16(nw + fx.Int64(i) * 2))
                # partner of i in the rotate-half pair (its own words: already waited by
                # its lane; re-read through the same uncached path)
                in_rot = i < RD
                lo = i < HALF
                jp = lo.select(i + HALF, i - HALF)
                jc = in_rot.select(jp, i)
                wj = _wait_tagged(word_addr(scratch, OFF + base + jc), tag, ctrl, health, RID,
                                  base + jc)  # fmt: skip
                yj = fx.Int32(wj).bitcast(fx.Float32) * inv
                yj = yj * (fx.Float32(1.0) + _load_bf16(nw + fx.Int64(jc) * 2))
                f = in_rot.select(i % HALF, 0)
                cs = fx.generic_load(gptr(trow + fx.Int64(f) * 4, fx.Float32, 4))
                sn = fx.generic_load(gptr(trow + fx.Int64(HALF + f) * 4, fx.Float32, 4))
                rot = lo.select(y * cs - yj * sn, y * cs + yj * sn)
                _store_bf16(out + fx.Int64(i) * 2, in_rot.select(rot, y))

    @flyc.jit
    def launch(
        hidden: Int64,
        residual: Int64,
        residual_out: Int64,
        positions: Int64,
        q: Int64,
        gate: Int64,
        k: Int64,
        v: Int64,
        wtab: Int64,
        rtab: Int64,
        has_residual: Int32,
        layer: Int32,
        layers_per_step: Int32,
        stream: Stream = _NULL_STREAM,
    ):
        k1a(hidden, residual, residual_out, positions, q, gate, k, v, wtab, rtab, has_residual,
            layer, layers_per_step).launch(grid=(G, 1, 1), block=(BLOCK, 1, 1),
                                           stream=stream)  # fmt: skip

    return launch


def _softplus(x):
    """torch's softplus (threshold 20: the identity above it)."""
    return (x > fx.Float32(20.0)).select(x, fx.math.log(fx.Float32(1.0) + fx.math.exp(x)))


def _load_f(addr, fp32: bool):
    """One fp32 or bf16 value (dtype fixed at build)."""
    if fp32:
        return fx.generic_load(gptr(addr, fx.Float32, 4))
    return _load_bf16(addr)


def _store_f(addr, x, fp32: bool):
    if fp32:
        fx.generic_store(gptr(addr, fx.Float32, 4), x)
    else:
        _store_bf16(addr, x)


def k1_gdn_launch(b):
    """A fresh ``@flyc.jit`` launch of the GDN-front build ``b`` (``k1.K1GdnBuild``)."""
    s = b.shape
    W, H, HK, HV, DK, DV, KC = b.width, s.hidden, s.hk, s.hv, s.dk, s.dv, s.conv_k
    EPS, G = float(s.eps), b.grid
    R = HV // HK
    C = s.conv_dim
    P = s.qkvz_rows
    NROWS = P + 2 * HV
    NT = -(-NROWS // (16 * WAVES))
    WG = s.payload_words
    INTERLEAVED = b.packing == "interleaved"
    TIME_CHAN = b.conv_layout == "time_chan"
    VK = b.ssm_layout == "vk"
    SSM32 = b.state_dtype == "float32"
    DT32 = b.dt_bias_dtype == "float32"
    SSB = 4 if SSM32 else 2
    DTB = 4 if DT32 else 2
    TPR = BLOCK // DV  # threads per value row of the state
    CPT = DK // TPR  # state columns per thread
    QSCALE = float(DK) ** -0.5
    lay = b.layout
    OFF = lay.offsets["proj"]
    RID = lay.region_id("proj")

    @fx.struct
    class Smem:
        red_f: fx.Array[fx.Float32, 2 * WAVES, 16]

    norm_rows = _norm_rows_launch(W, H, EPS)

    def partner_sum(x):
        """Sum over the TPR threads of one state row (adjacent lanes)."""
        off = TPR // 2
        while off >= 1:
            x = x + x.shuffle_xor(off, WAVE)
            off //= 2
        return x

    def row_map(r):
        """(payload word, kind) of projection row r: kind 0 conv channel, 1 z, 2 b, 3 a."""
        if INTERLEAVED:
            gw = 2 * DK + 2 * R * DV
            g = r // gw
            w = r % gw
            rb = r - P
            gb = rb // (2 * R)
            wb = rb % (2 * R)
            is_ba = r >= P
            in_q = w < DK
            in_k = w < 2 * DK
            in_v = w < 2 * DK + R * DV
            pq = g * DK + w
            pk = HK * DK + g * DK + w - DK
            pv = 2 * HK * DK + g * R * DV + w - 2 * DK
            pz = C + g * R * DV + w - 2 * DK - R * DV
            p_qkvz = in_q.select(pq, in_k.select(pk, in_v.select(pv, pz)))
            k_qkvz = in_v.select(fx.Int32(0), fx.Int32(1))
            head = gb * R + (wb < R).select(wb, wb - R)
            k_ba = (wb < R).select(fx.Int32(2), fx.Int32(3))
            return is_ba.select(head, p_qkvz), is_ba.select(k_ba, k_qkvz)
        is_ba = r >= P
        rb = r - P
        head = (rb < HV).select(rb, rb - HV)
        k_ba = (rb < HV).select(fx.Int32(2), fx.Int32(3))
        return is_ba.select(head, r), is_ba.select(k_ba, (r < C).select(fx.Int32(0), fx.Int32(1)))

    def conv_addr(cs, slot, ss, t, ch):
        """Byte address of conv-state tap t (oldest first) of channel ch in a slot."""
        if TIME_CHAN:
            return cs + (fx.Int64(slot) * ss + fx.Int64(t * C + ch)) * 2
        return cs + (fx.Int64(slot) * ss + fx.Int64(ch * (KC - 1) + t)) * 2

    def state_addr(st, slot, ss, h, dv, dk):
        if VK:
            return st + (fx.Int64(slot) * ss + fx.Int64((h * DV + dv) * DK + dk)) * SSB
        return st + (fx.Int64(slot) * ss + fx.Int64((h * DK + dk) * DV + dv)) * SSB

    @flyc.jit
    def mfma_rows(w_qkvz, w_ba, row0, x_base, lane):
        """16 projection rows from ``row0`` (qkvz then ba; clamped) x W normed rows."""
        row = lane % 16
        kq = lane // 16
        col_ok = row < W
        colc = col_ok.select(row, 0)
        mask = col_ok.select(fx.Int32(-1), fx.Int32(0))
        wr = row0 + row
        wrc = (wr < NROWS).select(wr, 0)
        is_ba = wrc >= P
        base = is_ba.select(w_ba + fx.Int64(wrc - P) * (H * 2), w_qkvz + fx.Int64(wrc) * (H * 2))
        acc = Vector.filled((4,), 0.0, fx.Float32)
        for k0 in range(0, H, 16):
            k = k0 + 4 * kq
            a = fx.generic_load(gptr(base + fx.Int64(k) * 2, fx.Int16, 8), count=4)
            xa = x_base + fx.Int64(colc * H + k) * 2
            x0, x1 = _x_words(xa, xa, False, mask)
            bv = Vector.from_elements([x0, x1], fx.Int32).bitcast(fx.Int16)
            acc = _mfma(a, bv, acc)
        return acc

    @flyc.kernel(known_block_size=[BLOCK, 1, 1])
    def k1g(
        hidden: Int64,
        residual: Int64,
        residual_out: Int64,
        slots: Int64,
        o_in: Int64,
        wtab: Int64,
        rtab: Int64,
        stab: Int64,
        has_residual: Int32,
        null_slot: Int32,
        layer: Int32,
        layers_per_step: Int32,
    ):
        tid = fx.thread_idx.x
        bid = fx.block_idx.x
        lane = tid % WAVE
        wave = tid // WAVE
        sm = fx.SharedAllocator().allocate(Smem).peek()
        scratch, xs, _unused, ctrl, health = _rt(rtab)
        tag = seq_tag(step_seq(ctrl, layer, layers_per_step))
        ln_w = _tab(wtab, 0)
        xs_b = xs + fx.Int64(bid) * (W * H * 2)
        # -- prologue: add + Gemma norm of every row into this CTA's xs ----------------
        norm_rows(sm, hidden, residual, residual_out, ln_w, xs_b, has_residual, tid, bid)

        # -- proj: qkvz and ba rows on MFMA; conv update, beta, g; tagged payload -------
        w_qkvz = _tab(wtab, 1)
        w_ba = _tab(wtab, 2)
        conv_w = _tab(wtab, 3)
        a_log = _tab(wtab, 4)
        dt_bias = _tab(wtab, 5)
        conv_st = _tab(stab, 0)
        conv_ss = _tab(stab, 1)
        for t in range(bid, NT, G):
            row0 = t * 64 + wave * 16
            acc = mfma_rows(w_qkvz, w_ba, row0, xs_b, lane)
            col = lane % 16
            slot = fx.generic_load(
                gptr(slots + fx.Int64((col < W).select(col, 0)) * 4, fx.Int32, 4)
            )
            valid = (slot >= 0) & (slot != null_slot)
            for i in range_constexpr(4):
                r = row0 + 4 * (lane // 16) + i
                x = acc[i]
                pw, kind = row_map(r)
                is_conv = kind == 0
                ch = is_conv.select(pw, 0)
                hix = (kind >= 2).select(pw, 0)
                slot_c = valid.select(slot, 0)  # a real slot to read from; masked below
                cv = fx.Float32(0.0)
                prev = []
                for tp in range_constexpr(KC - 1):
                    pv = _load_bf16(conv_addr(conv_st, slot_c, conv_ss, tp, ch))
                    prev.append(pv)
                    cv = cv + _load_bf16(conv_w + fx.Int64(ch * KC + tp) * 2) * pv
                cv = valid.select(cv, fx.Float32(0.0))
                cv = cv + _load_bf16(conv_w + fx.Int64(ch * KC + KC - 1) * 2) * x
                al = fx.generic_load(gptr(a_log + fx.Int64(hix) * 4, fx.Float32, 4))
                dt = _load_f(dt_bias + fx.Int64(hix) * DTB, DT32)
                g_val = -fx.math.exp(al) * _softplus(x + dt)
                val = is_conv.select(cv * _sigmoid(cv), x)
                val = (kind == 2).select(_sigmoid(x), val)
                val = (kind == 3).select(g_val, val)
                word = (kind == 2).select(C + HV * DV + pw, pw)
                word = (kind == 3).select(C + HV * DV + HV + pw, word)
                live = (col < W) & (r < NROWS)
                if live & is_conv & valid:
                    for tp in range_constexpr(KC - 2):
                        _store_bf16(conv_addr(conv_st, slot, conv_ss, tp, ch), prev[tp + 1])
                    _store_bf16(conv_addr(conv_st, slot, conv_ss, KC - 2, ch), x)
                if live:
                    store_tagged(word_addr(scratch, OFF + col * WG + word),
                                 pack_tagged(val.bitcast(fx.Int32), tag), False)  # fmt: skip

        # -- recurrence: one (row, value head) per CTA task ---------------------------
        scratch, xs, _unused, ctrl, health = _rt(rtab)
        st = _tab(stab, 2)
        st_ss = _tab(stab, 3)
        norm_w = _tab(wtab, 6)
        dv = tid // TPR
        c0 = (tid % TPR) * CPT
        for task in range(bid, W * HV, G):
            row = task // HV
            h = task % HV
            gk = h // R
            slot = fx.generic_load(gptr(slots + fx.Int64(row) * 4, fx.Int32, 4))
            valid = (slot >= 0) & (slot != null_slot)
            base = row * WG
            qb = base + gk * DK
            kb = base + HK * DK + gk * DK
            qq = fx.Float32(0.0)
            kk = fx.Float32(0.0)
            for c in range(c0, c0 + CPT):
                wq = _wait_tagged(word_addr(scratch, OFF + qb + c), tag, ctrl, health, RID, qb + c)
                wk = _wait_tagged(word_addr(scratch, OFF + kb + c), tag, ctrl, health, RID, kb + c)
                xq = fx.Int32(wq).bitcast(fx.Float32)
                xk = fx.Int32(wk).bitcast(fx.Float32)
                qq = qq + xq * xq
                kk = kk + xk * xk
            inv_q = fx.math.rsqrt(partner_sum(qq) + fx.Float32(1e-6)) * fx.Float32(QSCALE)
            inv_k = fx.math.rsqrt(partner_sum(kk) + fx.Float32(1e-6))
            vi = base + 2 * HK * DK + h * DV + dv
            zi = base + C + h * DV + dv
            bi = base + C + HV * DV + h
            gi = bi + HV
            wv = _wait_tagged(word_addr(scratch, OFF + vi), tag, ctrl, health, RID, vi)
            wz = _wait_tagged(word_addr(scratch, OFF + zi), tag, ctrl, health, RID, zi)
            wb = _wait_tagged(word_addr(scratch, OFF + bi), tag, ctrl, health, RID, bi)
            wg = _wait_tagged(word_addr(scratch, OFF + gi), tag, ctrl, health, RID, gi)
            v = fx.Int32(wv).bitcast(fx.Float32)
            z = fx.Int32(wz).bitcast(fx.Float32)
            beta = fx.Int32(wb).bitcast(fx.Float32)
            decay = fx.math.exp(fx.Int32(wg).bitcast(fx.Float32))
            slot_c = valid.select(slot, 0)  # padding rows read slot 0, write nothing
            sk = fx.Float32(0.0)
            for c in range(c0, c0 + CPT):
                kx = _f32_word(scratch, OFF + kb + c) * inv_k
                sk = sk + decay * _load_f(state_addr(st, slot_c, st_ss, h, dv, c), SSM32) * kx
            d = beta * (v - partner_sum(sk))
            o = fx.Float32(0.0)
            for c in range(c0, c0 + CPT):
                kx = _f32_word(scratch, OFF + kb + c) * inv_k
                qx = _f32_word(scratch, OFF + qb + c) * inv_q
                sa = state_addr(st, slot_c, st_ss, h, dv, c)
                sn = decay * _load_f(sa, SSM32) + d * kx
                if valid:
                    _store_f(sa, sn, SSM32)
                o = o + sn * qx
            o = partner_sum(o)
            own = (tid % TPR) == 0
            oo = _block_sum(sm, own.select(o * o, fx.Float32(0.0)), tid)
            inv_o = fx.math.rsqrt(oo / fx.Float32(DV) + fx.Float32(EPS))
            y = _load_bf16(norm_w + fx.Int64(dv) * 2) * o * inv_o * (z * _sigmoid(z))
            if own:
                _store_bf16(o_in + fx.Int64(row * HV * DV + h * DV + dv) * 2,
                            valid.select(y, fx.Float32(0.0)))  # fmt: skip

    @flyc.jit
    def launch(
        hidden: Int64,
        residual: Int64,
        residual_out: Int64,
        slots: Int64,
        o_in: Int64,
        wtab: Int64,
        rtab: Int64,
        stab: Int64,
        has_residual: Int32,
        null_slot: Int32,
        layer: Int32,
        layers_per_step: Int32,
        stream: Stream = _NULL_STREAM,
    ):
        k1g(hidden, residual, residual_out, slots, o_in, wtab, rtab, stab, has_residual,
            null_slot, layer, layers_per_step).launch(grid=(G, 1, 1), block=(BLOCK, 1, 1),
                                                      stream=stream)  # fmt: skip

    return launch


def _f32_word(base, index):
    """The fp32 value of a tagged word (already waited for by this lane)."""
    return fx.Int32(load_word(word_addr(base, index))).bitcast(fx.Float32)
