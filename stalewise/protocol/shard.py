"""The parameter-server shard as a state machine (no I/O, no threads).

A :class:`Shard` holds one contiguous slice of the flat parameters, the server
optimizer's state for it and a version (the count of updates applied). Every
runtime (local processes, the simulator, Ray) hosts the same object and only
decides how messages reach it.

Threading contract: a shard is not thread-safe; exactly one thread of one
process calls its methods, one message at a time.

Everything a worker sends is validated before it touches state. A push is
``(header, payload)``: the :class:`PushHeader` names the worker, its sequence
number and the version it pulled; the payload is a flat vector the length of the
shard. The shard may overwrite the payload (it is used as scratch).

Example:
    >>> import numpy as np
    >>> from stalewise import optim, segments
    >>> params = np.zeros(4, np.float32)
    >>> shard = Shard(params, segments.Segments.single(4), optim.sgd(0.5), workers=2)
    >>> shard.pull(worker=0)
    0
    >>> ack = shard.push(PushHeader(worker=0, seq=0, base_version=0), np.ones(4, np.float32))
    >>> ack.ok, shard.version, params.tolist()
    (True, 1, [-0.5, -0.5, -0.5, -0.5])
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from stalewise import consistency as consistency_lib
from stalewise import staleness as staleness_lib
from stalewise.segments import Segments

log = logging.getLogger(__name__)


class PushHeader(NamedTuple):
    """What identifies a push: ``(worker, seq)`` makes it exactly-once."""

    worker: int  # id of the pushing worker, 0 <= worker < workers
    seq: int  # the worker's sequence number for this push (0, 1, 2, ...)
    base_version: int  # the shard version the update was computed from


class Ack(NamedTuple):
    """The shard's answer to a push."""

    worker: int
    seq: int
    ok: bool  # False: rejected, nothing changed; `reason` says why
    reason: str | None
    version: int  # shard version after handling the push
    staleness: int | None  # tau of the push (None when the header was unusable)
    duplicate: bool = False  # a replay of a push already handled: acknowledged, not applied


@dataclass
class ShardStats:
    """Counters a shard keeps; cheap to copy and to merge across shards."""

    applied: int = 0  # pushes applied (in BSP: pushes merged into a round)
    rounds: int = 0  # optimizer steps taken (== version)
    rejected: Counter = field(default_factory=Counter)  # reason kind -> count
    duplicates: int = 0
    staleness: Counter = field(default_factory=Counter)  # tau -> count, applied pushes
    bytes_in: int = 0
    bytes_out: int = 0

    def staleness_mean(self) -> float:
        n = sum(self.staleness.values())
        return sum(t * c for t, c in self.staleness.items()) / n if n else 0.0

    def staleness_max(self) -> int:
        return max(self.staleness, default=0)

    def as_dict(self) -> dict[str, Any]:
        return {
            "applied": self.applied,
            "rounds": self.rounds,
            "rejected": dict(self.rejected),
            "duplicates": self.duplicates,
            "staleness_mean": self.staleness_mean(),
            "staleness_max": self.staleness_max(),
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
        }


class Rejected(Exception):
    """Raised inside :meth:`Shard.push` validation; turned into a rejecting :class:`Ack`."""

    def __init__(self, kind: str, detail: str):
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


