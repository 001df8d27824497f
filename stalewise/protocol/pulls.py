"""Delta pulls: a worker downloads what changed since its last pull, encoded with a codec.

Per worker incarnation a shard keeps a *reference*, the copy of its slice that worker holds,
and sends ``C(params - reference)`` per piece (or a :data:`SPARSE` block), else the full slice.
How: docs/codecs.md ("Delta pulls"); why: docs/design-notes.md ("Delta pulls").

Example:
    >>> from stalewise import codecs, optim
    >>> from stalewise.protocol.shard import Shard
    >>> from stalewise.segments import Segments
    >>> seg = Segments.single(4096)
    >>> shard = Shard(np.zeros(4096, np.float32), seg, optim.sgd(1.0), workers=1)
    >>> shard.join(0, incarnation=1)
    >>> server = PullServer(shard, plan(codecs.int8(), seg, [(0, 4096)])[0])
    >>> worker = Replica([server.pieces], [(0, 4096)], np.float32)
    >>> first = server.pull(0, worker.have(0))
    >>> first.full, worker.apply(0, first.payload)
    (True, 0)
    >>> shard.params[:10] = 1.0      # a push moved 10 values
    >>> p = server.pull(0, worker.have(0))
    >>> p.full, len(p.payload) == p.nbytes() < 4096 // 10, worker.apply(0, p.payload)
    (False, True, 0)
    >>> bool((worker.params == shard.params).all())
    True
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from stalewise import codecs
from stalewise.codecs import PayloadError
from stalewise.protocol import commit
from stalewise.protocol.compress import Piece, plan

__all__ = ["Pull", "PullServer", "Replica", "plan"]

log = logging.getLogger(__name__)

HEADER = struct.Struct("<BBBBIQQ")  # magic, kind, dtype, 0, shard, version, reference number
SPARSE = struct.Struct("<BBBBQQ")  # magic, index bytes, dtype, 0, n, count
MAGIC, SPARSE_MAGIC = 0xD7, 0xD5
FULL, DELTA = 0, 1
_DTYPES = {0: np.dtype(np.float32), 1: np.dtype(np.float64)}
_CODES = {v: k for k, v in _DTYPES.items()}


class Pull(NamedTuple):
    """One pull's message; ``parts``: per piece ``(codec, n, count)`` (codec None: sparse)."""

    version: int
    payload: bytearray
    full: bool
    parts: tuple[tuple[codecs.Codec | None, int, int], ...]
    dtype: np.dtype

    def nbytes(self, scale: float = 1.0) -> int:
        """The payload's length (with ``scale``, a model ``scale`` times larger's)."""
        total = HEADER.size
        for codec, n, count in self.parts:
            m = n if scale == 1.0 else max(round(n * scale), 0)
            if codec is not None:
                total += codec.nbytes(m, self.dtype)
            else:
                c = count if scale == 1.0 else min(max(round(count * scale), 0), m)
                total += _sparse_nbytes(m, c, self.dtype)
        return total


@dataclass
class _Reference:
    incarnation: int
    number: int  # pulls applied since its full pull; the worker names it in its request
    values: np.ndarray


