"""The commit rule: a push is applied by every shard or by none.

Each shard sees only its slice of a push, so no shard alone can tell whether
another slice holds a NaN or whether the push is too stale elsewhere. The
sender therefore judges the whole push once, before any shard sees it, and
writes that :class:`Verdict` into the push's record. The push is *committed*
when its record is complete (in the local runtime: when the record's commit
word is stored in shared memory). From then on every shard follows the same
verdict, and a shard that learns its sender died delivers a committed push it
has not handled yet (:meth:`~stalewise.protocol.shard.Shard.depart`), so a
push whose sender is killed at any instant is applied everywhere or nowhere:

* killed before the commit word: no shard was told, none applies it;
* killed after it: every shard applies it, from a message or at departure.

What is judged at commit:

* ``not_finite``: NaN or Inf anywhere in the update (only needed with several
  shards; a single shard checks its whole slice itself);
* ``too_stale``: ``max_staleness`` against the versions the sender knows at
  commit (the largest ``known - base`` over shards), one answer for all shards.

A verdict is two integers, so it fits a fixed binary record.

Example:
    >>> import numpy as np
    >>> from stalewise import staleness
    >>> from stalewise.segments import Segments
    >>> seg = Segments.from_sizes(["a", "b"], [2, 2])
    >>> v = judge(np.array([0, 1, np.nan, 0], np.float32), seg, [0], [0], staleness.constant(),
    ...           whole=True)
    >>> v.kind, v.message(seg)
    ('not_finite', "payload has NaN or Inf (first at element 2, leaf 'b')")
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from stalewise.segments import Segments

# verdict codes, as stored in a binary push record
OK, NOT_FINITE, TOO_STALE = 0, 1, 2
_KINDS = {OK: None, NOT_FINITE: "not_finite", TOO_STALE: "too_stale"}


class Verdict(NamedTuple):
    """The sender's judgement of a whole push: ``code`` and one integer of detail."""

    code: int = OK  # OK, NOT_FINITE or TOO_STALE
    detail: int = 0  # NOT_FINITE: first bad element; TOO_STALE: the staleness

    @property
    def ok(self) -> bool:
        return self.code == OK

    @property
    def kind(self) -> str | None:
        return _KINDS.get(self.code, "bad_verdict")

    def message(self, segments: Segments | None = None, max_staleness: float = math.inf) -> str:
        """The refusal's text, naming the leaf (given the full leaf table) or the staleness."""
        if self.code == NOT_FINITE:
            leaf = f", leaf {leaf_name(segments, self.detail)!r}" if segments else ""
            return f"payload has NaN or Inf (first at element {self.detail}{leaf})"
        if self.code == TOO_STALE:
            return f"staleness {self.detail} exceeds max_staleness {max_staleness:g}"
        return f"unknown verdict code {self.code}" if self.code != OK else "ok"


def leaf_name(segments: Segments, index: int) -> str:
    """The name of the leaf holding element ``index`` of the flat vector."""
    if not len(segments):
        return "?"
    i = int(np.searchsorted(segments.offsets, index, side="right")) - 1
    return segments.names[max(i, 0)]


def first_non_finite(flat: np.ndarray) -> int | None:
    """The index of the first NaN/Inf element, or None; one dot product when all are finite."""
    # NaN and Inf propagate into the dot product, so a finite result proves every element
    # finite without a temporary; an overflow of the dot only sends us to the exact check.
    if math.isfinite(np.dot(flat, flat)):
        return None
    bad = np.flatnonzero(~np.isfinite(flat))
    return int(bad[0]) if bad.size else None


def judge(
    flat: np.ndarray,
    segments: Segments,
    bases: Sequence[int],
    known: Sequence[int],
    staleness,
    *,
    whole: bool,
) -> Verdict:
    """Judges a whole push once, for every shard.

    Args:
        flat: the whole update, as the flat vector.
        segments: the full leaf table (for messages).
        bases: per shard, the version the update was computed from.
        known: per shard, the newest version the sender knows of (>= its base).
        staleness: the job's :class:`~stalewise.staleness.Staleness` rule.
        whole: check every element for NaN/Inf (needed when there are several shards).
    """
    if whole:
        bad = first_non_finite(flat)
        if bad is not None:
            return Verdict(NOT_FINITE, bad)
    if staleness.max_staleness != math.inf:
        tau = max((max(k - b, 0) for k, b in zip(known, bases, strict=True)), default=0)
        if not staleness.accepts(tau):
            return Verdict(TOO_STALE, tau)
    return Verdict()
