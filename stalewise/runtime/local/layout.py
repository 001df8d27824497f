"""The local runtime's shared-memory block: its regions, and lock-free snapshots.

One block holds everything a job moves between processes::

    [ control | shard table | push records | params | observer | snapshot 0 | snapshot 1
      | w0 pull | w1 pull | ... | w0 push | w1 push | ...
      | residual tags | w0 residual 0 | w0 residual 1 | w1 residual 0 | ... ]

One writer per shard slice, any number of readers; the reasoning: ``docs/design-notes.md``."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from stalewise.runtime.local.shm import SharedBlock

if TYPE_CHECKING:
    from stalewise.protocol import ServerConfig

_ALIGN = 64  # bytes; every region starts on a cache line
# where in its 4 KiB page a region of params starts (a large numpy array's), and a push region
# (half a page away): no 4K aliasing (design notes, "Where a region starts in its page")
_PAGE, _AT, _AT_PUSH = 4096, 16, 16 + 2048
# shard table columns: cur, seq[2], ver[2], min clock, live seq, live version, announced, the
# push the live params' writer applies (step_tag; 0: none) and how far it got (elements; -1:
# refused), then per worker when it began to copy the live params (monotonic ns; 0: it is not)
_CUR, _SEQ, _VER, _MIN_CLOCK, _LIVE_SEQ, _LIVE_VER, _ANNOUNCED = 0, 1, 3, 5, 6, 7, 8
_STEP, _DONE, _READING = 9, 10, 11
# push record columns (int64): commit word (seq + 1, stored last; 0: none), incarnation, seq,
# verdict code and detail, per shard its base version, then its slice's sum of squares (float64
# bits, negative if not measured)
R_COMMIT, R_INC, R_SEQ, R_CODE, R_DETAIL, R_BASES = range(6)


def _round_up(n: int, to: int = _ALIGN) -> int:
    return -(-n // to) * to


def _in_page(offset: int, at: int) -> int:
    """The first offset from ``offset`` on that is ``at`` bytes into a page."""
    return offset + (at - offset) % _PAGE


def step_tag(worker: int, seq: int) -> int:
    """The table's name for worker ``worker``'s push ``seq`` while a shard applies it."""
    return (worker << 40) + seq + 1


def copy_range(out: np.ndarray | list, src: np.ndarray, lo: int, hi: int) -> None:
    """``out[lo:hi] = src[lo:hi]``; ``out`` a flat vector or ``(offset, flat view)`` pieces."""
    for at, view in [(0, out)] if isinstance(out, np.ndarray) else out:
        a, b = max(lo, at), min(hi, at + view.size)
        if a < b:
            np.copyto(view[a - at : b - at], src[a:b])


@dataclass(frozen=True)
class Layout:
    """Byte offsets of the regions of a job's shared-memory block."""

    size: int  # elements of the flat parameter vector
    dtype: str  # "float32" or "float64"
    workers: int
    shards: int = 1
    payloads: tuple[int, ...] = ()  # with a codec: each shard's payload's exact byte length
    feedback: bool = False  # the codec keeps error feedback: two residual buffers per worker
    expected: int | None = None  # the ids 0..expected-1 are expected from the start (None: all)

    @classmethod
    def of(cls, config: ServerConfig, workers: int, expected: int | None = None) -> Layout:
        """The layout for ``workers`` ids, the first ``expected`` (default: all) from the start."""
        comp = config.compressor()
        dtype = config.init.dtype
        payloads = (
            () if comp is None else tuple(comp.nbytes(k, dtype) for k in range(config.shards))
        )
        feedback = comp is not None and comp.error_feedback
        expected = None if expected == workers else expected  # None: every id is expected
        return cls(
            config.spec.size, str(dtype), workers, config.shards, payloads, feedback, expected
        )

    @property
    def control_items(self) -> int:
        # [stop flag, per worker: pushes done..., last loss..., batches drawn...; shard exits...]
        return 1 + 3 * self.workers + self.shards

    @property
    def pushes_done(self) -> slice:
        """Each worker id's pushes committed, over incarnations (their sum: the budget spent)."""
        return slice(1, 1 + self.workers)

    @property
    def losses(self) -> slice:
        """The control words holding each worker id's last training loss (NaN: none)."""
        return slice(1 + self.workers, 1 + 2 * self.workers)

    @property
    def shard_exits(self) -> slice:
        """How each shard's process ended: NaN while it runs, else its exit code."""
        return slice(1 + 3 * self.workers, 1 + 3 * self.workers + self.shards)

    def sumsq(self, record: np.ndarray, k: int) -> float | None:
        """Shard ``k``'s sum of squares of its slice in push ``record`` (None: not measured)."""
        x = record[R_BASES + self.shards + k :][:1].view(np.float64)[0]
        return None if self.payloads or x < 0 else float(x)

    @property
    def record_items(self) -> int:
        return R_BASES + 2 * self.shards

    def _records_start(self) -> int:
        columns = _READING + self.workers
        return _round_up(self.control_items * 8) + _round_up(self.shards * columns * 8)

    def _offset(self, region: int) -> int:
        """Where region ``region`` starts: params, observer, 2 snapshots, then each pull."""
        arrays = self._records_start() + _round_up(self.workers * self.record_items * 8)
        raw = _round_up(self.size * np.dtype(self.dtype).itemsize, _PAGE)
        return _in_page(arrays, _AT) + region * raw

    def _push_offset(self, worker: int) -> int:
        raw = sum(map(_round_up, self.payloads)) or self.size * np.dtype(self.dtype).itemsize
        return _in_page(self._offset(4 + self.workers), _AT_PUSH) + worker * _round_up(raw, _PAGE)

    def _residual_offset(self, worker: int, j: int) -> int:
        first = _in_page(self._push_offset(self.workers) + self.workers * 2 * 8, _AT)  # tags first
        return first + (2 * worker + j) * (self._offset(1) - self._offset(0))

    @property
    def where(self) -> list[int]:
        """Where the params and the first push region start, and the block's size."""
        return [self._offset(0), self._push_offset(0), self.nbytes]

    @property
    def nbytes(self) -> int:
        if not self.feedback:
            return self._push_offset(self.workers)
        return self._residual_offset(self.workers, 0)

    def control(self, block: SharedBlock) -> np.ndarray:
        return block.array(np.float64, 0, self.control_items)

    def table(self, block: SharedBlock) -> np.ndarray:
        offset = _round_up(self.control_items * 8)
        n = self.shards * (_READING + self.workers)
        return block.array(np.int64, offset, n).reshape(self.shards, -1)

    def records(self, block: SharedBlock) -> np.ndarray:
        """The push records, one row per worker id (see the module docstring)."""
        n = self.workers * self.record_items
        return block.array(np.int64, self._records_start(), n).reshape(self.workers, -1)

    def params(self, block: SharedBlock) -> np.ndarray:
        return block.array(self.dtype, self._offset(0), self.size)

    def observer(self, block: SharedBlock) -> np.ndarray:
        return block.array(self.dtype, self._offset(1), self.size)

    def snapshot(self, block: SharedBlock, i: int) -> np.ndarray:
        return block.array(self.dtype, self._offset(2 + i), self.size)

    def pull_buffer(self, block: SharedBlock, worker: int) -> np.ndarray:
        return block.array(self.dtype, self._offset(4 + worker), self.size)

    def push_buffer(self, block: SharedBlock, worker: int) -> np.ndarray:
        """A worker's push region as the flat update (no codec)."""
        if self.payloads:
            raise ValueError("with a codec, a push region holds payloads: see Layout.payload")
        return block.array(self.dtype, self._push_offset(worker), self.size)

    def payload(self, block: SharedBlock, worker: int, k: int) -> np.ndarray:
        """With a codec: the bytes of shard ``k``'s payload in ``worker``'s push region."""
        if not self.payloads:
            raise ValueError("without a codec, a push region holds the flat update")
        offset = self._push_offset(worker) + sum(_round_up(n) for n in self.payloads[:k])
        return block.array(np.uint8, offset, self.payloads[k])


