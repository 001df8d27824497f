"""Numba kernels behind :mod:`stalewise.codecs`, one pass over memory each, and the O(n)
top-k selection (:func:`top_indices`); why: docs/codecs.md. Inputs are 1-D float32, 16-bit
codes int16 bit patterns; no kernel allocates, raises or warns (NaN travels as a value)."""

from __future__ import annotations

import functools
import math

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

_jit = numba.njit(cache=True, nogil=True, error_model="numpy")

I32 = np.int32
F32 = np.float32


@intrinsic
def bits(typingctx, x):  # type: ignore[no-untyped-def]
    """The int32 bit pattern of a float32 (an LLVM bitcast)."""
    sig = types.int32(types.float32)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@intrinsic
def from_bits(typingctx, x):  # type: ignore[no-untyped-def]
    """The float32 whose bit pattern is an int32 (an LLVM bitcast)."""
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@_jit
def fp16_encode(x, out):  # type: ignore[no-untyped-def]
    """float32 -> float16 bits, rounding to nearest even; finite values beyond the
    float16 range become +-65504, infinities stay infinite and NaN stays NaN."""
    for i in range(x.size):
        v = bits(x[i])
        sign = (v >> I32(16)) & I32(0x8000)
        a = v & I32(0x7FFFFFFF)
        normal = (a - I32(0x38000000) + I32(0xFFF) + ((a >> I32(13)) & I32(1))) >> I32(13)
        subnormal = I32(np.rint(abs(x[i]) * F32(16777216.0)))  # units of 2**-24, exact
        r = normal if a >= I32(0x38800000) else subnormal
        r = I32(0x7BFF) if a >= I32(0x477FF000) else r  # would round to 65536 or more
        r = I32(0x7C00) if a == I32(0x7F800000) else r
        r = I32(0x7E00) if a > I32(0x7F800000) else r
        out[i] = np.int16(r | sign)


@_jit
def fp16_decode(h, out):  # type: ignore[no-untyped-def]
    """float16 bits -> float32 (exact)."""
    for i in range(h.size):
        v = I32(h[i])
        o = (v & I32(0x7FFF)) << I32(13)
        e = o & I32(0x0F800000)
        o = o + I32(0x38000000)
        o = o + (I32(0x38000000) if e == I32(0x0F800000) else I32(0))  # infinity, NaN
        # a subnormal half: renormalise through one float subtraction of 2**-14
        sub = bits(from_bits(o + I32(0x00800000)) - F32(6.103515625e-05))
        o = sub if e == I32(0) else o
        out[i] = from_bits(o | ((v & I32(0x8000)) << I32(16)))


@_jit
def bf16_encode(x, out):  # type: ignore[no-untyped-def]
    """float32 -> bfloat16 bits, rounding to nearest even; finite values that would
    round to infinity become +-3.3895e38, infinities stay infinite and NaN stays NaN."""
    for i in range(x.size):
        v = bits(x[i])
        a = v & I32(0x7FFFFFFF)
        r = (a + I32(0x7FFF) + ((a >> I32(16)) & I32(1))) >> I32(16)
        r = I32(0x7F7F) if a >= I32(0x7F7F8000) else r
        r = I32(0x7F80) if a == I32(0x7F800000) else r
        r = I32(0x7FC0) if a > I32(0x7F800000) else r
        out[i] = np.int16(r | ((v >> I32(16)) & I32(0x8000)))


@_jit
def bf16_decode(h, out):  # type: ignore[no-untyped-def]
    """bfloat16 bits -> float32 (exact)."""
    for i in range(h.size):
        out[i] = from_bits(I32(h[i]) << I32(16))