class PullServer:
    """The shard side of delta pulls, beside one :class:`~stalewise.protocol.shard.Shard`
    with ``pieces`` (:func:`~stalewise.protocol.compress.plan`) from ``start``."""

    def __init__(self, shard: Any, pieces: Sequence[Piece], start: int = 0):
        self.shard = shard
        self.pieces = list(pieces)
        self.start = start
        self.size = shard.params.size
        if sum(p.stop - p.start for p in self.pieces) != self.size:
            raise ValueError(f"shard {shard.shard_id}: the pieces do not cover its slice")
        self._refs: dict[int, _Reference] = {}
        self._delta = np.empty(self.size, shard.params.dtype)  # scratch, kept from pull to pull

    @classmethod
    def for_shard(cls, config: Any, k: int, shard: Any) -> PullServer:
        """The pull server of shard ``k`` of a job (a ``ServerConfig`` with a ``pull_codec``)."""
        lo, hi = config.ranges[k]
        pieces = plan(config.pull_codec, config.spec.segments, [(lo, hi)], config.spec.buffers)
        return cls(shard, pieces[0], lo)

    def reference(self, worker: int) -> np.ndarray | None:
        """The copy of the slice the shard believes ``worker`` holds (None: none yet)."""
        ref = self._refs.get(worker)
        return None if ref is None else ref.values

    def forget(self, worker: int) -> None:
        """Drops ``worker``'s reference (it left): its next pull is full."""
        self._refs.pop(worker, None)

    def pull(self, worker: int, have: int = 0, *, now: float | None = None) -> Pull:
        """Serves one pull of ``worker`` holding reference ``have``: a delta, or the full slice."""
        version = self.shard.pull(worker, now=now)
        incarnation = int(self.shard.incarnation[worker])
        ref = self._refs.get(worker)
        pulled = None
        if ref is not None and ref.incarnation == incarnation and have == ref.number > 0:
            pulled = self._delta_pull(ref, version)
        if pulled is None:
            pulled = self._full_pull(worker, incarnation, version)
        self.shard.served(len(pulled.payload))  # journaled: a replay counts it too
        return pulled

    def _full_pull(self, worker: int, incarnation: int, version: int) -> Pull:
        params = self.shard.params
        ref = self._refs.get(worker)
        if ref is None:
            ref = self._refs[worker] = _Reference(incarnation, 0, np.empty_like(params))
        ref.incarnation, ref.number = incarnation, 1
        np.copyto(ref.values, params)
        buf = bytearray(HEADER.size + codecs.NONE.nbytes(params.size, params.dtype))
        mv = memoryview(buf)
        HEADER.pack_into(mv, 0, MAGIC, FULL, _CODES[params.dtype], 0, self.shard.shard_id,
                         version, 1)  # fmt: skip
        codecs.NONE.encode_into(params, mv[HEADER.size :])
        parts = ((codecs.NONE, params.size, params.size),)
        return Pull(version, buf, True, parts, params.dtype)

    def _delta_pull(self, ref: _Reference, version: int) -> Pull | None:
        """The delta against ``ref`` (updated), or None if the subtraction overflowed."""
        params, d, dtype = self.shard.params, self._delta, self.shard.params.dtype
        np.subtract(params, ref.values, out=d)
        if commit.first_non_finite(d) is not None:
            return None
        plans = []  # per piece: (piece, local lo, hi, sparse?, count, payload bytes)
        for p in self.pieces:
            lo, hi = p.start - self.start, p.stop - self.start
            count = int(np.count_nonzero(d[lo:hi]))
            sparse = _sparse_nbytes(hi - lo, count, dtype)
            dense = p.codec.nbytes(hi - lo, dtype)
            plans.append((p, lo, hi, sparse <= dense, count, min(sparse, dense)))
        buf = bytearray(HEADER.size + sum(x[5] for x in plans))
        mv = memoryview(buf)
        HEADER.pack_into(mv, 0, MAGIC, DELTA, _CODES[dtype], 0, self.shard.shard_id, version,
                         ref.number + 1)  # fmt: skip
        offset, parts = HEADER.size, []
        for p, lo, hi, sparse, count, nbytes in plans:
            out, end = mv[offset : offset + nbytes], offset + nbytes
            if sparse:
                idx = np.flatnonzero(d[lo:hi])
                values = params[lo:hi][idx]
                _write_sparse(out, hi - lo, idx, values)
                ref.values[lo:hi][idx] = values
                parts.append((None, hi - lo, count))
            elif p.codec.lossless:  # the new values themselves: exact
                p.codec.encode_into(params[lo:hi], out)
                ref.values[lo:hi] = params[lo:hi]
                parts.append((p.codec, hi - lo, hi - lo))
            else:  # the delta, and the reference moves by what the worker will decode
                p.codec.encode_into(d[lo:hi], out)
                p.codec.decode_at(mv, offset, d[lo:hi])
                ref.values[lo:hi] += d[lo:hi]
                parts.append((p.codec, hi - lo, hi - lo))
            offset = end
        ref.number += 1
        return Pull(version, buf, False, tuple(parts), dtype)