class Residuals:
    """The workers' error-feedback residuals in a shared block: one writer per worker id calls
    :meth:`writing` and :meth:`written` around each encode; :meth:`read` finds the current one."""

    def __init__(self, layout: Layout, block: SharedBlock):
        if not layout.feedback:
            raise ValueError("this job's codec keeps no error feedback: no residuals")
        n, at, dtype = layout.workers, layout._residual_offset, layout.dtype
        self.tags = block.array(np.int64, layout._push_offset(n), 2 * n).reshape(n, 2)  # 2 each
        self.records = layout.records(block)
        self.buffers = [
            tuple(block.array(dtype, at(w, j), layout.size) for j in (0, 1)) for w in range(n)
        ]

    # -- the worker's side
    def writing(self, w: int, j: int) -> np.ndarray:
        """Buffer ``j`` of worker ``w`` is about to be written: readers stop trusting it."""
        self.tags[w, j] = -1
        return self.buffers[w][j]

    def written(self, w: int, j: int, commit_word: int) -> None:
        """Buffer ``j`` now holds the residual after the push of ``commit_word``."""
        self.tags[w, j] = commit_word

    # -- the readers' side
    def current(self, w: int, incarnation: int) -> tuple[int, int] | None:
        """``(buffer, tag)`` of the residual after worker ``w``'s last committed push of
        ``incarnation`` (None: both buffers are being written, which never lasts)."""
        t0, t1 = int(self.tags[w, 0]), int(self.tags[w, 1])
        if t0 < 0 and t1 < 0:
            return None
        if t0 < 0 or t1 < 0:
            return (0, t0) if t1 < 0 else (1, t1)
        hi = 0 if t0 > t1 else 1
        rec = self.records[w]  # the incarnation first: a new one rewrites it before its commit
        same, word = int(rec[R_INC]) == incarnation, int(rec[R_COMMIT])
        committed = same and word > 0 and int(rec[R_SEQ]) == word - 1 and word >= max(t0, t1)
        return (hi, max(t0, t1)) if committed else (1 - hi, min(t0, t1))

    def read(self, w: int, incarnation: int, out: np.ndarray, timeout: float = 10.0) -> int:
        """Copies worker ``w``'s residual after its last committed push of ``incarnation`` into
        ``out`` (never torn); returns its tag (TimeoutError: none within ``timeout`` s)."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.current(w, incarnation)
            if found is not None:
                j, tag = found
                np.copyto(out, self.buffers[w][j])
                if int(self.tags[w, j]) == tag:
                    return tag
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {w}'s residual kept changing for {timeout} s")

    def put(self, w: int, residual: np.ndarray) -> None:
        """Sets worker ``w``'s residual for its next incarnation (no incarnation of ``w``
        may be running): buffer 1, tagged 0 (before its first push); buffer 0 unused."""
        self.tags[w, 0] = -1
        np.copyto(self.buffers[w][1], residual)
        self.tags[w, 1] = 0

    def hand_over(self, w: int, incarnation: int) -> None:
        """Puts ``incarnation``'s last residual in place for ``w``'s next (once it stopped)."""
        found = self.current(w, incarnation)
        if found is None:  # cannot happen with a writer that follows the protocol
            self.put(w, np.zeros_like(self.buffers[w][0]))
        elif found[0] == 1:
            self.tags[w, 0] = -1
            self.tags[w, 1] = 0
        else:
            self.put(w, self.buffers[w][0])


class Snapshots:
    """Seqlocked double-buffered copies of each shard's slice, and its live params' seqlock."""

    def __init__(self, layout: Layout, block: SharedBlock, ranges: list[tuple[int, int]]):
        self.table = layout.table(block)
        self.buffers = (layout.snapshot(block, 0), layout.snapshot(block, 1))
        self.params = layout.params(block)
        self.ranges = ranges

    def changing(self, k: int, step: int = 0) -> None:
        """Shard ``k`` may write its live params from now on (odd: readers retry), applying
        push ``step`` (:func:`step_tag`; 0: none) and reporting its progress (:meth:`done`)."""
        row = self.table[k]
        row[_DONE] = 0
        row[_STEP] = step
        row[_LIVE_SEQ] |= 1

    def done(self, k: int) -> np.ndarray:
        """The word where shard ``k``'s step writes how many of its params it has written."""
        return self.table[k, _DONE : _DONE + 1]

    def stepped(self, k: int, applied: bool) -> None:
        """Shard ``k`` applied the push it named in :meth:`changing`, or refused it."""
        lo, hi = self.ranges[k]
        self.table[k, _DONE] = hi - lo if applied else -1

    def changed(self, k: int, version: int) -> None:
        """Shard ``k``'s live params are consistent again, at ``version`` (even)."""
        row = self.table[k]
        row[_LIVE_VER] = version
        row[_LIVE_SEQ] = (int(row[_LIVE_SEQ]) | 1) + 1

    def steady(self, k: int) -> bool:
        """Whether shard ``k`` is not changing its live params right now."""
        return not int(self.table[k, _LIVE_SEQ]) & 1

    def read_live(self, k: int, out: np.ndarray | list, worker: int) -> int | None:
        """Worker ``worker`` copies shard ``k``'s live params into ``out[lo:hi]`` (marked: see
        :meth:`readers`); their version, or None if the shard changed them (a torn copy)."""
        row, (lo, hi) = self.table[k], self.ranges[k]
        row[_READING + worker] = time.monotonic_ns()
        seq = int(row[_LIVE_SEQ])
        if not seq & 1:
            copy_range(out, self.params, lo, hi)
        version = int(row[_LIVE_VER])
        row[_READING + worker] = 0
        return version if not seq & 1 and int(row[_LIVE_SEQ]) == seq else None

    def trail(self, k: int, out: np.ndarray | list, worker: int, step: int):
        """Worker ``worker`` copies shard ``k``'s live params into ``out[lo:hi]`` behind the
        step of push ``step`` (:func:`step_tag`), each piece once the shard reports it written.
        A generator: yields (True while that step runs) until it returns the params' version
        after it, or None if the shard refused that push or moved on (do not use the copy)."""
        row, (lo, hi) = self.table[k], self.ranges[k]
        at, marked = lo, False
        try:
            while True:
                seq = int(row[_LIVE_SEQ])
                if int(row[_STEP]) != step:  # not begun, or over and followed by another
                    if at > lo:
                        return None
                    yield False
                    continue
                done = int(row[_DONE])
                if not seq & 1 and done != hi - lo:  # refused, or for an instant not begun
                    if done < 0 or at > lo:
                        return None
                    yield False
                    continue
                if not marked:  # the shard's next step waits for this copy (see readers)
                    row[_READING + worker] = time.monotonic_ns()
                    marked = True
                if not seq & 1:  # over
                    break
                if lo + done > at:
                    copy_range(out, self.params, at, lo + done)
                    at = lo + done
                else:
                    yield True
            copy_range(out, self.params, at, hi)
            version = int(row[_LIVE_VER])
            return version if int(row[_LIVE_SEQ]) == seq and int(row[_STEP]) == step else None
        finally:
            if marked:
                row[_READING + worker] = 0

    def readers(self, k: int) -> list[float]:
        """When (``time.monotonic()``) each worker now copying shard ``k``'s live params began."""
        return [t / 1e9 for t in self.table[k, _READING:].tolist() if t]

    def announce(self, k: int, version: int) -> None:
        """Shard ``k``, busy, publishes ``version`` right after the acks it is sending."""
        self.table[k, _ANNOUNCED] = version

    def announced(self, k: int) -> int:
        """The version shard ``k`` last said it publishes after its acks (see announce)."""
        return int(self.table[k, _ANNOUNCED])

    def publish(self, k: int, params: np.ndarray, version: int, min_clock: int) -> None:
        """Shard ``k`` (the only writer of its row) publishes its slice at ``version``."""
        row, (lo, hi) = self.table[k], self.ranges[k]
        j = 1 - int(row[_CUR])
        row[_SEQ + j] += 1  # odd: being written
        np.copyto(self.buffers[j][lo:hi], params)
        row[_VER + j] = version
        row[_SEQ + j] += 1  # even: consistent
        row[_CUR] = j
        row[_MIN_CLOCK] = min_clock

    def min_clock(self, k: int) -> int:
        return int(self.table[k, _MIN_CLOCK])

    def set_min_clock(self, k: int, clock: int) -> None:
        self.table[k, _MIN_CLOCK] = clock

    def version(self, k: int) -> int:
        """The version of shard ``k``'s current snapshot (it may move on at once)."""
        row = self.table[k]
        return int(row[_VER + int(row[_CUR])])

    def read(self, k: int, out: np.ndarray | list) -> int:
        """Copies shard ``k``'s latest snapshot into ``out[lo:hi]``; returns its version."""
        row, (lo, hi) = self.table[k], self.ranges[k]
        while True:
            i = int(row[_CUR])
            seq = int(row[_SEQ + i])
            if seq & 1:
                continue  # the shard is writing it; it will flip `cur` when done
            copy_range(out, self.buffers[i], lo, hi)
            version = int(row[_VER + i])
            if int(row[_SEQ + i]) == seq:
                return version
