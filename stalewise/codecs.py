"""Codecs: how an update is encoded on the wire (``sw.codecs``).

A codec turns a float vector into raw bytes (never a pickle: docs/codecs.md) and back, each
class stating its error bound; a bad payload raises :class:`PayloadError`.

Example:
    >>> x = np.array([0.5, -2.0, 0.25, 3.0], np.float32)
    >>> c = topk(0.5)
    >>> payload = c.encode(x)
    >>> len(payload) == c.nbytes(4), c.decode(payload).tolist()
    (True, [0.0, -2.0, 0.0, 3.0])
    >>> parse("int8"), parse("int4"), parse("topk:0.01")
    (int8(), int4(), topk(0.01))
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import numpy as np

from stalewise._lazy import Lazy

kernels = Lazy("stalewise._codec_kernels")  # numba: imported at the first encode

__all__ = ["SMALL_LEAF", "Codec", "PayloadError", "Policy", "SizeAdaptive"]
__all__ += ["as_bytes", "bf16", "fp16", "int4", "int8", "none", "parse", "sign"]
__all__ += ["size_adaptive", "topk"]

SMALL_LEAF = 512  #: Leaves with fewer elements travel uncompressed under a plain codec.

HEADER = struct.Struct("<BBBBQ")  # magic, codec id, values dtype, parameter, n
MAGIC = 0xC5
_DTYPES = {0: np.dtype(np.float32), 1: np.dtype(np.float64)}
_CODES = {v: k for k, v in _DTYPES.items()}


class PayloadError(ValueError):
    """A payload that cannot be decoded: corrupt, truncated, or made by another codec."""


class Policy:
    """Chooses the codec of each leaf: what ``sw.Job(codec=...)`` takes."""

    def for_leaf(self, size: int) -> Codec:
        """The codec of a leaf of ``size`` elements."""
        raise NotImplementedError


class Codec(Policy):
    """A wire codec; see the module docstring. Subclasses set ``name``, ``id`` and the body."""

    name: ClassVar[str] = "codec"
    id: ClassVar[int] = -1
    lossless: ClassVar[bool] = False
    error_feedback: bool = False  # keep what the codec drops on the worker and send it later

    def for_leaf(self, size: int) -> Codec:
        """Itself, or ``none()`` for a leaf of fewer than :data:`SMALL_LEAF` elements."""
        return NONE if size < SMALL_LEAF and not self.lossless else self

    def nbytes(self, n: int, dtype: Any = np.float32) -> int:
        """The exact length of the payload of ``n`` values (``dtype`` matters to ``none`` only)."""
        return HEADER.size + self._body_nbytes(int(n), np.dtype(dtype))

    def _body_nbytes(self, n: int, dtype: np.dtype) -> int:
        raise NotImplementedError

    def _param(self, n: int) -> int:
        return 0

    def encode(self, x: np.ndarray) -> bytearray:
        """The payload of the 1-D float vector ``x``."""
        x = _vector(x)
        buf = bytearray(self.nbytes(x.size, x.dtype))
        self.encode_into(x, buf)
        return buf

    def encode_into(self, x: np.ndarray, buf: Any) -> None:
        """Writes the payload of ``x`` into ``buf``, of exactly ``nbytes(x.size, x.dtype)`` bytes."""
        x = _vector(x)
        mv = memoryview(buf).cast("B")
        if len(mv) != self.nbytes(x.size, x.dtype):
            raise ValueError(
                f"{self!r}: buffer of {len(mv)} bytes for a payload of "
                f"{self.nbytes(x.size, x.dtype)}"
            )
        dtype = x.dtype if self.lossless else np.dtype(np.float32)
        HEADER.pack_into(mv, 0, MAGIC, self.id, _CODES[dtype], self._param(x.size), x.size)
        self._encode_body(_values(x, dtype, self), mv[HEADER.size :])

    def _encode_body(self, x: np.ndarray, body: memoryview) -> None:
        raise NotImplementedError

    def decode(self, payload: Any, out: np.ndarray | None = None) -> np.ndarray:
        """A payload's values (into ``out`` if given); PayloadError if not one this codec made."""
        mv = as_bytes(payload)
        n = _peek_n(mv, 0)  # a whole header: its dtype code is mv[2]
        if out is None:
            out = np.empty(n, _DTYPES.get(mv[2], np.dtype(np.float32)))
        end = self.decode_at(mv, 0, out)
        if end != len(mv):
            raise PayloadError(
                f"{self!r}: payload of {len(mv)} bytes, expected {end} for n={n} "
                f"({len(mv) - end} bytes too many)"
            )
        return out

    def decode_at(self, buf: memoryview, offset: int, out: np.ndarray, where: str = "") -> int:
        """Decodes the payload at ``offset`` of ``buf`` into ``out``; returns where it ends."""
        where = where or repr(self)
        if len(buf) - offset < HEADER.size:
            raise PayloadError(
                f"{where}: truncated: {len(buf) - offset} bytes left, a header needs {HEADER.size}"
            )
        magic, cid, code, param, n = HEADER.unpack_from(buf, offset)
        if magic != MAGIC:
            raise PayloadError(f"{where}: not a codec payload (magic byte {magic:#04x})")
        if cid != self.id:
            other = _BY_ID.get(cid, f"unknown codec id {cid}")
            raise PayloadError(f"{where}: payload encoded by {other}, expected {self!r}")
        if n != out.size:
            raise PayloadError(f"{where}: payload holds {n} values, expected {out.size}")
        dtype = _DTYPES.get(code)
        if dtype is None or (dtype != np.float32 and not self.lossless):
            raise PayloadError(f"{where}: bad dtype code {code} in the header")
        if param != self._param(n):
            raise PayloadError(f"{where}: header parameter {param}, expected {self._param(n)}")
        end = offset + self.nbytes(n, dtype)
        if end > len(buf):
            raise PayloadError(
                f"{where}: truncated: {len(buf) - offset} bytes, the payload of n={n} has "
                f"{end - offset}"
            )
        self._decode_body(buf[offset + HEADER.size : end], n, dtype, out, where)
        return end

    def _decode_body(
        self, body: memoryview, n: int, dtype: np.dtype, out: np.ndarray, where: str
    ) -> None:
        raise NotImplementedError

    def subtract_decoded(
        self, payload: Any, r: np.ndarray, scratch: np.ndarray | None = None
    ) -> None:
        """``r -= decode(payload)`` (error feedback), decoding into ``scratch`` when given."""
        r -= self.decode(payload, np.empty_like(r) if scratch is None else scratch)

    def __repr__(self) -> str:
        args = [f"{f.name}={v}" for f in fields(self) if (v := getattr(self, f.name)) != f.default]
        return f"{self.name}({', '.join(args)})"


