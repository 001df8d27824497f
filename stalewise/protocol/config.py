"""``ServerConfig``: everything a runtime needs to build a job's shards."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from stalewise import consistency as consistency_lib
from stalewise import staleness as staleness_lib
from stalewise.protocol.shard import Shard


@dataclass(frozen=True)
class ServerConfig:
    """Everything a runtime needs to build a job's shards: a pure, picklable value."""

    spec: Any  # stalewise.tree.FlatSpec of the parameters
    init: np.ndarray  # the initial flat parameters
    optimizer: Any  # stalewise.optim.Optimizer applied by every shard
    consistency: consistency_lib.Consistency
    staleness: staleness_lib.Staleness
    shards: int = 1

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """The ``[start, stop)`` slice of the flat vector owned by each shard."""
        from stalewise import sharding

        return sharding.plan(self.spec.segments, self.shards)

    def build_shard(self, k: int, params: np.ndarray, workers: int) -> Shard:
        """Builds shard ``k`` over ``params`` (its slice, already holding the values)."""
        lo, hi = self.ranges[k]
        return Shard(
            params,
            self.spec.segments.slice(lo, hi),
            self.optimizer,
            workers=workers,
            consistency=self.consistency,
            staleness=self.staleness,
            shard_id=k,
            job_segments=self.spec.segments,
        )
