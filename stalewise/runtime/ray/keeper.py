"""Error feedback on Ray: each worker id's residual, kept outside the worker's actor.

With a codec that keeps error feedback (:mod:`stalewise.protocol.compress`) the
residual is worker state that outlives an incarnation: a checkpoint saves each
worker's residual as of the last push in the shards' copy, and a restarted
worker continues from the residual of the last push its dead predecessor
committed. A worker actor that dies takes its memory with it, so each worker id
has a :class:`ResidualKeeper`: a small actor in the worker's own
placement-group bundle (so on its node: nothing crosses the network), started
with the worker's first incarnation and living until the run ends.

The worker encodes push ``s`` from the residual of push ``s - 1`` into a
second buffer (``Compressor.encode_into(..., out=)``), and its sender thread
hands the new residual to the keeper (:meth:`ResidualKeeper.keep`) and waits
for it to be kept *before* it sends push ``s`` to any shard. So the keeper
holds the residual of every push a shard may have handled: the driver reads
the one after a checkpoint's last push (:meth:`ResidualKeeper.residual`,
the shards frozen at that cut) and the one after a dead incarnation's last
committed push (the count its shards report at departure).

Price, for codecs with error feedback only: per push, one copy of the
residual into the object store and one out of it into the keeper, plus a call
the sender waits for (off the worker loop's path); memory, the residuals of
the last push every shard acknowledged and of the pushes after it (at most
``IN_FLIGHT + 1``: 3) per worker, in its keeper.
"""

from __future__ import annotations

import numpy as np

from stalewise.runtime.logs import child_logging


class ResidualKeeper:
    """Worker ``w``'s error-feedback residuals after its last pushes (made remote by the
    driver); see the module docstring."""

    def __init__(self, w: int):
        child_logging(f"keeper {w}")
        self.w = w
        self.kept: dict[tuple[int, int], np.ndarray] = {}  # (incarnation, seq) -> residual
        self.spare: list[np.ndarray] = []  # buffers to reuse

    def keep(self, inc: int, seq: int, acked: int, residual: np.ndarray) -> None:
        """Keeps the residual after push ``seq`` of incarnation ``inc``. ``acked``: that
        incarnation's pushes every shard has acknowledged; the residuals of earlier
        ones (but the last) and of other incarnations are no longer wanted."""
        for key in [k for k in self.kept if k[0] != inc or k[1] < acked - 1]:
            self.spare.append(self.kept.pop(key))
        buf = self.spare.pop() if self.spare else None
        if buf is None or buf.shape != residual.shape or buf.dtype != residual.dtype:
            buf = np.empty_like(residual)
        np.copyto(buf, residual)
        self.kept[(inc, seq)] = buf

    def residual(self, inc: int, pushes: int) -> np.ndarray | None:
        """The residual after the first ``pushes`` pushes of incarnation ``inc`` (None: not
        kept, e.g. ``pushes`` 0: the one the incarnation started with is the driver's)."""
        return self.kept.get((inc, pushes - 1))