@dataclass(frozen=True, repr=False)
class NoCodec(Codec):
    """No compression: the raw values (float32 or float64). Exact."""

    name: ClassVar[str] = "none"
    id: ClassVar[int] = 0
    lossless: ClassVar[bool] = True

    def _body_nbytes(self, n: int, dtype: np.dtype) -> int:
        return n * dtype.itemsize

    def _encode_body(self, x: np.ndarray, body: memoryview) -> None:
        np.frombuffer(body, x.dtype, x.size)[:] = x

    def _decode_body(self, body, n, dtype, out, where):  # type: ignore[no-untyped-def]
        if out.dtype != dtype:
            raise PayloadError(f"{where}: payload holds {dtype.name}, expected {out.dtype.name}")
        out[:] = np.frombuffer(body, dtype, n)


@dataclass(frozen=True, repr=False)
class _Half(Codec):
    """A 16-bit float per value, its bits written by ``{name}_encode`` and ``_decode``."""

    error_feedback: bool = False

    def _body_nbytes(self, n: int, dtype: np.dtype) -> int:
        return 2 * n

    def _encode_body(self, x: np.ndarray, body: memoryview) -> None:
        getattr(kernels, f"{self.name}_encode")(x, np.frombuffer(body, np.int16, x.size))

    def _decode_body(self, body, n, dtype, out, where):  # type: ignore[no-untyped-def]
        _into(out, getattr(kernels, f"{self.name}_decode"), np.frombuffer(body, np.int16, n))


@dataclass(frozen=True, repr=False)
class FP16(_Half):
    """IEEE fp16 clamped to +-65504; within it ``|d - x| <= max(2**-11 |x|, 2**-25)``."""

    name: ClassVar[str] = "fp16"
    id: ClassVar[int] = 1


@dataclass(frozen=True, repr=False)
class BF16(_Half):
    """bfloat16, clamped to +-3.3895e38. Bound: ``|d - x| <= max(2**-8 |x|, 2**-134)``."""

    name: ClassVar[str] = "bf16"
    id: ClassVar[int] = 2