@_jit
def int8_encode(x, block, q, scales):  # type: ignore[no-untyped-def]
    """Blockwise absmax int8: ``scales[b] = absmax / 127`` (a maximum over the bits, which
    vectorizes), ``q = rint(x / scale)``; a non-finite block gets a NaN scale, a zero one 0."""
    for b in range(scales.size):
        xs = x[b * block : min((b + 1) * block, x.size)]
        qs = q[b * block : min((b + 1) * block, x.size)]
        top = I32(0)
        for i in range(xs.size):
            v = bits(xs[i]) & I32(0x7FFFFFFF)
            top = v if v > top else top
        if top >= I32(0x7F800000) or top == I32(0):
            scales[b] = F32(np.nan) if top else F32(0.0)
            qs[:] = 0
            continue
        m = from_bits(top)
        scales[b] = m / F32(127.0)
        if m >= F32(1e-30):
            inv = F32(127.0) / m
            for i in range(xs.size):
                qs[i] = np.int8(I32(np.rint(min(max(xs[i] * inv, F32(-127.0)), F32(127.0)))))
        else:  # 127 / m would overflow float32
            inv64 = 127.0 / np.float64(m)
            for i in range(xs.size):
                r = min(max(np.float64(xs[i]) * inv64, -127.0), 127.0)
                qs[i] = np.int8(I32(np.rint(r)))


@_jit
def int8_decode(q, scales, block, out):  # type: ignore[no-untyped-def]
    """``out = q * scale`` of each block."""
    for b in range(scales.size):
        s = scales[b]
        qs = q[b * block : min((b + 1) * block, q.size)]
        os = out[b * block : min((b + 1) * block, q.size)]
        for i in range(qs.size):
            os[i] = F32(qs[i]) * s


@_jit
def int4_encode(x, block, packed, scales):  # type: ignore[no-untyped-def]
    """Blockwise absmax 4-bit: ``scales[b] = absmax / 7``, ``q = rint(x / scale)`` in ``[-7, 7]``,
    stored as the nibble ``q + 8``, value ``2i`` in the low nibble of byte ``i``, ``2i + 1`` in its
    high nibble. Non-finite and all-zero blocks as :func:`int8_encode`."""
    n = x.size
    for b in range(scales.size):
        lo, hi = b * block, min((b + 1) * block, n)
        top = I32(0)
        for i in range(lo, hi):
            v = bits(x[i]) & I32(0x7FFFFFFF)
            top = v if v > top else top
        if top >= I32(0x7F800000) or top == I32(0):
            scales[b] = F32(np.nan) if top else F32(0.0)
            for i in range(lo, hi):
                _put_nibble(packed, i, I32(8))
            continue
        m = from_bits(top)
        scales[b] = m / F32(7.0)
        if m >= F32(1e-30):
            inv = F32(7.0) / m
            for i in range(lo, hi):
                q = I32(np.rint(min(max(x[i] * inv, F32(-7.0)), F32(7.0))))
                _put_nibble(packed, i, q + I32(8))
        else:  # 7 / m would overflow float32
            inv64 = 7.0 / np.float64(m)
            for i in range(lo, hi):
                q = I32(np.rint(min(max(np.float64(x[i]) * inv64, -7.0), 7.0)))
                _put_nibble(packed, i, q + I32(8))
    if n & 1:
        packed[n >> 1] = np.uint8(I32(packed[n >> 1]) & I32(0x0F))  # the padding nibble: 0


@_jit
def _put_nibble(packed, i, code):  # type: ignore[no-untyped-def]
    j = i >> 1
    if i & 1:
        packed[j] = np.uint8((I32(packed[j]) & I32(0x0F)) | (code << I32(4)))
    else:
        packed[j] = np.uint8((I32(packed[j]) & I32(0xF0)) | code)


@_jit
def int4_decode(packed, scales, block, n, out):  # type: ignore[no-untyped-def]
    """``out = (nibble - 8) * scale`` of each block; returns how many nibbles are invalid
    (code 0, i.e. level -8, or a non-zero padding nibble): 0 for a payload it made."""
    bad = 0
    for b in range(scales.size):
        s = scales[b]
        for i in range(b * block, min((b + 1) * block, n)):
            code = (I32(packed[i >> 1]) >> I32(4 * (i & 1))) & I32(0x0F)
            bad += code == I32(0)
            out[i] = F32(code - I32(8)) * s
    if n & 1:
        bad += (I32(packed[n >> 1]) >> I32(4)) != I32(0)
    return bad


