#!/usr/bin/env python3
# Host emulation of kernels/moe.cu's k_moe_decode1 work split (no GPU needed): the slice
# choice and ring size of d1_plan, which warp computes which router logit, which block
# takes which unit, which warp which gate|up row, the down columns' ring chunks (what
# each thread copies, which lane reads what, the row groups' sums) and the last phase's
# columns, replayed in float64 on random weights and checked against a direct MoE layer
# (and that every logit, row and column is done exactly once).
#   python3 tests/gpu/moe_decode1_emu.py
import numpy as np

NT, W, NS, MAX_SLICE, SMS, SMEM_MAX = 512, 16, 8, 64, 132, 232448


def d1_slice(K, F, sms):
    best = None
    for sl in range(32, MAX_SLICE + 1, 8):
        S = (F + sl - 1) // sl
        units = K * S
        G = min(units, sms)
        cost = (units + G - 1) // G * sl
        if best is None or cost <= best[2]:
            best = (sl, S, cost)
    return best[0], best[1]


def d1_plan(hidden, E, K, F):
    assert hidden % 8 == 0 and F % 8 == 0 and 0 < K <= min(E, 16) and E <= 512
    slice_, S = d1_slice(K, F, SMS)
    G = min(K * S, SMS)
    fixed = hidden * 6
    assert SMEM_MAX >= fixed + 1024 + NS * 8 * slice_ * 2
    CR = (SMEM_MAX - fixed - 1024) // (NS * slice_ * 2)
    CR = min(CR, (hidden + NS - 1) // NS)
    return slice_, S, G, CR, fixed + NS * CR * slice_ * 2


def run(hidden, E, K, F, rng):
    slice_, S, G, CR, smem = d1_plan(hidden, E, K, F)
    Wr = rng.standard_normal((E, hidden))
    Wgu = rng.standard_normal((E, 2 * F, hidden)) / np.sqrt(hidden)
    Wd = rng.standard_normal((E, hidden, F)) / np.sqrt(F)
    x = rng.standard_normal(hidden)
    resid = rng.standard_normal(hidden)
    # 1. logits: warp w of block b takes experts b + G w, + G W, ...
    logits, seen = np.full(E, np.nan), np.zeros(E, int)
    for b in range(G):
        for w in range(W):
            for e in range(b + G * w, E, G * W):
                logits[e] = Wr[e] @ x
                seen[e] += 1
    assert (seen == 1).all(), "every router logit once"
    p = np.exp(logits - logits.max())
    p /= p.sum()
    picks = list(np.argsort(-logits, kind="stable")[:K])
    wk = p[picks] / p[picks].sum()
    # 2. units
    lpr = slice_ // 8
    rpw = 32 // lpr
    part = np.zeros((G, hidden))
    act_done = np.zeros((K, F), int)
    down_done = np.zeros((K, hidden, F), int)
    for b in range(G):
        ys = np.zeros(hidden)
        for unit in range(b, K * S, G):
            k, j0 = unit // S, (unit % S) * slice_
            nj, e = min(F - j0, slice_), picks[k]
            words = nj // 8
            hs = np.zeros(MAX_SLICE)
            for warp in range(W):
                for jj in range(warp, nj, W):
                    g, u = Wgu[e, j0 + jj] @ x, Wgu[e, F + j0 + jj] @ x
                    hs[jj] = g / (1 + np.exp(-g)) * u
                    act_done[k, j0 + jj] += 1
            nch = (hidden + CR - 1) // CR
            ring = np.full((NS, CR, slice_), np.nan)
            for c in range(nch):   # (issue at unit start / after chunk c - NS: same contents)
                r0 = c * CR
                nr = min(CR, hidden - r0)
                st = ring[c % NS]
                st[:] = np.nan
                for tid in range(NT):
                    for i in range(tid, nr * words, NT):
                        r, wd = i // words, i % words
                        st[r, wd * 8:wd * 8 + 8] = Wd[e, r0 + r, j0 + wd * 8:j0 + wd * 8 + 8]
                for warp in range(W):
                    base = warp * rpw
                    while base < nr:
                        pl = np.zeros(32)
                        for lane in range(32):
                            ci, rl = lane % lpr, lane // lpr
                            r = base + rl
                            if rl < rpw and ci < words and r < nr:
                                v = st[r, ci * 8:ci * 8 + 8]
                                assert not np.isnan(v).any(), "a ring word read before it was copied"
                                pl[lane] = v @ hs[ci * 8:ci * 8 + 8]
                                down_done[k, r0 + r, j0 + ci * 8:j0 + ci * 8 + 8] += 1
                        for lane in range(32):
                            ci, rl = lane % lpr, lane // lpr
                            r = base + rl
                            if ci == 0 and rl < rpw and r < nr:
                                ys[r0 + r] += wk[k] * sum(pl[(rl * lpr + i) & 31] for i in range(lpr))
                        base += W * rpw
        part[b] = ys
    assert (act_done == 1).all(), "every activation once"
    assert (down_done == 1).all(), "every down weight of the picks once"
    # 3. columns of block b: [hidden b / G, hidden (b + 1) / G)
    out, cols = resid.copy(), np.zeros(hidden, int)
    for b in range(G):
        for n in range(hidden * b // G, hidden * (b + 1) // G):
            out[n] += part[:, n].sum()
            cols[n] += 1
    assert (cols == 1).all(), "every column once"
    # reference
    ref = resid.copy()
    for k, e in enumerate(picks):
        g, u = Wgu[e, :F] @ x, Wgu[e, F:] @ x
        ref += wk[k] * (Wd[e] @ (g / (1 + np.exp(-g)) * u))
    err = np.abs(out - ref).max() / np.abs(ref - resid).max()
    print(f"hidden {hidden} E {E} K {K} F {F}: slice {slice_}, {S} a pick, grid {G}, ring chunks of {CR} rows "
          f"({(hidden + CR - 1) // CR} a unit), {smem} B shared; rel err {err:.1e}")
    assert err < 1e-12


rng = np.random.default_rng(1)
for shape in [(256, 16, 4, 96), (2048, 128, 8, 768), (512, 8, 2, 1408), (1000, 8, 2, 1400), (1024, 4, 4, 200),
              (4096, 8, 2, 1792)]:
    run(*shape, rng)
print("moe_decode1_emu: ok")
