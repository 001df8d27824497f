"""Compressed pushes: a whole flat update -> one payload per shard (its *pieces*, docs/codecs.md
"Wire format"; all-zero pieces left out: :data:`SEGMENTS`), and back. :class:`Compressor` encodes
(the worker side, with error feedback), :class:`Decoder` decodes and checks (the shard side).

Example:
    >>> seg = Segments.from_sizes(["b", "w"], [4, 1000])
    >>> comp = Compressor(codecs.topk(0.01), seg, [(0, 504), (504, 1004)])
    >>> [p.codec for p in comp.pieces[0]]   # the 4-value leaf travels uncompressed
    [none(), topk(0.01)]
    >>> g = np.arange(1004, dtype=np.float32)
    >>> payloads, state = comp.encode(g)
    >>> [len(p) for p in payloads] == [comp.nbytes(0), comp.nbytes(1)]
    True
    >>> comp.decoder(1).decode(payloads[1])[-6:].tolist()  # 1% of the 500 values of w here
    [0.0, 999.0, 1000.0, 1001.0, 1002.0, 1003.0]
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from stalewise import codecs
from stalewise.codecs import PayloadError
from stalewise.protocol import commit
from stalewise.segments import Segments

__all__ = ["Compressor", "Decoder", "Feedback", "PayloadError", "Piece", "is_identity"]

log = logging.getLogger(__name__)

SEGMENTS = struct.Struct("<BBHII")  # magic, 0, 0, pieces sent, the payload's length in bytes
SEGMENT_MAGIC = 0xE5
_INDEX = np.dtype("<u4")


def segment_nbytes(sizes: Sequence[int]) -> int:
    """The length of a segment payload holding codec payloads of ``sizes`` bytes."""
    return SEGMENTS.size + _INDEX.itemsize * len(sizes) + sum(sizes)


class Piece(NamedTuple):
    """The part of one leaf inside one shard's range, and how it travels."""

    name: str  # the leaf's dotted name
    start: int  # offset in the flat vector
    stop: int
    codec: codecs.Codec


@dataclass
class Feedback:
    """A worker's error-feedback state: ``residual``, a flat vector (zero where none is kept)."""

    residual: np.ndarray


def is_identity(policy: codecs.Policy) -> bool:
    """True when ``policy`` sends every leaf as it is (``none()``): no payloads needed."""
    return isinstance(policy, codecs.NoCodec) or (
        isinstance(policy, codecs.SizeAdaptive)
        and all(isinstance(c, codecs.NoCodec) for c in (policy.small, policy.large))
    )


def plan(
    policy: codecs.Policy,
    segments: Segments,
    ranges: Sequence[tuple[int, int]],
    exact: Collection[str] = (),
) -> list[list[Piece]]:
    """The pieces of each shard's range, each with its leaf's codec (``exact`` ones: ``none()``)."""
    if not isinstance(policy, codecs.Policy):
        raise TypeError(f"codec must be a codec (e.g. sw.codecs.topk(0.01)), got {policy!r}")
    ends = segments.offsets + segments.sizes
    out = []
    for lo, hi in ranges:
        if not 0 <= lo <= hi <= segments.total:
            raise ValueError(f"shard range [{lo}, {hi}) outside [0, {segments.total})")
        pieces = []
        for i in np.flatnonzero((ends > lo) & (segments.offsets < hi) & (segments.sizes > 0)):
            start, stop = max(int(segments.offsets[i]), lo), min(int(ends[i]), hi)
            name = segments.names[i]
            leaf = codecs.NONE if name in exact else policy.for_leaf(int(segments.sizes[i]))
            pieces.append(Piece(name, start, stop, leaf))
        out.append(pieces)
    return out


def warm_up(pieces: Sequence[Piece]) -> None:
    """Runs each codec of ``pieces`` once, so that its kernels load before the first push."""
    x = np.linspace(-1.0, 1.0, 1 << 16, dtype=np.float32)
    for codec in {p.codec for p in pieces}:
        payload = codec.encode(x)
        codec.decode(payload, np.empty_like(x))
        codec.subtract_decoded(payload, x.copy())


