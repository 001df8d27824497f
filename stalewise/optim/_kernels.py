"""Fused numba kernels behind the in-place optimizer updates, one per rule.

``g``, ``p`` and the state are 1-D, C-contiguous, of one float dtype (the caller casts the
coefficients and computes ``w1 = 1 - b1``, ``w2 = 1 - b2`` in float64); ``lr`` arrives multiplied
by ``scale``. ``into_params`` True adds the update to ``p`` (``apply``), False writes it into ``g``
(``update``), rounded alike; ``g`` may be scratch."""

from __future__ import annotations

import math

import numba
import numpy as np
from numba.extending import intrinsic

BLOCK = 1024  # elements per block of pass 1: four float32 blocks fit in L1
LANES = 64  # partial sums per norm (fewer do not vectorize)
CHECK_BLOCK = 8192  # elements per block of a checked step (32 KB of float32): checked in L1/L2
PIECE = 1 << 16  # elements per piece of a step that reports its progress (``done``)
NO_DONE = np.empty(0, np.int64)  # the ``done`` of a step that reports none

_jit = numba.njit(cache=True, nogil=True, fastmath=False, error_model="numpy")
# the finiteness flags only: reassociation lets their sums vectorize, and without the
# no-NaN/no-Inf flags x*0 stays NaN for a NaN or an Inf
_flags_jit = numba.njit(cache=True, nogil=True, fastmath={"reassoc"}, error_model="numpy")


@intrinsic
def _fence(typingctx):
    """A full memory fence: every store before it is seen before any store after it."""

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return numba.types.none(), codegen


@_jit
def _blocks(size, check, copy, done):
    """The block size of a step: whole, or in blocks to check, copy or report (``done``)."""
    return CHECK_BLOCK if check.size or copy else PIECE if done.size else max(size, 1)


@_jit
def _report(done, e):
    """``done[0] = e`` once the step's writes before it are visible (``done`` empty: none)."""
    if done.size:
        _fence()
        done[0] = e


