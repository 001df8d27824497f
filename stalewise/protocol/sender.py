"""The worker's half of a push: one :class:`Sender` per worker incarnation, no I/O.

Every runtime drives a :class:`Sender` for each push, in this order: ``pulled`` and
``observed``, ``encode`` (with a codec), ``judge`` once, then, once the runtime committed
the push its own way, ``committed`` (or ``abandoned``), and ``result`` on the acks. The
residual of the last committed push stays current; a next incarnation starts from it.

Example:
    >>> from stalewise import codecs, staleness
    >>> seg = Segments.from_sizes(["w"], [1000])
    >>> comp = Compressor(codecs.topk(0.01), seg, [(0, 500), (500, 1000)])
    >>> s = Sender(seg, staleness.constant(max_staleness=2), shards=2, compressor=comp)
    >>> s.pulled(0, 3); s.pulled(1, 3)
    >>> payloads = [bytearray(comp.nbytes(k)) for k in range(2)]
    >>> s.encode(np.ones(1000, np.float32), payloads)
    >>> out = s.judge()
    >>> out.seq, out.bases, out.verdict.ok
    (0, (3, 3), True)
    >>> float(s.residual.sum())  # not committed yet: the old residual
    0.0
    >>> s.committed(); float(s.residual.sum()), s.seq  # 10 values sent, 990 deferred
    (990.0, 1)
    >>> s.observed(1, 9)  # a newer version of shard 1: the next push would be too stale
    >>> s.encode(np.ones(1000, np.float32), payloads); s.judge().verdict.kind
    'too_stale'
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from stalewise.protocol import commit
from stalewise.protocol.compress import Compressor, Feedback
from stalewise.protocol.messages import Ack, PushResult
from stalewise.segments import Segments

__all__ = ["History", "Outgoing", "Sender"]


class Outgoing(NamedTuple):
    """A judged push, as every shard must be told of it."""

    seq: int  # the incarnation's sequence number of the push
    bases: tuple[int, ...]  # per shard, the version the update was computed from
    verdict: commit.Verdict  # the commit rule's judgement, one for every shard


class Sender:
    """A worker incarnation's sending side. ``residual``: the error feedback to start from
    (copied; None: zeros); ``buffers``: two residual buffers to use, ``current`` holding it."""

    def __init__(
        self,
        segments: Segments,
        staleness: Any,
        shards: int,
        compressor: Compressor | None = None,
        *,
        residual: np.ndarray | None = None,
        buffers: Sequence[np.ndarray] | None = None,
        current: int = 1,
        dtype: Any = np.float32,
    ):
        self.segments, self.staleness = segments, staleness
        self.shards = int(shards)
        self.compressor = compressor
        self.seq = 0  # the sequence number of the next push
        self.bases = [0] * self.shards  # per shard, the version of the last pull
        self.known = [0] * self.shards  # per shard, the newest version seen
        self._buffers: tuple[np.ndarray, np.ndarray] | None = None
        self.current = current  # which of the buffers holds the committed residual
        if buffers is not None:
            if len(buffers) != 2 or current not in (0, 1):
                raise ValueError(f"expected two residual buffers and current 0 or 1, got {current}")
            self._buffers = (buffers[0], buffers[1])
        elif compressor is not None and compressor.error_feedback:
            size = compressor.size
            # both zero: the encoder writes only the pieces whose codec keeps feedback
            self._buffers = (np.zeros(size, dtype), np.zeros(size, dtype))
            self.current = 1
            if residual is not None:
                np.copyto(self._buffers[1], residual)
        self._payloads: Sequence[Any] | None = None  # of the push being prepared
        self._encoded = False  # a new residual is in the other buffer, not yet committed
        self._decoded: np.ndarray | None = None  # the payloads decoded back, for the verdict
        self._sent: list[Any] = [None] * self.shards

    def pulled(self, k: int, version: int) -> None:
        """The step's pull got ``version`` of shard ``k``: the push's base there."""
        self.bases[k] = version
        self.known[k] = max(self.known[k], version)

    def observed(self, k: int, version: int) -> None:
        """The worker saw ``version`` of shard ``k`` (a published snapshot, an ack)."""
        if version > self.known[k]:
            self.known[k] = version

    @property
    def residual(self) -> np.ndarray | None:
        """The residual after the last committed push (None without error feedback)."""
        return None if self._buffers is None else self._buffers[self.current]

    def encode(self, flat: np.ndarray, payloads: Sequence[Any]) -> None:
        """Encodes ``flat`` into ``payloads``, the new residual into the other buffer."""
        comp = self.compressor
        if comp is None:
            raise ValueError("this job has no codec: its updates are not encoded")
        if self._buffers is None:
            comp.encode_into(flat, payloads)
        else:
            cur = self.current
            old, new = Feedback(self._buffers[cur]), Feedback(self._buffers[1 - cur])
            comp.encode_into(flat, payloads, old, out=new)  # the new residual is always in `new`
            self._encoded = True
        self._payloads = payloads
        self._sent = list(comp.sent)  # per shard, the pieces sent (a segment push) or None

    def sent_nbytes(self, k: int, dtype: Any = np.float32, scale: float = 1.0) -> int:
        """The length of shard ``k``'s payload of the push encoded last (``scale`` as in
        :meth:`Compressor.nbytes <stalewise.protocol.compress.Compressor.nbytes>`)."""
        return self.compressor.sent_nbytes(k, dtype, scale, self._sent[k])

    def judge(self, flat: np.ndarray | None = None, *, into: np.ndarray | None = None) -> Outgoing:
        """The commit rule's verdict on the push being prepared. ``flat``: the update (needed
        without a codec, or with one shard); ``into``: a buffer for the payloads decoded back."""
        whole = self.shards > 1  # one shard checks its whole slice itself
        if self._payloads is not None and whole:
            if into is None:
                if self._decoded is None:
                    dtype = np.float32 if flat is None else flat.dtype
                    dtype = self._buffers[0].dtype if self._buffers else dtype
                    self._decoded = np.empty(self.compressor.size, dtype)
                into = self._decoded
            values = self.compressor.decode(self._payloads, into)
        elif flat is None:
            raise ValueError("judge() needs the update without a codec or with a single shard")
        else:
            values = flat
        verdict = commit.judge(
            values, self.segments, self.bases, self.known, self.staleness, whole=whole
        )
        return Outgoing(self.seq, tuple(self.bases), verdict)

    def committed(self) -> None:
        """The push judged last is committed: its residual becomes current, ``seq`` moves on."""
        if self._encoded:
            self.current = 1 - self.current
        self._encoded, self._payloads = False, None
        self.seq += 1

    def successor(self) -> Sender:
        """The sending side of this worker's next incarnation, with this one's residual buffers."""
        return Sender(
            self.segments,
            self.staleness,
            self.shards,
            self.compressor,
            buffers=self._buffers,
            current=self.current,
        )

    def abandoned(self) -> None:
        """The push being prepared will never be committed: the residual stays as it was."""
        self._encoded, self._payloads = False, None

    def result(self, acks: Sequence[Ack]) -> PushResult:
        """Folds one push's acks (one per shard, in order) into its result; notes their versions."""
        for k, ack in enumerate(acks):
            self.observed(k, ack.version)
        return PushResult.of(acks)


class History:
    """A worker id's error-feedback residuals after its recent pushes, over incarnations (Ray)."""

    def __init__(self) -> None:
        self._kept: dict[tuple[int, int], np.ndarray] = {}  # (incarnation, pushes) -> residual

    def keep(self, inc: int, pushes: int, residual: np.ndarray, *, acked: int) -> None:
        """Keeps a copy of the residual after the first ``pushes`` pushes of incarnation ``inc``;
        ``acked``: its pushes every shard acknowledged (older residuals are dropped)."""
        for key in [k for k in self._kept if k[0] != inc or k[1] < acked]:
            del self._kept[key]
        self._kept[(inc, pushes)] = np.array(residual)

    def at(self, inc: int, pushes: int | None) -> np.ndarray | None:
        """The residual after the first ``pushes`` pushes of ``inc`` (None: not kept or unknown)."""
        return self._kept.get((inc, pushes))

    def latest(self) -> np.ndarray | None:
        """The residual after the most pushes of the newest incarnation kept (None: none)."""
        return self._kept[max(self._kept)] if self._kept else None

    def clear(self) -> None:
        """Forgets every residual (none is known until the next :meth:`keep`)."""
        self._kept.clear()
