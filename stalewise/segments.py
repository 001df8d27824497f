"""The segment table: which slice of a flat parameter vector belongs to which leaf."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np


class Segments(NamedTuple):
    """A table of contiguous, non-overlapping segments covering ``[0, total)``."""

    names: tuple[str, ...]  # each leaf's dotted key path (a leaf split across shards keeps it)
    offsets: np.ndarray  # int64 start of each segment in the flat vector
    sizes: np.ndarray  # int64 number of elements of each segment

    @classmethod
    def from_sizes(cls, names: Sequence[str], sizes: Sequence[int]) -> Segments:
        """Builds a table of back-to-back segments starting at offset 0."""
        sizes_arr = np.asarray(sizes, dtype=np.int64).reshape(-1)
        if len(names) != len(sizes_arr):
            raise ValueError(f"{len(names)} names for {len(sizes_arr)} sizes")
        if (sizes_arr < 0).any():
            bad = int(np.flatnonzero(sizes_arr < 0)[0])
            raise ValueError(f"segment {names[bad]!r}: negative size {int(sizes_arr[bad])}")
        offsets = np.zeros(len(sizes_arr), dtype=np.int64)
        if len(sizes_arr):
            np.cumsum(sizes_arr[:-1], out=offsets[1:])
        return cls(tuple(names), offsets, sizes_arr)

    @classmethod
    def single(cls, size: int, name: str = "params") -> Segments:
        """One segment covering a whole vector (the table for an unstructured vector)."""
        return cls.from_sizes([name], [size])

    @property
    def total(self) -> int:
        """Number of elements covered (end of the last segment)."""
        if not len(self.sizes):
            return 0
        return int(self.offsets[-1] + self.sizes[-1])

    def __len__(self) -> int:  # type: ignore[override]
        return len(self.names)

    def slice(self, start: int, stop: int) -> Segments:
        """The table's part in ``[start, stop)``, re-based to 0 (a cut segment keeps its name)."""
        if not 0 <= start <= stop <= self.total:
            raise ValueError(f"slice [{start}, {stop}) outside [0, {self.total})")
        ends = self.offsets + self.sizes
        keep = (ends > start) & (self.offsets < stop) | (
            (self.sizes == 0) & (self.offsets >= start) & (self.offsets < stop)
        )
        idx = np.flatnonzero(keep)
        lo = np.maximum(self.offsets[idx], start)
        hi = np.minimum(ends[idx], stop)
        return Segments(tuple(self.names[i] for i in idx), lo - start, hi - lo)

    def mask(self, patterns: Iterable[str] | None) -> np.ndarray:
        """A boolean per segment: True where ``re.search`` finds any of ``patterns`` in its name."""
        pats = [re.compile(p) for p in (patterns or ())]
        return np.array([any(p.search(n) for p in pats) for n in self.names], dtype=np.bool_)