@_jit
def _sumsq(x, lanes):
    """Sum of squares of ``x`` in float64, as ``LANES`` partial sums (``lanes``: scratch)."""
    n = x.size - x.size % LANES
    rows = x[:n].reshape((n // LANES, LANES))
    lanes[:] = 0.0
    for r in range(rows.shape[0]):
        row = rows[r]
        for k in range(LANES):
            lanes[k] += np.float64(row[k]) * row[k]
    total = 0.0
    for k in range(LANES):
        total += lanes[k]
    for i in range(n, x.size):
        total += np.float64(x[i]) * x[i]
    return total


@_jit
def sumsq(x):
    """Sum of squares of ``x``, accumulated in float64."""
    return _sumsq(x, np.empty(LANES))


@_flags_jit
def _flag(x, square):
    """The sum of ``x*x`` (``square``) or of ``x*0``, in the dtype of ``x``: NaN or Inf
    once an element is, and, squared, once the sum of squares overflows that dtype."""
    acc = x.dtype.type(0)
    zero = x.dtype.type(0)
    if square:
        for i in range(x.size):
            acc += x[i] * x[i]
    else:
        for i in range(x.size):
            acc += x[i] * zero
    return acc


@_jit
def _step(u, p, factor, into_params):
    f = p.dtype.type(factor)
    if into_params:
        for i in range(u.size):
            p[i] = p[i] + f * u[i]
    else:
        for i in range(u.size):
            u[i] = f * u[i]


@_jit
def _sgd(g, buf, p, lr, momentum, nesterov, wd, into_params):
    step = p.dtype.type(-lr)
    use_buf = momentum != 0
    for i in range(g.size):
        d = g[i] + wd * p[i]
        if use_buf:
            b = momentum * buf[i] + d
            buf[i] = b
            d = d + momentum * b if nesterov else b
        d = step * d
        if into_params:
            p[i] = p[i] + d
        else:
            g[i] = d


@_jit
def sgd(g, buf, p, offsets, sizes, decay, lr, momentum, nesterov, wd, into_params, check,
        undo_p, undo_buf, done):  # fmt: skip
    """SGD as torch.optim.SGD: ``g += wd*p; buf = momentum*buf + g; p -= lr*(g or buf)``.

    ``buf`` may be empty when ``momentum`` is zero. ``decay[s]`` False drops ``wd*p`` on leaf ``s``
    (empty ``offsets``: the whole vector decays). A non-empty ``check`` takes :func:`_checks` block
    by block, non-empty ``undo_p`` (``undo_buf``) the values before the step, and a non-empty
    ``done`` each block's end once it is written."""
    zero = p.dtype.type(0)
    use_buf = momentum != 0
    copy = undo_p.size != 0
    step = _blocks(g.size, check, copy, done)
    for b in range(0, g.size, step):
        e = min(b + step, g.size)
        if copy:
            _copy(p, undo_p, b, e)
            if use_buf:
                _copy(buf, undo_buf, b, e)
        for s in range(max(offsets.size, 1)):
            lo, hi, on = _leaf(offsets, sizes, decay, s, b, e)
            bb = buf[lo:hi] if use_buf else buf
            leaf_wd = wd if on else zero
            _sgd(g[lo:hi], bb, p[lo:hi], lr, momentum, nesterov, leaf_wd, into_params)
        if check.size:
            bb = buf[b:e] if use_buf else buf
            _checks(check, g[b:e], p[b:e], bb, bb[:0])
        _report(done, e)


@_jit
def _copy(src, dst, b, e):
    """``dst[b:e] = src[b:e]`` as a plain loop, which vectorizes (a slice may use a temporary)."""
    d, s = dst[b:e], src[b:e]
    for i in range(d.size):
        d[i] = s[i]


@_jit
def _leaf(offsets, sizes, decay, s, b, e):
    """Leaf ``s``'s part of the block ``[b, e)`` (empty: ``lo >= hi``) and whether it
    decays; without leaves (empty ``offsets``) the whole block, decaying."""
    if offsets.size == 0:
        return b, e, True
    return max(offsets[s], b), min(offsets[s] + sizes[s], e), bool(decay[s])


@_jit
def _adam(g, m, v, p, lr, b1, w1, b2, w2, inv_c1, inv_sqrt_c2, eps, l2, wd, into_params):
    step = p.dtype.type(-lr)
    for i in range(g.size):
        gi = g[i] + l2 * p[i]
        mi = b1 * m[i] + w1 * gi
        vi = b2 * v[i] + w2 * gi * gi
        m[i] = mi
        v[i] = vi
        d = step * ((mi * inv_c1) / (math.sqrt(vi) * inv_sqrt_c2 + eps) + wd * p[i])
        if into_params:
            p[i] = p[i] + d
        else:
            g[i] = d


@_jit
def adam(g, m, v, p, offsets, sizes, decay, lr, b1, w1, b2, w2, inv_c1, inv_sqrt_c2, eps,
         l2, wd, into_params, check, undo_p, undo_m, undo_v, done):  # fmt: skip
    """Adam with coupled L2 (``l2``) and decoupled decay (``wd``), as :func:`stalewise.optim.adam`
    and ``adamw`` state it (``inv_c1``, ``inv_sqrt_c2``: bias corrections); the rest as in
    :func:`sgd`."""
    zero = p.dtype.type(0)
    copy = undo_p.size != 0
    step = _blocks(g.size, check, copy, done)
    for b in range(0, g.size, step):
        e = min(b + step, g.size)
        if copy:
            _copy(p, undo_p, b, e)
            _copy(m, undo_m, b, e)
            _copy(v, undo_v, b, e)
        for s in range(max(offsets.size, 1)):
            lo, hi, on = _leaf(offsets, sizes, decay, s, b, e)
            _adam(g[lo:hi], m[lo:hi], v[lo:hi], p[lo:hi], lr, b1, w1, b2, w2, inv_c1, inv_sqrt_c2,
                  eps, l2 if on else zero, wd if on else zero, into_params)  # fmt: skip
        if check.size:
            _checks(check, g[b:e], p[b:e], m[b:e], v[b:e])
        _report(done, e)


@_jit
def _checks(check, g, p, a, b):
    """The fused checks of one block after its in-place step: ``check[0]`` sums the squares of
    ``g``, ``check[1]`` zero times each value written (``p``, ``a``, ``b``; either state block
    may be empty), each finite exactly when its values are."""
    check[0] += _flag(g, True)
    check[1] += _flag(p, False) + _flag(a, False) + _flag(b, False)


@_jit
def _lamb_direction(g, m, v, p, b1, w1, b2, w2, inv_c1, inv_sqrt_c2, eps, wd):
    """Pass 1 of LAMB on one block: update m, v and write ``u`` into ``g``."""
    for i in range(g.size):
        gi = g[i]
        mi = b1 * m[i] + w1 * gi
        vi = b2 * v[i] + w2 * gi * gi
        m[i] = mi
        v[i] = vi
        g[i] = (mi * inv_c1) / (math.sqrt(vi) * inv_sqrt_c2 + eps) + wd * p[i]


@_jit
def lamb(g, m, v, p, offsets, sizes, decay, adapt, ratios, lr, b1, w1, b2, w2, inv_c1,
         inv_sqrt_c2, eps, wd, min_ratio, max_ratio, into_params):  # fmt: skip
    """LAMB, leaf by leaf, as :func:`stalewise.optim.lamb` states it (``adapt[s]`` False: ratio
    1; ``decay[s]`` False: no ``wd*p``); each leaf's ratio is written to ``ratios[s]``."""
    zero = p.dtype.type(0)
    lanes = np.empty(LANES)
    for s in range(offsets.size):
        start = offsets[s]
        stop = start + sizes[s]
        leaf_wd = wd if decay[s] else zero
        p_sq = 0.0
        u_sq = 0.0
        for lo in range(start, stop, BLOCK):
            hi = min(lo + BLOCK, stop)
            _lamb_direction(g[lo:hi], m[lo:hi], v[lo:hi], p[lo:hi], b1, w1, b2, w2, inv_c1,
                            inv_sqrt_c2, eps, leaf_wd)  # fmt: skip
            p_sq += _sumsq(p[lo:hi], lanes)
            u_sq += _sumsq(g[lo:hi], lanes)
        r = 1.0
        if adapt[s] and p_sq > 0.0 and u_sq > 0.0:
            r = min(max(math.sqrt(p_sq) / math.sqrt(u_sq), min_ratio), max_ratio)
        ratios[s] = r
        _step(g[start:stop], p[start:stop], -lr * r, into_params)


@_jit
def lars(g, buf, p, offsets, sizes, decay, adapt, ratios, lr, momentum, wd,
         trust_coefficient, eps, into_params):  # fmt: skip
    """LARS, leaf by leaf, as :func:`stalewise.optim.lars` states it (flags as in :func:`lamb`)."""
    zero = p.dtype.type(0)
    step = p.dtype.type(-lr)
    lanes = np.empty(LANES)
    u = np.empty(BLOCK, dtype=p.dtype)
    for s in range(offsets.size):
        start = offsets[s]
        stop = start + sizes[s]
        leaf_wd = wd if decay[s] else zero
        p_sq = 0.0
        u_sq = 0.0
        for lo in range(start, stop, BLOCK):
            hi = min(lo + BLOCK, stop)
            gb, pb, ub = g[lo:hi], p[lo:hi], u[: hi - lo]
            for i in range(ub.size):
                ub[i] = gb[i] + leaf_wd * pb[i]
            p_sq += _sumsq(pb, lanes)
            u_sq += _sumsq(ub, lanes)
        r = 1.0
        if adapt[s] and p_sq > 0.0 and u_sq > 0.0:
            r = trust_coefficient * math.sqrt(p_sq) / (math.sqrt(u_sq) + eps)
        ratios[s] = r
        rr = p.dtype.type(r)
        gs, bs, ps = g[start:stop], buf[start:stop], p[start:stop]
        for i in range(gs.size):
            b = momentum * bs[i] + rr * (gs[i] + leaf_wd * ps[i])
            bs[i] = b
            if into_params:
                ps[i] = ps[i] + step * b
            else:
                gs[i] = step * b