class Decoder:
    """Decodes shard ``shard``'s payloads (``pieces``: :func:`plan`) into its slice at ``start``."""

    def __init__(self, pieces: Sequence[Piece], start: int, shard: int = 0):
        self.pieces = list(pieces)
        self.start, self.shard = start, shard
        self.size = sum(p.stop - p.start for p in self.pieces)

    @classmethod
    def for_shard(
        cls,
        policy: codecs.Policy,
        segments: Segments,
        ranges: Sequence[tuple[int, int]],
        k: int,
        exact: Collection[str] = (),
    ) -> Decoder:
        """The decoder of shard ``k`` of a job, as :meth:`ServerConfig.build_shard` makes it."""
        lo, hi = ranges[k]
        return cls(plan(policy, segments, [(lo, hi)], exact)[0], lo, k)

    def warm_up(self) -> None:
        """Loads this shard's codecs' kernels (:func:`warm_up`)."""
        warm_up(self.pieces)

    def nbytes(self, dtype: Any = np.float32) -> int:
        """The exact length of this shard's payload for a flat vector of ``dtype``."""
        return sum(p.codec.nbytes(p.stop - p.start, dtype) for p in self.pieces)

    def decode(self, payload: Any, out: np.ndarray | None = None) -> np.ndarray:
        """The shard's slice of the update, written into ``out`` (its length) when given;
        PayloadError (corrupt, truncated or foreign) names the shard and the leaf."""
        try:
            mv = codecs.as_bytes(payload)
        except PayloadError as e:
            raise PayloadError(f"shard {self.shard}: {e}") from None
        if out is None:
            out = np.empty(self.size, np.float32)
        elif out.shape != (self.size,):
            raise ValueError(f"shard {self.shard}: out of shape {out.shape}, not ({self.size},)")
        sent, offset, length = self._segments(mv)
        if sent is not None:
            out.fill(0)
        for i in range(len(self.pieces)) if sent is None else sent:
            p = self.pieces[i]
            where = f"shard {self.shard}, leaf {p.name!r} ({p.codec!r})"
            lo, hi = p.start - self.start, p.stop - self.start
            offset = p.codec.decode_at(mv, offset, out[lo:hi], where)
        if offset != length:
            raise PayloadError(
                f"shard {self.shard}: payload of {length} bytes, expected {offset} "
                f"({length - offset} bytes too many)"
            )
        return out

    def length(self, payload: Any) -> int:
        """The bytes of ``payload`` carrying the push (a segment payload may be in a longer one)."""
        mv = codecs.as_bytes(payload)
        if len(mv) >= SEGMENTS.size and mv[0] == SEGMENT_MAGIC:
            return min(SEGMENTS.unpack_from(mv)[4], len(mv))
        return len(mv)

    def _segments(self, mv: memoryview) -> tuple[list[int] | None, int, int]:
        """A segment payload's ``(pieces sent, their start, length)``; dense: ``(None, 0, len)``."""
        if not len(mv) or mv[0] != SEGMENT_MAGIC:
            return None, 0, len(mv)
        if len(mv) < SEGMENTS.size:
            raise PayloadError(f"shard {self.shard}: a segment header cut at {len(mv)} bytes")
        _, _, _, count, length = SEGMENTS.unpack_from(mv)
        start = SEGMENTS.size + _INDEX.itemsize * count
        if count > len(self.pieces) or not start <= length <= len(mv):
            raise PayloadError(
                f"shard {self.shard}: a segment payload of {count} pieces and {length} bytes "
                f"(this shard has {len(self.pieces)} pieces, the buffer {len(mv)} bytes)"
            )
        sent = np.frombuffer(mv, _INDEX, count, SEGMENTS.size).tolist()
        if np.any(np.diff(sent) <= 0) or (sent and sent[-1] >= len(self.pieces)):
            raise PayloadError(
                f"shard {self.shard}: segment piece indices {sent[:8]} are not increasing "
                f"indices of its {len(self.pieces)} pieces"
            )
        return sent, start, length