class Replica:
    """The worker side of delta pulls: its copy ``params`` and one reference per shard, of
    ``pieces`` (:func:`~stalewise.protocol.compress.plan`) and ``[start, stop)`` ``ranges``."""

    def __init__(
        self,
        pieces: Sequence[Sequence[Piece]],
        ranges: Sequence[tuple[int, int]],
        dtype: Any = np.float32,
    ):
        self.pieces = [list(p) for p in pieces]
        self.ranges = [(int(lo), int(hi)) for lo, hi in ranges]
        self.dtype = np.dtype(dtype)
        self.params = np.zeros(self.ranges[-1][1] if self.ranges else 0, self.dtype)
        self._have = [0] * len(self.ranges)
        self._scratch = np.empty(max((hi - lo for lo, hi in self.ranges), default=0), self.dtype)

    @classmethod
    def for_job(cls, config: Any) -> Replica:
        """A worker's empty copy for a job (a ``ServerConfig`` with a ``pull_codec``)."""
        ranges = config.ranges
        pieces = plan(config.pull_codec, config.spec.segments, ranges, config.spec.buffers)
        return cls(pieces, ranges, config.init.dtype)

    def have(self, k: int) -> int:
        """The reference number held for shard ``k`` (0: none, the next pull is full)."""
        return self._have[k]

    def reset(self) -> None:
        """Forgets every reference: the next pull from each shard is full."""
        self._have = [0] * len(self.ranges)

    def apply(self, k: int, payload: Any) -> int:
        """Applies shard ``k``'s pull payload to the copy; returns the version it carries.
        PayloadError: a bad payload, naming the shard and the leaf; the copy is unchanged."""
        where = f"pull from shard {k}"
        try:
            mv = codecs.as_bytes(payload)
        except PayloadError as e:
            raise PayloadError(f"{where}: {e}") from None
        if len(mv) < HEADER.size:
            raise PayloadError(f"{where}: truncated: {len(mv)} bytes, the header needs 24")
        magic, kind, code, _, shard, version, number = HEADER.unpack_from(mv, 0)
        if magic != MAGIC:
            raise PayloadError(f"{where}: not a pull payload (magic byte {magic:#04x})")
        if shard != k:
            raise PayloadError(f"{where}: the payload is shard {shard}'s")
        if _DTYPES.get(code) != self.dtype:
            raise PayloadError(f"{where}: bad dtype code {code}, the copy is {self.dtype.name}")
        lo, hi = self.ranges[k]
        new = self._scratch[: hi - lo]
        if kind == FULL:
            if number != 1:
                raise PayloadError(f"{where}: a full pull numbered {number}, not 1")
            end = codecs.NONE.decode_at(mv, HEADER.size, new, f"{where}, full")
            _check_end(where, mv, end)
            if commit.first_non_finite(new) is not None:
                raise PayloadError(f"{where}: the values are not all finite")
            self.params[lo:hi] = new
        elif kind == DELTA:
            if self._have[k] == 0 or number != self._have[k] + 1:
                raise PayloadError(
                    f"{where}: a delta to reference {number - 1}, this worker holds "
                    f"{self._have[k] or 'none'}"
                )
            self._apply_delta(k, mv, new, where)
        else:
            raise PayloadError(f"{where}: unknown kind {kind}")
        self._have[k] = number
        return int(version)

    def _apply_delta(self, k: int, mv: memoryview, new: np.ndarray, where: str) -> None:
        """Decodes and checks every piece into ``new``, then copies it in (a failure: no change)."""
        lo, hi = self.ranges[k]
        new[:] = self.params[lo:hi]
        offset = HEADER.size
        for p in self.pieces[k]:
            a, b = p.start - lo, p.stop - lo
            at = f"{where}, leaf {p.name!r} ({p.codec!r})"
            if offset < len(mv) and mv[offset] == SPARSE_MAGIC:
                offset = _read_sparse(mv, offset, new[a:b], self.dtype, at)
            elif p.codec.lossless:
                offset = p.codec.decode_at(mv, offset, new[a:b], at)
            else:
                delta = np.empty(b - a, self.dtype)
                offset = p.codec.decode_at(mv, offset, delta, at)
                new[a:b] += delta
        _check_end(where, mv, offset)
        if commit.first_non_finite(new) is not None:
            raise PayloadError(f"{where}: the values decode to non-finite numbers")
        self.params[lo:hi] = new


def _sparse_nbytes(n: int, count: int, dtype: np.dtype) -> int:
    return SPARSE.size + count * (codecs.index_dtype(n).itemsize + dtype.itemsize)


def _write_sparse(out: memoryview, n: int, idx: np.ndarray, values: np.ndarray) -> None:
    it = codecs.index_dtype(n)
    SPARSE.pack_into(out, 0, SPARSE_MAGIC, it.itemsize, _CODES[values.dtype], 0, n, idx.size)
    body = SPARSE.size
    np.frombuffer(out, it, idx.size, body)[:] = idx
    np.frombuffer(out, values.dtype, idx.size, body + idx.size * it.itemsize)[:] = values


def _read_sparse(mv: memoryview, offset: int, out: np.ndarray, dtype: np.dtype, at: str) -> int:
    """Writes a sparse block's values into ``out`` at their indices; returns where it ends."""
    if len(mv) - offset < SPARSE.size:
        raise PayloadError(f"{at}: truncated sparse block")
    _, width, code, _, n, count = SPARSE.unpack_from(mv, offset)
    it = codecs.index_dtype(out.size)
    if n != out.size:
        raise PayloadError(f"{at}: sparse block of {n} values, expected {out.size}")
    if width != it.itemsize or _DTYPES.get(code) != dtype:
        raise PayloadError(f"{at}: sparse block with index width {width}, dtype code {code}")
    if count > n:
        raise PayloadError(f"{at}: sparse block of {count} changes among {n} values")
    end = offset + _sparse_nbytes(n, count, dtype)
    if end > len(mv):
        raise PayloadError(
            f"{at}: truncated sparse block ({len(mv) - offset} of {end - offset} bytes)"
        )
    body = offset + SPARSE.size
    idx = np.frombuffer(mv, it, count, body)
    if count and (idx[-1] >= n or (count > 1 and not (np.diff(idx.astype(np.int64)) > 0).all())):
        raise PayloadError(f"{at}: sparse indices out of order or out of range")
    out[idx] = np.frombuffer(mv, dtype, count, body + count * it.itemsize)
    return end


def _check_end(where: str, mv: memoryview, end: int) -> None:
    if end != len(mv):
        raise PayloadError(
            f"{where}: payload of {len(mv)} bytes, expected {end} ({len(mv) - end} too many)"
        )
