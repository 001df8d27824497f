"""Size-balanced sharding of the flat parameter vector across server shards.

Cuts fall on leaf boundaries, except in a leaf larger than a shard's share.

Example:
    >>> seg = Segments.from_sizes(["a", "b", "c", "d"], [10, 10, 10, 10])
    >>> plan(seg, 2)
    [(0, 20), (20, 40)]
    >>> plan(Segments.from_sizes(["big", "tiny"], [90, 10]), 2)
    [(0, 50), (50, 100)]
"""

from __future__ import annotations

import itertools

import numpy as np

from stalewise.segments import Segments


def plan(segments: Segments, shards: int) -> list[tuple[int, int]]:
    """``shards`` (>= 1) contiguous ranges ``(start, stop)`` of about equal size, in order."""
    if not isinstance(shards, int) or shards < 1:
        raise ValueError(f"shards must be an integer >= 1, got {shards!r}")
    total = segments.total
    share = total / shards
    starts, ends = segments.offsets, segments.offsets + segments.sizes
    cuts = [0]
    for k in range(1, shards):
        ideal = round(k * share)
        # the leaf that contains the ideal cut
        i = int(np.searchsorted(ends, ideal, side="right"))
        cut = ideal
        if i < len(starts) and segments.sizes[i] <= share and starts[i] < ideal:
            lo, hi = int(starts[i]), int(ends[i])
            cut = lo if ideal - lo <= hi - ideal else hi
        cuts.append(min(max(cut, cuts[-1]), total))
    cuts.append(total)
    return list(itertools.pairwise(cuts))