class _Blocks(Codec):
    """A codec of blocks of ``block`` values (a power of two, sent as its log2)."""

    block: int
    code: ClassVar[type]

    def __post_init__(self) -> None:
        b = self.block
        if not _is_int(b) or b < 1 or b > 2**30 or b & (b - 1):
            raise ValueError(f"{self.name}: block must be a power of two in 1..2**30, got {b!r}")

    def _param(self, n: int) -> int:
        return self.block.bit_length() - 1

    def _body_nbytes(self, n: int, dtype: np.dtype) -> int:
        return self._codes(n) + 4 * -(-n // self.block)

    def _codes(self, n: int) -> int:
        return n if self.code is np.int8 else -(-n // 2)

    def _split(self, body: memoryview, n: int) -> tuple[np.ndarray, np.ndarray]:
        blocks = -(-n // self.block)
        return np.frombuffer(body, np.float32, blocks), np.frombuffer(
            body, self.code, self._codes(n), 4 * blocks
        )

    def _encode_body(self, x: np.ndarray, body: memoryview) -> None:
        scales, codes = self._split(body, x.size)
        getattr(kernels, f"{self.name}_encode")(x, self.block, codes, scales)


@dataclass(frozen=True, repr=False)
class Int8(_Blocks):
    """Blockwise int8: per ``block`` values, codes in ``[-127, 127]`` and a float32 scale
    (absmax / 127). Bound: ``|d - x| <= absmax(block) / 254 * (1 + 1e-4)``, plus ``2**-143``
    where absmax < ``2**-119`` (a subnormal scale). A non-finite block decodes to NaN."""

    name: ClassVar[str] = "int8"
    id: ClassVar[int] = 3
    block: int = 4096
    error_feedback: bool = False
    code: ClassVar[type] = np.int8

    def _decode_body(self, body, n, dtype, out, where):  # type: ignore[no-untyped-def]
        scales, q = self._split(body, n)
        _into(out, kernels.int8_decode, q, scales, self.block)


@dataclass(frozen=True, repr=False)
class Int4(_Blocks):
    """Blockwise 4-bit: per ``block`` values, levels ``q`` in ``[-7, 7]`` two a byte and a float32
    scale (absmax / 7), decoded ``q * scale``; level -8 is refused as corrupt. Bound:
    ``|d - x| <= absmax(block) / 14 * (1 + 1e-4)``, plus ``2**-146`` where absmax < ``2**-119``;
    zero and values on the grid round-trip exactly (docs/codecs.md). A non-finite block: NaN."""

    name: ClassVar[str] = "int4"
    id: ClassVar[int] = 6
    block: int = 256
    error_feedback: bool = False
    code: ClassVar[type] = np.uint8  # two values a byte

    def _decode_body(self, body, n, dtype, out, where):  # type: ignore[no-untyped-def]
        scales, packed = self._split(body, n)
        bad = _into(out, kernels.int4_decode, packed, scales, self.block, n)
        if bad:
            raise PayloadError(
                f"{where}: {bad} invalid 4-bit codes (level -8 or a non-zero padding "
                "nibble): corrupt payload"
            )


@dataclass(frozen=True, repr=False)
class TopK(Codec):
    """The ``k = max(1, round(fraction * n))`` values of largest magnitude, NaNs always kept, as
    indices and float32 values. Bound: ``x_i`` or 0 each, no dropped ``|x_i|`` above a kept one."""

    name: ClassVar[str] = "topk"
    id: ClassVar[int] = 4
    fraction: float = 0.01
    error_feedback: bool = True

    def __post_init__(self) -> None:
        f = self.fraction
        ok = isinstance(f, int | float) and not isinstance(f, bool) and 0 < f <= 1
        if not ok:
            raise ValueError(f"topk: fraction must be a number in (0, 1], got {f!r}")

    def k(self, n: int) -> int:
        return min(n, max(1, round(self.fraction * n)))

    def _body_nbytes(self, n: int, dtype: np.dtype) -> int:
        return self.k(n) * (4 + index_dtype(n).itemsize)

    def _param(self, n: int) -> int:
        return index_dtype(n).itemsize

    def _encode_body(self, x: np.ndarray, body: memoryview) -> None:
        n, k = x.size, self.k(x.size)
        top = kernels.top_indices(x, k)
        idx = np.frombuffer(body, index_dtype(n), k)
        idx[:] = top
        np.frombuffer(body, np.float32, k, k * idx.itemsize)[:] = x[top]

    def _decode_body(self, body, n, dtype, out, where):  # type: ignore[no-untyped-def]
        k = self.k(n)
        idx = np.frombuffer(body, index_dtype(n), k)
        if k and (idx[-1] >= n or (k > 1 and not (idx[1:] > idx[:-1]).all())):
            raise PayloadError(f"{where}: indices out of order or beyond n={n}: corrupt payload")
        out.fill(0)
        out[idx] = np.frombuffer(body, np.float32, k, k * idx.itemsize)

    def subtract_decoded(
        self, payload: Any, r: np.ndarray, scratch: np.ndarray | None = None
    ) -> None:
        mv = as_bytes(payload)  # sparse: subtracts the k kept values in place, no scratch
        n = _peek_n(mv, 0)
        k = self.k(n)
        idx = np.frombuffer(mv, index_dtype(n), k, HEADER.size)
        r[idx] -= np.frombuffer(mv, np.float32, k, HEADER.size + k * idx.itemsize)

    def __repr__(self) -> str:
        ef = "" if self.error_feedback else ", error_feedback=False"
        return f"topk({self.fraction!r}{ef})"


@dataclass(frozen=True, repr=False)
class Sign(Codec):
    """Scaled sign: a bit per value (``np.packbits`` order) and a float32 scale, the mean of
    ``|x|``; decoded ``+-scale`` (``+0.0``: ``+scale``). Bound: the signs are kept and
    ``sum |d| == sum |x|`` (to float32 rounding); any NaN or infinity: all non-finite."""

    name: ClassVar[str] = "sign"
    id: ClassVar[int] = 5
    error_feedback: bool = True

    def _body_nbytes(self, n: int, dtype: np.dtype) -> int:
        return 4 + -(-n // 8)

    def _encode_body(self, x: np.ndarray, body: memoryview) -> None:
        total = kernels.sign_encode(x, np.frombuffer(body, np.uint8, -(-x.size // 8), 4))
        np.frombuffer(body, np.float32, 1)[0] = total / max(x.size, 1)  # NaN and inf stay

    def _decode_body(self, body, n, dtype, out, where):  # type: ignore[no-untyped-def]
        scale = np.frombuffer(body, np.float32, 1)[0]
        packed = np.frombuffer(body, np.uint8, -(-n // 8), 4)
        _into(out, kernels.sign_decode, packed, n, scale)


@dataclass(frozen=True)
class SizeAdaptive(Policy):
    """``small`` for leaves of fewer than ``threshold`` elements, ``large`` for the others."""

    threshold: int
    small: Codec
    large: Codec

    def __post_init__(self) -> None:
        t = self.threshold
        if not _is_int(t) or t < 0:
            raise ValueError(f"size_adaptive: threshold must be an integer >= 0, got {t!r}")
        for name in ("small", "large"):
            value = getattr(self, name)
            if not isinstance(value, Codec):
                raise TypeError(
                    f"size_adaptive: {name} must be a codec (e.g. sw.codecs.topk(0.01)), "
                    f"got {value!r}"
                )

    def for_leaf(self, size: int) -> Codec:
        return self.small if size < self.threshold else self.large

    def __repr__(self) -> str:
        return f"size_adaptive({self.threshold}, small={self.small!r}, large={self.large!r})"


NONE = NoCodec()


def none() -> Codec:
    """No compression (the default)."""
    return NONE


def fp16(*, error_feedback: bool = False) -> Codec:
    """IEEE half precision, clamped to +-65504 (2 bytes a value)."""
    return FP16(_flag(error_feedback))


def bf16(*, error_feedback: bool = False) -> Codec:
    """bfloat16 (2 bytes a value, float32's range)."""
    return BF16(_flag(error_feedback))


def int8(block: int = 4096, *, error_feedback: bool = False) -> Codec:
    """Blockwise int8 with one float32 absmax scale per ``block`` values (~1 byte a value)."""
    return Int8(block, _flag(error_feedback))


def int4(block: int = 256, *, error_feedback: bool = False) -> Codec:
    """Blockwise 4-bit (~0.52 byte a value with the default block): see :class:`Int4`."""
    return Int4(block, _flag(error_feedback))


def topk(fraction: float, *, error_feedback: bool = True) -> Codec:
    """The ``fraction`` of values of largest magnitude, with their indices."""
    return TopK(fraction, _flag(error_feedback))


def sign(*, error_feedback: bool = True) -> Codec:
    """Scaled sign, 1 bit a value."""
    return Sign(_flag(error_feedback))


def size_adaptive(threshold: int, *, small: Codec = NONE, large: Codec) -> Policy:
    """``small`` for leaves of fewer than ``threshold`` elements, ``large`` for the rest.

    Example:
        >>> p = size_adaptive(1000, large=topk(0.01))
        >>> p.for_leaf(64), p.for_leaf(4096)
        (none(), topk(0.01))
    """
    return SizeAdaptive(threshold, small, large)


_MAKERS = {"none": none, "fp16": fp16, "bf16": bf16, "int8": int8, "int4": int4}
_MAKERS |= {"topk": topk, "sign": sign}
_BY_ID = {c.id: c.name for c in (NoCodec, FP16, BF16, Int8, Int4, TopK, Sign)}
NAMES = (*_MAKERS, "size_adaptive")


def parse(spec: Any) -> Policy:
    """A codec from a config value: ``"int8"``, ``"topk:0.01"``, or a table such as
    ``{"name": "size_adaptive", "threshold": 4096, "large": "topk:0.01"}``; else ValueError."""
    if isinstance(spec, Policy):
        return spec
    if isinstance(spec, str):
        name, _, arg = spec.partition(":")
        name = name.strip()
        if name == "size_adaptive":
            raise ValueError(
                "size_adaptive needs a table, e.g. "
                "{ name = 'size_adaptive', threshold = 4096, large = 'topk:0.01' }"
            )
        if name not in _MAKERS:
            raise ValueError(f"unknown codec {name!r} (known: {', '.join(NAMES)})")
        if name == "topk":
            try:
                fraction = float(arg)
            except ValueError:
                raise ValueError(
                    f"topk needs its fraction, as in 'topk:0.01', got {spec!r}"
                ) from None
            return topk(fraction)
        if arg:
            raise ValueError(f"codec {name!r} takes no ':' argument, got {spec!r}")
        return _MAKERS[name]()
    if isinstance(spec, Mapping):
        table = dict(spec)
        name = table.pop("name", None)
        if name not in NAMES:
            raise ValueError(f"unknown codec {name!r} (known: {', '.join(NAMES)})")
        if name == "size_adaptive":
            for key in ("small", "large"):
                if key in table:  # SizeAdaptive refuses a policy that is not a codec
                    table[key] = parse(table[key])
        maker = size_adaptive if name == "size_adaptive" else _MAKERS[name]
        try:
            return maker(**table)
        except TypeError as e:
            raise ValueError(f"codec {name!r}: {e}") from None
    raise ValueError(f"expected a codec name such as 'int8' or 'topk:0.01', got {spec!r}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def _flag(x: Any) -> bool:
    if not isinstance(x, bool):
        raise ValueError(f"error_feedback must be True or False, got {x!r}")
    return x


def _vector(x: Any) -> np.ndarray:
    if not isinstance(x, np.ndarray) or x.ndim != 1 or x.dtype not in _CODES:
        got = f"a {x.ndim}-D {x.dtype} array" if isinstance(x, np.ndarray) else type(x).__name__
        raise ValueError(f"expected a 1-D float32 or float64 array, got {got}")
    return np.ascontiguousarray(x)


def _values(x: np.ndarray, dtype: np.dtype, codec: Codec) -> np.ndarray:
    """``x`` in the dtype the codec encodes (float64 is rounded to float32 by lossy ones)."""
    if x.dtype == dtype:
        return x
    with np.errstate(over="ignore"):  # beyond float32: infinite, refused downstream
        if isinstance(codec, FP16):  # clamp first, so that float64 values clamp alike
            finite = np.isfinite(x)
            x = np.where(finite, np.clip(x, -65504.0, 65504.0), x)
        return x.astype(dtype)


def as_bytes(payload: Any) -> memoryview:
    """A payload as a flat memoryview of bytes (no copy); PayloadError if it is not bytes."""
    try:
        mv = memoryview(payload)
    except TypeError:
        raise PayloadError(f"a payload must be bytes, got {type(payload).__name__}") from None
    if not mv.c_contiguous:
        raise PayloadError("a payload must be one contiguous block of bytes")
    return mv.cast("B")


def _peek_n(mv: memoryview, offset: int) -> int:
    if len(mv) - offset < HEADER.size:
        raise PayloadError(
            f"truncated: {len(mv) - offset} bytes left, a header needs {HEADER.size}"
        )
    return int(HEADER.unpack_from(mv, offset)[4])


def _into(out: np.ndarray, kernel: Any, *args: Any) -> Any:
    """Runs a decoding kernel into ``out``, through a float32 temporary when needed; its result."""
    if out.dtype == np.float32 and out.flags.c_contiguous:
        return kernel(*args, out)
    tmp = np.empty(out.size, np.float32)
    result = kernel(*args, tmp)
    out[:] = tmp
    return result


@functools.lru_cache(maxsize=256)
def index_dtype(n: int) -> np.dtype:
    """The narrowest unsigned integer type that holds the indices of ``n`` values."""
    for dt in (np.uint8, np.uint16, np.uint32):
        if n - 1 <= np.iinfo(dt).max:
            return np.dtype(dt)
    return np.dtype(np.uint64)