class _ClockTracker:
    """How many live workers are at each clock, and the slowest live clock.

    Clocks only grow and a joining worker starts at the slowest live clock or
    later, so the stored minimum only moves up (it is reset when the first
    worker joins an empty job): :meth:`min` is O(1) and keeping it costs O(1)
    amortised per push.
    """

    def __init__(self, workers: int):
        self.live = workers  # number of live workers
        self._count = {0: workers}  # clock -> live workers at it (no zero entries)
        self._min = 0

    def min(self) -> int:
        """The slowest live clock (0 when no worker is live)."""
        return self._min if self.live else 0

    def add(self, clock: int) -> None:
        """A worker becomes live at ``clock``."""
        if not self.live or clock < self._min:
            self._min = clock
        self._count[clock] = self._count.get(clock, 0) + 1
        self.live += 1

    def remove(self, clock: int) -> None:
        """A live worker at ``clock`` leaves."""
        self.live -= 1
        self._drop(clock)

    def advance(self, clock: int) -> None:
        """A live worker moves from ``clock`` to ``clock + 1``."""
        self._count[clock + 1] = self._count.get(clock + 1, 0) + 1
        self._drop(clock)

    def _drop(self, clock: int) -> None:
        n = self._count.pop(clock) - 1
        if n:
            self._count[clock] = n
        elif self.live:
            while self._min not in self._count:
                self._min += 1