class Compressor:
    """Encodes whole flat updates into one payload per shard (the worker side): ``ranges``
    are the shards' ``[start, stop)``; ``exact`` leaves go as ``none()`` (:func:`plan`)."""

    def __init__(
        self,
        policy: codecs.Policy,
        segments: Segments,
        ranges: Sequence[tuple[int, int]],
        exact: Collection[str] = (),
    ):
        self.policy = policy
        self.ranges = [(int(lo), int(hi)) for lo, hi in ranges]
        self.size = segments.total
        self.pieces = plan(policy, segments, self.ranges, frozenset(exact))
        self.decoders = [
            Decoder(p, r[0], k)
            for k, (p, r) in enumerate(zip(self.pieces, self.ranges, strict=True))
        ]
        self.error_feedback = any(p.codec.error_feedback for ps in self.pieces for p in ps)
        self._scratch_buf: np.ndarray | None = None  # error feedback decodes into it
        # per shard, the pieces the last encoded push sent (None: all, a dense payload)
        self.sent: list[list[int] | None] = [None] * len(self.ranges)

    def decoder(self, k: int) -> Decoder:
        return self.decoders[k]

    def warm_up(self) -> None:
        """Loads every codec's kernels (:func:`warm_up`), e.g. in a new worker process."""
        warm_up([p for pieces in self.pieces for p in pieces])

    def nbytes(self, k: int, dtype: Any = np.float32, scale: float = 1.0) -> int:
        """The exact length of shard ``k``'s payload (of a model ``scale`` times larger)."""
        return sum(
            p.codec.nbytes(max(round((p.stop - p.start) * scale), 0), dtype) for p in self.pieces[k]
        )

    def sent_nbytes(
        self, k: int, dtype: Any = np.float32, scale: float = 1.0, sent: Any = "last"
    ) -> int:
        """The length of shard ``k``'s payload of the last push, scaled as :meth:`nbytes` is."""
        sent = self.sent[k] if isinstance(sent, str) else sent
        if sent is None:
            return self.nbytes(k, dtype, scale)
        pieces = [self.pieces[k][i] for i in sent]
        n = [max(round((p.stop - p.start) * scale), 0) for p in pieces]
        return segment_nbytes([p.codec.nbytes(m, dtype) for p, m in zip(pieces, n, strict=True)])

    def decode(self, payloads: Sequence[Any], out: np.ndarray) -> np.ndarray:
        """Every shard's payload decoded into its slice of ``out`` (PayloadError names it)."""
        for k, (lo, hi) in enumerate(self.ranges):
            self.decoders[k].decode(payloads[k], out[lo:hi])
        return out

    def init(self, dtype: Any = np.float32) -> Feedback | None:
        """A worker's initial error-feedback state (None when no codec keeps feedback)."""
        return Feedback(np.zeros(self.size, dtype)) if self.error_feedback else None

    def adopt(self, residual: Any, dtype: Any = np.float32, worker: Any = None) -> Feedback | None:
        """A worker's error-feedback state from a saved residual (None: no codec keeps feedback;
        ValueError: not a vector of this job's size and ``dtype``)."""
        who = "" if worker is None else f"worker {worker}'s "
        if not isinstance(residual, np.ndarray) or residual.shape != (self.size,):
            shape = getattr(residual, "shape", type(residual).__name__)
            raise ValueError(
                f"{who}error-feedback residual has shape {shape}, this job's parameters "
                f"({self.size},)"
            )
        if residual.dtype != np.dtype(dtype):
            raise ValueError(
                f"{who}error-feedback residual is {residual.dtype}, this job's parameters "
                f"{np.dtype(dtype)}"
            )
        if not self.error_feedback:
            return None
        out = np.zeros(self.size, dtype)
        for p in (p for ps in self.pieces for p in ps if p.codec.error_feedback):
            out[p.start : p.stop] = residual[p.start : p.stop]
        return Feedback(out)

    def encode(self, flat: np.ndarray, state: Feedback | None = None) -> tuple[list, Any]:
        """Every shard's payload of ``flat``, and ``state`` (None: a fresh one) updated in place."""
        flat = self._check(flat)
        bufs = [bytearray(self.nbytes(k, flat.dtype)) for k in range(len(self.ranges))]
        return bufs, self.encode_into(flat, bufs, state)

    def encode_into(
        self,
        flat: np.ndarray,
        bufs: Sequence[Any],
        state: Feedback | None = None,
        out: Feedback | None = None,
    ) -> Feedback | None:
        """Like :meth:`encode`, into writable buffers of exactly :meth:`nbytes` bytes; ``out``:
        a second state to write the new residual into, leaving ``state`` unchanged."""
        flat = self._check(flat)
        if self.error_feedback and state is None:
            state = self.init(flat.dtype)
        for s in (state, out):
            if s is not None and s.residual.shape != flat.shape:
                raise ValueError(
                    f"error-feedback residual of shape {s.residual.shape}, update {flat.shape}"
                )
        if state is None or (out is not None and out.residual is state.residual):
            out = None  # no feedback, or in place
        # a push holding NaN/Inf will be refused by every shard: it leaves the residual as it is
        feedback = state is not None and commit.first_non_finite(flat) is None
        if state is not None and not feedback and out is not None:
            np.copyto(out.residual, state.residual)  # out holds the residual, unchanged
            state, out = out, None
        for k, pieces in enumerate(self.pieces):
            mv = memoryview(bufs[k]).cast("B")
            if len(mv) != self.nbytes(k, flat.dtype):
                raise ValueError(
                    f"shard {k}: buffer of {len(mv)} bytes, the payload has "
                    f"{self.nbytes(k, flat.dtype)}"
                )
            sent = [i for i, p in enumerate(pieces) if flat[p.start : p.stop].any()]
            sizes = [
                pieces[i].codec.nbytes(pieces[i].stop - pieces[i].start, flat.dtype) for i in sent
            ]
            if len(sent) == len(pieces) or segment_nbytes(sizes) >= len(mv):
                sent = list(range(len(pieces)))  # dense: every piece, back to back
                self.sent[k], offset = None, 0
            else:
                self.sent[k], offset = sent, SEGMENTS.size + _INDEX.itemsize * len(sent)
                SEGMENTS.pack_into(mv, 0, SEGMENT_MAGIC, 0, 0, len(sent), segment_nbytes(sizes))
                mv[SEGMENTS.size : offset] = np.asarray(sent, _INDEX).tobytes()
            if out is not None and feedback:  # a piece not sent keeps its residual
                for i in sorted(set(range(len(pieces))) - set(sent)):
                    p = pieces[i]
                    if p.codec.error_feedback:
                        out.residual[p.start : p.stop] = state.residual[p.start : p.stop]
            for i in sent:
                p = pieces[i]
                n = p.stop - p.start
                end = offset + p.codec.nbytes(n, flat.dtype)
                dst = mv[offset:end]
                g = flat[p.start : p.stop]
                if p.codec.error_feedback and feedback:
                    e = state.residual[p.start : p.stop]
                    if out is None:
                        e += g  # p = g + e, in the residual's buffer
                    else:
                        e = np.add(e, g, out=out.residual[p.start : p.stop])  # p, in out's
                    p.codec.encode_into(e, dst)
                    p.codec.subtract_decoded(dst, e, self._scratch(n, e.dtype))  # e = p - C(p)
                else:
                    p.codec.encode_into(g, dst)
                offset = end
        return state if out is None else out

    def _scratch(self, n: int, dtype: Any) -> np.ndarray:
        """A buffer of ``n`` values to decode into, kept from push to push."""
        buf = self._scratch_buf
        if buf is None or buf.size < n or buf.dtype != dtype:
            buf = self._scratch_buf = np.empty(n, dtype)
        return buf[:n]

    def _check(self, flat: Any) -> np.ndarray:
        if not isinstance(flat, np.ndarray) or flat.shape != (self.size,):
            shape = getattr(flat, "shape", type(flat).__name__)
            raise ValueError(f"expected a flat update of shape ({self.size},), got {shape}")
        if flat.dtype not in (np.float32, np.float64):
            raise ValueError(f"expected a float32 or float64 update, got {flat.dtype}")
        return flat