@_jit
def topk_candidates(x, t, idx):  # type: ignore[no-untyped-def]
    """Writes, in increasing order, the indices of ``|x| >= t`` and of NaNs into
    ``idx`` (as many as fit) and returns how many there are (maybe more than fit)."""
    c = 0
    cap = idx.size
    for i in range(x.size):
        if not (abs(x[i]) < t):
            if c < cap:
                idx[c] = i
            c += 1
    return c


@_jit
def sign_encode(x, out):  # type: ignore[no-untyped-def]
    """Packs the sign bits of ``x`` (most significant bit first, as ``np.packbits``)
    into ``out`` and returns ``sum |x|`` (float64, eight partial sums)."""
    n8 = x.size // 8
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0.0
    for j in range(n8):
        v = x[8 * j : 8 * j + 8]
        byte = I32(0)
        for b in range(8):
            byte |= ((bits(v[b]) >> I32(31)) & I32(1)) << I32(7 - b)
        out[j] = np.uint8(byte)
        s0 += abs(np.float64(v[0]))
        s1 += abs(np.float64(v[1]))
        s2 += abs(np.float64(v[2]))
        s3 += abs(np.float64(v[3]))
        s4 += abs(np.float64(v[4]))
        s5 += abs(np.float64(v[5]))
        s6 += abs(np.float64(v[6]))
        s7 += abs(np.float64(v[7]))
    total = ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))
    if n8 < out.size:  # the last, partial byte
        byte = I32(0)
        for i in range(8 * n8, x.size):
            byte |= ((bits(x[i]) >> I32(31)) & I32(1)) << I32(7 - (i - 8 * n8))
            total += abs(np.float64(x[i]))
        out[n8] = np.uint8(byte)
    return total


@_jit
def sign_decode(packed, n, scale, out):  # type: ignore[no-untyped-def]
    """``out[i] = -scale`` where bit ``i`` of ``packed`` is set, else ``scale``."""
    neg = -scale
    for i in range(n):
        out[i] = neg if (I32(packed[i >> 3]) >> I32(7 - (i & 7))) & I32(1) else scale


_SAMPLE = 16384  # size of the sample a top-k threshold is estimated from
_EXACT_BELOW = 4 * _SAMPLE  # vectors shorter than this are selected exactly


@functools.lru_cache(maxsize=64)
def _sample_at(n: int) -> np.ndarray:
    """A fixed pseudo-random sample of positions in ``[0, n)`` (deterministic)."""
    rng = np.random.default_rng(n)
    return np.sort(rng.integers(0, n, _SAMPLE))


def top_indices(x: np.ndarray, k: int) -> np.ndarray:
    """The indices of the ``k`` largest ``|x|`` (NaN largest), in increasing order."""
    n = x.size
    if n < _EXACT_BELOW or 8 * k > n:
        return _exact_top(x, k)
    sample = np.abs(x[_sample_at(n)])
    for want in (3 * k // 2, 8 * k):  # candidates expected; a lower threshold if too few
        above = min(_SAMPLE, math.ceil(want * _SAMPLE / n) + 16)
        t = np.partition(sample, _SAMPLE - above)[_SAMPLE - above]
        if not t > 0:  # mostly zeros (or NaN at the threshold): let the exact path decide
            break
        cand = np.empty(4 * want, np.int64)
        c = topk_candidates(x, np.float32(t), cand)
        if c > cand.size:
            break  # too many ties at the threshold
        if c >= k:
            return _exact_top_of(x, cand[:c], k)
    return _exact_top(x, k)


def _exact_top(x: np.ndarray, k: int) -> np.ndarray:
    a = np.abs(x)
    a[np.isnan(a)] = np.inf
    if k == x.size:
        return np.arange(k)
    return np.sort(np.argpartition(a, x.size - k)[x.size - k :])


def _exact_top_of(x: np.ndarray, cand: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` largest among candidate positions (increasing), kept in order."""
    a = np.abs(x[cand])
    a[np.isnan(a)] = np.inf
    if cand.size == k:
        return cand
    kth = np.partition(a, a.size - k)[a.size - k]
    keep = a > kth
    ties = np.flatnonzero(a == kth)[: k - int(keep.sum())]
    keep[ties] = True
    return cand[keep]
