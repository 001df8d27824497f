"""``ServerConfig``: everything a runtime needs to build a job's shards."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from stalewise import codecs as codecs_lib
from stalewise import consistency as consistency_lib
from stalewise import staleness as staleness_lib
from stalewise.protocol import compress
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
    codec: codecs_lib.Policy = codecs_lib.NONE  # how pushes travel (stalewise.protocol.compress)
    pull_codec: codecs_lib.Policy | None = None  # delta pulls (protocol.pulls); None: full
    replicas: int = 1  # copies of each shard (protocol.replica): 1 or 2

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """The ``[start, stop)`` slice of the flat vector owned by each shard."""
        from stalewise import sharding

        return sharding.plan(self.spec.segments, self.shards)

    def compressor(self) -> compress.Compressor | None:
        """The workers' encoder of pushes, or None when every leaf travels as it is."""
        if compress.is_identity(self.codec):
            return None
        return compress.Compressor(self.codec, self.spec.segments, self.ranges, self.spec.buffers)

    def build_shard(
        self, k: int, params: np.ndarray, workers: int, expected: int | None = None
    ) -> Shard:
        """Builds shard ``k`` over its slice ``params`` for ``workers`` worker ids, the first
        ``expected`` (default: all) expected from the start; with a codec it decodes payloads."""
        ranges = self.ranges
        lo, hi = ranges[k]
        decoder = None
        if not compress.is_identity(self.codec):
            segments, buffers = self.spec.segments, frozenset(self.spec.buffers)
            decoder = compress.Decoder.for_shard(self.codec, segments, ranges, k, buffers)
        return Shard(
            params,
            self.spec.segments.slice(lo, hi),
            self.optimizer,
            workers=workers,
            expected=expected,
            consistency=self.consistency,
            staleness=self.staleness,
            shard_id=k,
            job_segments=self.spec.segments,
            decoder=decoder,
        )