class Shard:
    """One parameter-server shard.

    Args:
        params: this shard's slice of the flat parameters (float32 or float64, 1-D).
            The shard updates it in place; a runtime may pass a shared-memory view.
        segments: the leaf table of ``params`` (per-leaf optimizers need it).
        optimizer: a :class:`stalewise.optim.Optimizer` applied to each merged push.
        workers: number of workers; ids are ``0 .. workers-1``.
        consistency: ASP, SSP or BSP (default ASP).
        staleness: how much a stale push counts (default: constant).
        shard_id: used in log and error messages.

    ``clocks`` and ``live`` are read-only outside the shard: :meth:`push`,
    :meth:`leave` and :meth:`join` keep them in step with the O(1) counts
    behind :meth:`min_clock` and the BSP rounds.
    """

    def __init__(
        self,
        params: np.ndarray,
        segments: Segments,
        optimizer: Any,
        *,
        workers: int,
        consistency: consistency_lib.Consistency | None = None,
        staleness: staleness_lib.Staleness | None = None,
        shard_id: int = 0,
    ):
        if params.ndim != 1 or params.dtype not in (np.float32, np.float64):
            raise ValueError(
                f"shard params must be a 1-D float32/float64 vector, got {params.dtype}{params.shape}"
            )
        if segments.total != params.size:
            raise ValueError(f"segments cover {segments.total} elements, params have {params.size}")
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.params = params
        self.segments = segments
        self.optimizer = optimizer
        self.opt_state = optimizer.init(params, segments)
        self.workers = workers
        self.consistency = consistency or consistency_lib.ASP()
        self.staleness = staleness or staleness_lib.constant()
        self.shard_id = shard_id
        self.version = 0
        self.clocks = np.zeros(workers, dtype=np.int64)  # completed pushes per worker
        self.next_seq = np.zeros(workers, dtype=np.int64)  # lowest seq not yet handled
        self.live = np.ones(workers, dtype=bool)
        self._clocks = _ClockTracker(workers)  # live workers per clock, slowest live clock
        self.stats = ShardStats()
        # DC-ASGD: the params each worker pulled (only kept when compensation is on).
        self._pulled: dict[int, np.ndarray] = {}
        # BSP: the running sum of this round's pushes and who has pushed in it.
        self._round_sum: np.ndarray | None = None
        self._round_done = np.zeros(workers, dtype=bool)
        self._round_count = 0
        self._round_waiting = workers  # live workers that have not pushed in this round

    def warm_up(self) -> None:
        """Runs the optimizer once on a scratch copy so JIT compilation happens before training."""
        scratch = self.params.copy()
        state = self.optimizer.init(scratch, self.segments)
        self.optimizer.apply(np.zeros_like(scratch), state, scratch, scale=1.0)

    # -- pulls and gates -------------------------------------------------------------

    def min_clock(self) -> int:
        """Clock of the slowest live worker (0 when none is live)."""
        return self._clocks.min()

    def may_start(self, worker: int) -> bool:
        """Whether ``worker`` may start its next step under the consistency model."""
        self._check_worker(worker)
        return self.consistency.may_start(int(self.clocks[worker]), self.min_clock())

    def pull(self, worker: int | None = None, out: np.ndarray | None = None) -> int:
        """Copies the parameters into ``out`` (if given) and returns their version.

        ``worker`` None is an observer (evaluation, checkpoints): never gated, not
        tracked. Gating is the caller's job: ask :meth:`may_start` first.
        """
        if worker is not None:
            self._check_worker(worker)
        if out is not None:
            if out.shape != self.params.shape or out.dtype != self.params.dtype:
                raise ValueError(
                    f"shard {self.shard_id}: pull buffer is {out.dtype}{out.shape}, "
                    f"expected {self.params.dtype}{self.params.shape}"
                )
            np.copyto(out, self.params)
            self.stats.bytes_out += self.params.nbytes
        if worker is not None and self.staleness.dc_lambda:
            backup = self._pulled.get(worker)
            if backup is None:
                backup = self._pulled[worker] = np.empty_like(self.params)
            np.copyto(backup, self.params)
        return self.version

    # -- pushes ----------------------------------------------------------------------

    def push(
        self, header: PushHeader, payload: Any, *, refused: tuple[str, str] | None = None
    ) -> Ack:
        """Validates and handles one push; never raises for bad input, returns an Ack.

        ``refused`` is ``(kind, reason)`` when the sender already found the whole
        push bad (e.g. NaN in another shard's slice): it is rejected without
        reading the payload, but still counts as the worker's step, on every shard
        alike, so no shard applies a push another shard refused.
        """
        try:
            worker, seq, base = self._check_header(header)
        except Rejected as e:
            return self._reject(None, None, e, None)
        if seq < self.next_seq[worker]:
            self.stats.duplicates += 1
            return Ack(worker, seq, True, None, self.version, None, duplicate=True)
        tau = self.version - base
        try:
            if refused is not None:
                raise Rejected(*refused)
            self._check_payload(payload)
            if not self.staleness.accepts(tau):
                raise Rejected(
                    "too_stale",
                    f"staleness {tau} exceeds max_staleness {self.staleness.max_staleness:g}",
                )
        except Rejected as e:
            self._advance(worker, seq)
            return self._reject(worker, seq, e, tau)
        self.stats.bytes_in += payload.nbytes
        self._advance(worker, seq)
        self.stats.applied += 1
        self.stats.staleness[tau] += 1
        if self.consistency.averages_rounds:
            self._merge_into_round(payload)
        else:
            if self.staleness.dc_lambda and worker in self._pulled:
                self.staleness.compensate(payload, self.params, self._pulled[worker])
            self._step(payload, self.staleness.weight(tau))
        self._maybe_close_round()
        return Ack(worker, seq, True, None, self.version, tau)

    def leave(self, worker: int) -> None:
        """Marks a worker as gone: gates and BSP rounds stop waiting for it."""
        self._check_worker(worker)
        if self.live[worker]:
            self.live[worker] = False
            self._clocks.remove(int(self.clocks[worker]))
            if not self._round_done[worker]:
                self._round_waiting -= 1
        self._pulled.pop(worker, None)
        self._maybe_close_round()

    def join(self, worker: int) -> None:
        """Marks a worker as live again; it starts at the slowest live clock."""
        self._check_worker(worker)
        if not self.live[worker]:
            clock = self.clocks[worker] = max(int(self.clocks[worker]), self.min_clock())
            self.live[worker] = True
            self._clocks.add(clock)
            self._round_done[worker] = False
            self._round_waiting += 1

    # -- internals -------------------------------------------------------------------

    def _step(self, update: np.ndarray, scale: float) -> None:
        self.optimizer.apply(update, self.opt_state, self.params, scale=scale)
        self.version += 1
        self.stats.rounds += 1

    def _merge_into_round(self, payload: np.ndarray) -> None:
        if self._round_sum is None:
            self._round_sum = np.zeros_like(self.params)
        self._round_sum += payload
        self._round_count += 1

    def _maybe_close_round(self) -> None:
        if not self.consistency.averages_rounds:
            return
        if not self._clocks.live or self._round_waiting:
            return
        if self._round_count:
            assert self._round_sum is not None
            self._round_sum *= 1.0 / self._round_count
            self._step(self._round_sum, 1.0)
            self._round_sum.fill(0)
        self._round_done[:] = False
        self._round_count = 0
        self._round_waiting = self._clocks.live

    def _advance(self, worker: int, seq: int) -> None:
        self.next_seq[worker] = seq + 1
        if self.live[worker]:  # always, as pushes of gone workers are rejected earlier
            self._clocks.advance(int(self.clocks[worker]))
            if not self._round_done[worker]:
                self._round_waiting -= 1
        self.clocks[worker] += 1
        self._round_done[worker] = True

    def _reject(self, worker: int | None, seq: int | None, err: Rejected, tau: int | None) -> Ack:
        self.stats.rejected[err.kind] += 1
        log.warning("shard %d rejected a push from worker %s: %s", self.shard_id, worker, err)
        self._maybe_close_round()
        return Ack(
            -1 if worker is None else worker,
            -1 if seq is None else seq,
            False,
            str(err),
            self.version,
            tau,
        )

    def _check_worker(self, worker: int) -> None:
        if not (isinstance(worker, int | np.integer) and 0 <= worker < self.workers):
            raise ValueError(
                f"unknown worker {worker!r}: this job has workers 0..{self.workers - 1}"
            )

    def _check_header(self, header: Any) -> tuple[int, int, int]:
        if not isinstance(header, tuple) or len(header) != 3:
            raise Rejected(
                "malformed_header", f"expected (worker, seq, base_version), got {header!r}"
            )
        worker, seq, base = header
        if not all(isinstance(x, int | np.integer) and not isinstance(x, bool) for x in header):
            raise Rejected(
                "malformed_header", f"worker, seq and base_version must be integers, got {header!r}"
            )
        if not 0 <= worker < self.workers:
            raise Rejected("unknown_worker", f"worker {worker} is not in 0..{self.workers - 1}")
        if seq < 0:
            raise Rejected("malformed_header", f"worker {worker}: negative sequence number {seq}")
        if not 0 <= base <= self.version:
            raise Rejected(
                "malformed_header",
                f"worker {worker}: base_version {base} is not in 0..{self.version} (the shard's version)",
            )
        if not self.live[worker]:
            raise Rejected("unknown_worker", f"worker {worker} has left the job")
        return int(worker), int(seq), int(base)

    def _check_payload(self, payload: Any) -> None:
        if not isinstance(payload, np.ndarray):
            raise Rejected(
                "bad_payload", f"payload must be a numpy array, got {type(payload).__name__}"
            )
        if payload.dtype != self.params.dtype:
            raise Rejected(
                "bad_dtype", f"payload dtype {payload.dtype}, expected {self.params.dtype}"
            )
        if payload.shape != self.params.shape:
            raise Rejected(
                "bad_length",
                f"payload has shape {payload.shape}, expected ({self.params.size},) for shard {self.shard_id}",
            )
        # NaN and Inf propagate into the dot product, so a finite result proves every
        # element finite; it allocates nothing. An overflow only sends us to the exact check.
        if math.isfinite(np.dot(payload, payload)):
            return
        bad = np.flatnonzero(~np.isfinite(payload))  # slow path, only for suspicious payloads
        if bad.size:
            leaf = self._leaf_name(int(bad[0]))
            raise Rejected(
                "not_finite", f"payload has NaN or Inf (first at element {bad[0]}, leaf {leaf!r})"
            )

    def _leaf_name(self, index: int) -> str:
        i = int(np.searchsorted(self.segments.offsets, index, side="right")) - 1
        return self.segments.names[max(i, 0)] if len(self.segments) else "?"


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
        )
