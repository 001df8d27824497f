"""The commit rule: a push is applied by every shard or by none. The sender judges the whole push
once into a :class:`Verdict` every shard follows; how and why: ``docs/design-notes.md``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from stalewise.segments import Segments

OK, NOT_FINITE, TOO_STALE, OVERFLOW = 0, 1, 2, 3  # verdict codes, as in a binary push record
_KINDS = {OK: None, NOT_FINITE: "not_finite", TOO_STALE: "too_stale", OVERFLOW: "overflow"}


class Verdict(NamedTuple):
    """The sender's judgement of a whole push: ``code`` and one integer of detail."""

    code: int = OK  # OK, NOT_FINITE, TOO_STALE or OVERFLOW
    detail: int = 0  # NOT_FINITE: first bad element; TOO_STALE: the staleness; OVERFLOW: largest

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
        if self.code == OVERFLOW:
            leaf = f", leaf {leaf_name(segments, self.detail)!r}" if segments else ""
            return (
                "update too large: its squared norm overflows the dtype "
                f"(largest at element {self.detail}{leaf})"
            )
        return f"unknown verdict code {self.code}" if self.code != OK else "ok"


def leaf_name(segments: Segments, index: int) -> str:
    """The name of the leaf holding element ``index`` of the flat vector."""
    if not len(segments):
        return "?"
    i = int(np.searchsorted(segments.offsets, index, side="right")) - 1
    return segments.names[max(i, 0)]


def first_non_finite(flat: np.ndarray) -> int | None:
    """The index of the first NaN/Inf element, or None; one dot product when all are finite."""
    verdict = check_values(flat)
    return verdict.detail if verdict.code == NOT_FINITE else None


def check_values(flat: np.ndarray) -> Verdict:
    """``not_finite`` (first NaN/Inf), ``overflow`` (squared norm overflows; detail: the
    largest element) or OK; one dot product when OK. Any shape (details index it
    flattened); an integer array is OK.

    Example:
        >>> check_values(np.array([1, 2], np.float32)).ok
        True
        >>> check_values(np.array([0, 2e19], np.float32))
        Verdict(code=3, detail=1)
    """
    if flat.dtype.kind != "f":
        return Verdict()
    flat = flat.reshape(-1)  # a 2-D array's dot product would be a matrix product
    # NaN and Inf propagate into the dot product, so a finite one proves every element finite
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is an answer, not a fault
        if math.isfinite(np.dot(flat, flat)):
            return Verdict()
    bad = np.flatnonzero(~np.isfinite(flat))
    if bad.size:
        return Verdict(NOT_FINITE, int(bad[0]))
    return Verdict(OVERFLOW, int(np.argmax(np.abs(flat))))


def judge(
    flat: np.ndarray,
    segments: Segments,
    bases: Sequence[int],
    known: Sequence[int],
    staleness,
    *,
    whole: bool,
) -> Verdict:
    """Judges a whole push once, for every shard: ``bases`` and ``known`` are per shard the
    version the update was computed from and the sender's newest; ``whole``: check values too."""
    if whole:
        verdict = check_values(flat)
        if not verdict.ok:
            return verdict
    if staleness.max_staleness != math.inf:
        tau = max((max(k - b, 0) for k, b in zip(known, bases, strict=True)), default=0)
        if not staleness.accepts(tau):
            return Verdict(TOO_STALE, tau)
    return Verdict()
