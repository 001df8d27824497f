"""The parameter-server shard as a state machine (no I/O, no threads).

A :class:`Shard`: a slice of the flat parameters, its optimizer state and version; every
runtime hosts it, one message at a time. Its rules: ``docs/design-notes.md`` ("Protocol").

Example:
    >>> from stalewise import optim, segments
    >>> params = np.zeros(4, np.float32)
    >>> shard = Shard(params, segments.Segments.single(4), optim.sgd(0.5), workers=2)
    >>> shard.join(0, incarnation=1)
    >>> shard.pull(worker=0)
    0
    >>> header = PushHeader(worker=0, seq=0, base_version=0, incarnation=1)
    >>> ack = shard.push(header, np.ones(4, np.float32))
    >>> ack.ok, shard.version, params.tolist()
    (True, 1, [-0.5, -0.5, -0.5, -0.5])
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from stalewise import consistency as consistency_lib
from stalewise import staleness as staleness_lib
from stalewise._lazy import Lazy
from stalewise.codecs import PayloadError
from stalewise.protocol import commit, hybrid, pushlog
from stalewise.protocol import state as state_lib
from stalewise.protocol.messages import Ack, PushHeader
from stalewise.protocol.stats import ShardStats, _ClockTracker
from stalewise.segments import Segments

log = logging.getLogger(__name__)
_kernels = Lazy("stalewise.optim._kernels")  # numba: imported at the first step


class Rejected(Exception):
    """Raised inside :meth:`Shard.push` validation; turned into a rejecting :class:`Ack`."""

    def __init__(self, kind: str, detail: str):
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


def _state_arrays(state: Any) -> list[np.ndarray]:
    """The numpy arrays of an optimizer state (a (named) tuple tree), in order."""
    if isinstance(state, np.ndarray):
        return [state]
    if isinstance(state, tuple):
        return [a for x in state for a in _state_arrays(x)]
    return []


def _ids(header: Any) -> tuple[int | None, int | None]:
    """The worker and seq of a header that failed its checks, where they are integers."""
    try:
        w, seq = header[0], header[1]
    except (TypeError, IndexError, KeyError):
        return None, None
    ok = [isinstance(x, int | np.integer) and not isinstance(x, bool) for x in (w, seq)]
    return (int(w) if ok[0] else None), (int(seq) if ok[1] else None)


class Shard:
    """One parameter-server shard: ``params``, its slice of the flat parameters (1-D float32 or
    float64, updated in place, maybe a shared-memory view) with leaf table ``segments``, for
    worker ids ``0 .. workers-1``; ``optimizer`` applies each merged push. ``decoder``: with a
    codec, the :class:`~stalewise.protocol.compress.Decoder` of its payloads (one that does not
    decode is refused as ``bad_payload``). ``clocks``, ``live``, ``counted``: read-only."""

    def __init__(
        self,
        params: np.ndarray,
        segments: Segments,
        optimizer: Any,
        *,
        workers: int,
        expected: int | None = None,
        consistency: consistency_lib.Consistency | None = None,
        staleness: staleness_lib.Staleness | None = None,
        shard_id: int = 0,
        job_segments: Segments | None = None,
        decoder: Any = None,
    ):
        if params.ndim != 1 or params.dtype not in (np.float32, np.float64):
            raise ValueError(
                f"shard params must be a 1-D float32/float64 vector, got {params.dtype}{params.shape}"
            )
        if segments.total != params.size:
            raise ValueError(f"segments cover {segments.total} elements, params have {params.size}")
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        expected = workers if expected is None else expected
        if not 0 <= expected <= workers:
            raise ValueError(f"expected must be 0..{workers} (the worker ids), got {expected}")
        self.params = params
        self.segments = segments
        self.job_segments = job_segments or segments  # the whole job's leaves, for messages
        self.decoder = decoder  # compressed pushes: payloads are bytes, decoded into _decoded
        self._decoded: np.ndarray | None = None
        # the slice is the whole push: no sender's verdict covers its values, the shard judges
        self._whole = self.job_segments.total == segments.total
        self.optimizer = optimizer
        self.opt_state = optimizer.init(params, segments)
        # a rule that checks values in its own pass over the slice (Rule.apply_checked)
        rule = getattr(optimizer.apply, "__self__", None)
        self._fused = rule if getattr(rule, "fused_checks", False) else None
        self._bounds = rule if hasattr(rule, "bound") else None  # see _bounded
        self.workers = workers
        self.consistency = consistency or consistency_lib.ASP()
        self.staleness = staleness or staleness_lib.constant()
        self.shard_id = shard_id
        self.version = 0
        self.clocks = np.zeros(workers, dtype=np.int64)  # completed pushes per worker
        self.next_seq = np.zeros(workers, dtype=np.int64)  # lowest seq not yet handled
        self.incarnation = np.zeros(workers, dtype=np.int64)  # 0: expected, never started
        self.live = np.arange(workers) < expected  # ids beyond `expected` count once joined
        # the live workers the gates count: expected ones, and joiners from their first
        # pull or push (a joiner that has not started holds no round and no bound)
        self.counted = self.live.copy()
        # a runtime whose channels outlive an incarnation (Ray): the one it hears (0: none)
        self.admitted = np.zeros(workers, dtype=np.int64)
        self.retired = np.zeros(workers, dtype=np.int64)  # the newest incarnation cut off
        # a resumed job's live workers whose next incarnation has not taken its seat yet
        self._resumed = np.zeros(workers, dtype=bool)
        self._clocks = _ClockTracker(expected)  # counted workers per clock, slowest clock
        # BSP: the round under way when the last counted worker left, where a joiner starts then
        self._floor = 0
        self.stats = ShardStats()
        # DC-ASGD: the params each worker pulled (only kept when compensation is on).
        self._pulled: dict[int, np.ndarray] = {}
        # BSP: the running sum of this round's pushes and who has pushed in it.
        self._round_sum: np.ndarray | None = None
        self._round_done = np.zeros(workers, dtype=bool)
        self._round_count = 0
        self._round_waiting = expected  # counted workers that have not pushed in this round
        # Hybrid: the current mode (synchronous rounds or asynchronous) and the workers' paces
        self.synchronous = self.consistency.kind in ("bsp", "hybrid")
        self._pace = hybrid.Pace(workers) if self.consistency.kind == "hybrid" else None
        # the step's undo copy: params and the optimizer state's arrays (see _step)
        self._undo: tuple[Any, list[np.ndarray], list[np.ndarray]] = (None, [], [])
        self._undo_fresh = False  # the undo copy holds the current values
        # a rule that bounds its step: the state they are of, its bounds (see _bounded)
        self._maxima: tuple[Any, tuple[float, ...]] | None = None
        self.journal: Any = None  # where the state's changes go (pushlog.journaled)
        self.done: np.ndarray | None = None  # where a step reports its progress (Rule.run)

    def warm_up(self) -> None:
        """Runs the optimizer on a copy of 64 params and warms the decoder: kernels compile now."""
        if self.decoder is not None:
            self.decoder.warm_up()
        scratch = self.params[:64].copy()  # the kernels are compiled per dtype, not size
        state = self.optimizer.init(scratch, self.segments.slice(0, scratch.size))
        big = np.finfo(scratch.dtype).max ** 0.25  # a gradient a clip rescales, squared finite
        self.optimizer.apply(np.full_like(scratch, big), state, scratch, scale=1.0)
        if self._bounds is not None:
            _kernels.sumsq(scratch)  # the bound's kernel (see _bounded)

    # -- pulls and gates -------------------------------------------------------------

    @property
    def hybrid(self) -> bool:
        """Whether the shard switches between synchronous and asynchronous rounds."""
        return self._pace is not None

    def min_clock(self) -> int:
        """Clock of the slowest counted worker (of the slowest live one while none is counted;
        0 when none is live); under BSP not below the round under way."""
        if self._clocks.live:
            return self._clocks.min()
        live = self.clocks[self.live]
        return max(int(live.min()) if live.size else 0, self._floor)

    def may_start(self, worker: int) -> bool:
        """Whether ``worker`` may start its next step under the consistency model
        (a joiner not counted yet: at the clock its first pull would start it at)."""
        self._check_worker(worker)
        if self._pace is not None:  # hybrid: in a synchronous round, once per worker
            return not (self.synchronous and self._round_done[worker])
        return self.consistency.may_start(self._start_clock(worker), self.min_clock())

    def _start_clock(self, worker: int) -> int:
        """The worker's clock, or for a live joiner not counted yet, the one it starts at."""
        clock = int(self.clocks[worker])
        if self.live[worker] and not self.counted[worker]:
            clock = max(clock, self.min_clock())
        return clock

    def _start(self, worker: int) -> None:
        """A live joiner's first pull or push: from now on it counts for the gates, at
        the slowest counted clock (or its own, if later), in the round under way."""
        if not self.live[worker] or self.counted[worker]:
            return
        clock = self.clocks[worker] = self._start_clock(worker)
        self.counted[worker] = True
        self._clocks.add(clock)
        if not self._round_done[worker]:
            self._round_waiting += 1

    @pushlog.journaled
    def pull(
        self, worker: int | None = None, out: np.ndarray | None = None, *, now: float | None = None
    ) -> int:
        """Copies the parameters into ``out`` (if given) and returns their version; ``worker``
        None is an observer (not tracked). Gating is :meth:`may_start`'s; ``now``: seconds."""
        if worker is not None:
            self._check_worker(worker)
            self._start(worker)
            if self._pace is not None:
                self._pace.pulled(worker, now)
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

    @pushlog.journaled
    def served(self, nbytes: int) -> None:
        """Counts ``nbytes`` sent outside :meth:`pull` (a delta pull's payload) as bytes out."""
        self.stats.bytes_out += nbytes

    # -- pushes ----------------------------------------------------------------------

    @pushlog.journaled
    def push(
        self,
        header: PushHeader,
        payload: Any,
        *,
        verdict: commit.Verdict | None = None,
        now: float | None = None,
        sumsq: float | None = None,
    ) -> Ack:
        """Validates and handles one push; never raises for bad input, returns an Ack.
        ``verdict``, when given, decides ``not_finite``, ``overflow`` and ``too_stale``; ``now``:
        the runtime's clock (s); ``sumsq``: the sender's sum of squares (None: the shard's own)."""
        try:
            worker, seq, base = self._check_header(header)
        except Rejected as e:
            return self._reject(*_ids(header), e, None)
        self._start(worker)  # a joiner's first push (or pull) makes it count for the gates
        if seq < self.next_seq[worker]:
            self.stats.duplicates += 1
            return Ack(worker, seq, True, None, self.version, None, duplicate=True)
        tau = self.version - base
        try:
            if verdict is not None and not verdict.ok:
                raise self._refusal(verdict, self.job_segments)
            payload, nbytes = self._decode(payload)  # compressed: the values it decodes to
            judge = verdict is None or self._whole
            stale = verdict is None and not self.staleness.accepts(tau)
            compensate = bool(self.staleness.dc_lambda) and worker in self._pulled
            # the step checks the payload's values itself when it is taken at once, as sent
            in_step = self._fused is not None and not (self.synchronous or stale or compensate)
            self._check_payload(payload, judge_overflow=judge, values=not in_step)
            if stale:
                raise self._refusal(commit.Verdict(commit.TOO_STALE, tau))
            if not self.synchronous:
                if compensate:
                    self.staleness.compensate(payload, self.params, self._pulled[worker])
                scale = self.staleness.weight(tau)
                if self.hybrid:  # the square-root scaling rule: see protocol/hybrid.py
                    scale /= math.sqrt(max(self._clocks.live, 1))
                sumsq = None if compensate or self.decoder is not None else sumsq
                self._step(payload, scale, judge if in_step else None, sumsq)  # or Rejected
        except Rejected as e:
            self._advance(worker, seq)
            return self._reject(worker, seq, e, tau)
        self.stats.bytes_in += nbytes  # as received: a compressed payload's length
        self._advance(worker, seq)
        self.stats.applied += 1
        self.stats.staleness[tau] += 1
        if self._pace is not None:
            self._pace.pushed(worker, now)
        if self.synchronous:  # into the round's running sum
            if self._round_sum is None:
                self._round_sum = np.zeros_like(self.params)
            self._round_sum += payload
            self._round_count += 1
        self._maybe_close_round()
        return Ack(worker, seq, True, None, self.version, tau)

    @pushlog.journaled
    def leave(self, worker: int) -> None:
        """Marks a worker as gone: gates and BSP rounds stop waiting for it."""
        self._check_worker(worker)
        self.live[worker] = False
        self._resumed[worker] = False
        if self.counted[worker]:
            self.counted[worker] = False
            if self.synchronous and self._clocks.live == 1:  # BSP: the round it left in
                self._floor = max(self._floor, self._clocks.min())
            self._clocks.remove(int(self.clocks[worker]))
            if not self._round_done[worker]:
                self._round_waiting -= 1
        self._pulled.pop(worker, None)
        self._maybe_close_round()

    @pushlog.journaled
    def join(self, worker: int, incarnation: int) -> None:
        """Starts ``worker``'s ``incarnation`` at seq 0 (ValueError: not newer than its current)."""
        self._check_worker(worker)
        if not (
            isinstance(incarnation, int | np.integer) and incarnation > self.incarnation[worker]
        ):
            raise ValueError(
                f"worker {worker}: incarnation {incarnation!r} is not newer than "
                f"{int(self.incarnation[worker])}"
            )
        # an expected worker's first incarnation, or a resumed one, takes the seat held for it
        seat = bool(
            (self._resumed[worker] or not self.incarnation[worker]) and self.counted[worker]
        )
        self._resumed[worker] = False
        if self.live[worker] and not seat:
            self.leave(worker)
        self.incarnation[worker] = incarnation
        self.next_seq[worker] = 0
        self._pulled.pop(worker, None)  # DC-ASGD: an old incarnation's pull is not this one's
        if self._pace is not None:
            self._pace.forget(worker)
        if seat:  # its clock, and its push in the round under way (or the one it owes)
            return
        clock = self.clocks[worker] = max(int(self.clocks[worker]), self.min_clock())
        self.live[worker] = True
        self._round_done[worker] = False
        if clock == 0:  # a client counting from 0 itself
            self._start(worker)

    @pushlog.journaled
    def resume(self) -> None:
        """Marks the loaded state as a stopped job's: each counted worker's next incarnation
        takes its saved seat (clock and BSP round) without departing it first."""
        np.copyto(self._resumed, self.live)
        if self._pace is not None:
            self._pace.load(self._pace.state())

    def unresumed(self, keep: Any = ()) -> list[int]:
        """The workers seated here that are not a resumed job's nor in ``keep``: after a
        restart from a log, the dead process's workers, which depart (:meth:`depart`)."""
        seated = np.flatnonzero(self.live & ~self._resumed & (self.incarnation > 0))
        return [int(w) for w in seated if w not in keep]

    def seated(self, worker: int, incarnation: int) -> bool:
        """Whether a connection of ``incarnation`` takes ``worker``'s seat here as it is,
        without :meth:`join` (a restarted shard's kept seat); ValueError: that seat has left."""
        if incarnation == self.incarnation[worker] and not self.live[worker]:
            raise ValueError(f"worker {worker} (incarnation {incarnation}) has left the job")
        return bool(incarnation <= self.incarnation[worker])

    @pushlog.journaled
    def admit(self, worker: int, incarnation: int) -> None:
        """:meth:`join`; then only this incarnation of ``worker`` is heard (:meth:`dropped`)."""
        self.join(worker, incarnation)
        self.retire(worker)
        self.admitted[worker] = incarnation

    @pushlog.journaled
    def retire(self, worker: int, incarnation: int | None = None) -> None:
        """Cuts ``worker``'s admitted incarnation off (if it is ``incarnation``, when given):
        nothing it sends is handled from now on, though it stays live until it departs."""
        if self.admitted[worker] and incarnation in (None, self.admitted[worker]):
            self.retired[worker] = max(self.retired[worker], self.admitted[worker])
            self.admitted[worker] = 0

    def may_serve(self, worker: int, incarnation: int, pushed: int = 0) -> bool:
        """Whether a pull of ``worker``'s admitted ``incarnation`` may be answered now."""
        return bool(
            self.admitted[worker] == incarnation
            and self.live[worker]
            and (not self.consistency.gated or self.next_seq[worker] >= pushed)
            and self.may_start(worker)
        )

    def dropped(self, worker: int, incarnation: int) -> int | None:
        """Why the runtime drops what ``worker``'s ``incarnation`` sends: the newer incarnation
        admitted since, 0 (it was cut off), or None (admitted, or not yet: wait)."""
        if self.admitted[worker] > incarnation:
            return int(self.admitted[worker])
        return 0 if self.retired[worker] >= incarnation else None

    def handled(self, worker: int, incarnation: int) -> int | None:
        """The pushes of ``worker``'s ``incarnation`` handled here (None: it knows another one)."""
        if self.incarnation[worker] != incarnation:
            return None
        return int(self.next_seq[worker])

    @pushlog.journaled
    def depart(
        self,
        worker: int,
        incarnation: int,
        committed: tuple[PushHeader, Any, commit.Verdict] | None = None,
    ) -> Ack | None:
        """The connection of ``worker``'s ``incarnation`` is gone: its ``committed`` push not yet
        handled is delivered first (returning its ack), then it leaves unless a newer one joined."""
        self._check_worker(worker)
        if incarnation != self.incarnation[worker]:
            return None
        ack = None if committed is None else self.deliver(worker, incarnation, committed)
        self.leave(worker)
        return ack

    @pushlog.journaled
    def deliver(
        self, worker: int, incarnation: int, committed: tuple[PushHeader, Any, commit.Verdict]
    ) -> Ack | None:
        """Handles ``committed`` (as in :meth:`depart`) if it is the next push of
        ``worker``'s live ``incarnation``; returns its ack (None: not handled)."""
        header, payload, verdict = committed
        if (
            incarnation == header.incarnation == self.incarnation[worker]
            and self.live[worker]
            and header.seq == self.next_seq[worker]
        ):
            return self.push(header, payload, verdict=verdict)
        return None

    @pushlog.journaled
    def expire_unstarted(self) -> list[int]:
        """Drops the expected workers (and resumed seats) that never joined; returns their ids."""
        gone = [
            w
            for w in range(self.workers)
            if self.live[w] and (self.incarnation[w] == 0 or self._resumed[w])
        ]
        for w in gone:
            self.leave(w)
        return gone

    # -- checkpoints -----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly where this shard is (see :func:`state.save`)."""
        return state_lib.save(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores a :meth:`state_dict` in place, after checking all of it (:func:`state.load`)."""
        state_lib.load(self, state)
        self._undo_fresh = False

    def prepare(self, undo: bool = False) -> None:
        """Copies the params and optimizer state a step may have to be undone from or, for a
        rule that bounds its step (unless ``undo``), measures what bounds it (:meth:`_bounded`)."""
        if self._bounds is not None and not undo:
            if self._maxima is None or self._maxima[0] is not self.opt_state:
                self._maxima = (self.opt_state, self._bounds.maxima(self.opt_state, self.params))
        elif not self._undo_fresh:
            arrays, undo = self._undo_buffers()
            for a, copy in zip(arrays, undo, strict=True):
                np.copyto(copy, a)
            self._undo_fresh = True

    # -- internals -------------------------------------------------------------------

    def _step(self, update, scale: float, judge: bool | None = None, sumsq=None) -> None:
        """One optimizer step, or none: a step that makes a value non-finite is undone, bit for
        bit, and raises Rejected("overflow"). ``judge``: judge the update's values in the pass."""
        if self._bounded(update, scale, judge, sumsq):
            if self._fused is not None:
                self._fused.run(update, self.opt_state, self.params, scale, True, done=self.done)
            else:
                self.optimizer.apply(update, self.opt_state, self.params, scale=scale)
            self._undo_fresh = False
            self.version += 1
            self.stats.rounds += 1
            return
        arrays, undo = self._undo_buffers()
        err = None
        if self._fused is None:
            self.prepare(undo=True)
            self._undo_fresh = False
            self.optimizer.apply(update, self.opt_state, self.params, scale=scale)
            written_ok = False
        else:
            copies = None if self._undo_fresh else self._copy_unwritten(arrays, undo)
            self._undo_fresh = False
            sq, written = self._fused.apply_checked(
                update, self.opt_state, self.params, scale=scale, undo=copies, done=self.done
            )
            written_ok = math.isfinite(written)
            if judge is not None and not math.isfinite(sq):  # exact, on the untouched payload
                err = self._values_refusal(update, judge_overflow=judge)
        bad = None
        if err is None and not written_ok:
            bad = next(
                (i for i, a in enumerate(arrays) if commit.first_non_finite(a) is not None), None
            )
        if bad is not None:
            what = self._describe_non_finite(arrays, bad)
            msg = f"the step would make {what} non-finite on shard {self.shard_id}; not taken"
            err = Rejected("overflow", msg)
        if err is not None:
            for a, copy in zip(arrays, undo, strict=True):
                np.copyto(a, copy)
            self._undo_fresh = True
            raise err
        self.version += 1
        self.stats.rounds += 1

    def _bounded(self, update, scale: float, judge: bool | None, sumsq=None) -> bool:
        """Whether the step provably stays finite (no undo copy needed), from the update's
        norm (``sumsq``: its square, if measured) and the rule's bounds (``maxima``)."""
        if (rule := self._bounds) is None:
            return False
        self.prepare()  # the bounds, unless known
        g = math.sqrt(_kernels.sumsq(update) if sumsq is None else sumsq)  # >= any magnitude
        limit = float(np.finfo(self.params.dtype).max) / 4  # room for the roundings
        maxima = rule.bound(self.opt_state, scale, g, self._maxima[1])
        if (judge and not g * g < limit) or not all(m < limit for m in maxima):
            self._maxima = None
            return False
        self._maxima = (self.opt_state, maxima)
        return True

    def _copy_unwritten(self, arrays: list[np.ndarray], undo: list[np.ndarray]) -> tuple:
        """Copies the arrays a checked step does not write; returns copies of those it writes."""
        written = self._fused.written(self.opt_state, self.params)
        for a, copy in zip(arrays, undo, strict=True):
            if not any(a is w for w in written):
                np.copyto(copy, a)
        return tuple(next(c for a, c in zip(arrays, undo, strict=True) if a is w) for w in written)

    def _undo_buffers(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The arrays a step changes (params, then the optimizer state's) and their undo copies."""
        state, arrays, undo = self._undo
        if state is not self.opt_state:  # first step, or a checkpoint replaced the state
            arrays = [self.params, *_state_arrays(self.opt_state)]
            undo = [np.empty_like(a) for a in arrays]
            self._undo, self._undo_fresh = (self.opt_state, arrays, undo), False
        return arrays, undo

    def _describe_non_finite(self, arrays: list[np.ndarray], i: int) -> str:
        """Names the first non-finite value of ``arrays[i]`` (0: the params) for a refusal."""
        if i == 0:
            first = int(np.flatnonzero(~np.isfinite(self.params))[0])
            return f"parameter {first} (leaf {commit.leaf_name(self.segments, first)!r})"
        keys = state_lib._flatten_state(self.opt_state)[1]
        name = next((k.removeprefix("opt.") for k, a in keys.items() if a is arrays[i]), "?")
        return f"the optimizer state {name!r}"

    def _maybe_close_round(self) -> None:
        """Applies the round's mean once no live worker owes a push to it (or the last one
        left); under the hybrid model also decides the next round's mode."""
        if not self.synchronous and self._pace is None:
            return
        if self._clocks.live and self._round_waiting:
            return
        if not self._clocks.live and not self._round_count:
            return
        if self._round_count:
            assert self._round_sum is not None
            self._round_sum *= 1.0 / self._round_count
            try:
                self._step(self._round_sum, 1.0)
            except Rejected as e:  # its pushes were acknowledged when merged: say so here
                k, n = self.shard_id, self._round_count
                log.warning("shard %d: a BSP round of %d pushes is dropped: %s", k, n, e)
                self.stats.applied -= self._round_count
                self.stats.rejected[e.kind] += self._round_count
            self._round_sum.fill(0)
        self._round_done[:] = False
        self._round_count = 0
        self._round_waiting = self._clocks.live
        if self._pace is None:
            return
        synchronous = self._pace.decide(self.synchronous, self.counted, self.consistency.tolerance)
        if synchronous != self.synchronous:  # hybrid: the next round's mode changes
            why = ("workers keep pace: synchronous rounds" if synchronous
                   else "a straggler: asynchronous updates")  # fmt: skip
            paces = np.round(self._pace.pace, 4).tolist()
            log.info("shard %d: %s (worker paces %s s)", self.shard_id, why, paces)
            self.stats.mode_switches += 1
        self.synchronous = synchronous

    def _advance(self, worker: int, seq: int) -> None:
        self.next_seq[worker] = seq + 1
        if self.counted[worker]:  # always: a gone worker's push is refused, a joiner's starts it
            self._clocks.advance(int(self.clocks[worker]))
            if not self._round_done[worker]:
                self._round_waiting -= 1
        self.clocks[worker] += 1
        self._round_done[worker] = True

    def _reject(self, worker: int | None, seq: int | None, err: Rejected, tau: int | None) -> Ack:
        self.stats.rejected[err.kind] += 1
        # the sender's worker loop reports refusals to the user; here only for debugging
        log.debug("shard %d rejected a push from worker %s: %s", self.shard_id, worker, err)
        self._maybe_close_round()
        w, s = -1 if worker is None else worker, -1 if seq is None else seq
        return Ack(w, s, False, str(err), self.version, tau, kind=err.kind)

    def _check_worker(self, worker: int) -> None:
        if not (isinstance(worker, int | np.integer) and 0 <= worker < self.workers):
            raise ValueError(
                f"unknown worker {worker!r}: this job has workers 0..{self.workers - 1}"
            )

    def _check_header(self, header: Any) -> tuple[int, int, int]:
        if not isinstance(header, tuple) or len(header) != 4:
            raise Rejected(
                "malformed_header",
                f"expected (worker, seq, base_version, incarnation), got {header!r}",
            )
        worker, seq, base, inc = header
        if not all(isinstance(x, int | np.integer) and not isinstance(x, bool) for x in header):
            raise Rejected(
                "malformed_header",
                f"worker, seq, base_version and incarnation must be integers, got {header!r}",
            )
        if not 0 <= worker < self.workers:
            raise Rejected("unknown_worker", f"worker {worker} is not in 0..{self.workers - 1}")
        if not self.incarnation[worker]:
            raise Rejected("unknown_incarnation", f"worker {worker} has not joined")
        if inc != self.incarnation[worker]:
            raise Rejected(
                "stale_incarnation" if inc < self.incarnation[worker] else "unknown_incarnation",
                f"worker {worker}: push from incarnation {inc}, the current one is "
                f"{int(self.incarnation[worker])}",
            )
        if not self.live[worker]:
            raise Rejected("unknown_worker", f"worker {worker} has left the job")
        if seq < 0:
            raise Rejected("malformed_header", f"worker {worker}: negative sequence number {seq}")
        if seq > self.next_seq[worker]:
            raise Rejected(
                "seq_gap",
                f"worker {worker}: push {seq} arrived before "
                f"{'push 0' if not self.next_seq[worker] else f'pushes {int(self.next_seq[worker])}..{seq - 1}'}",
            )
        if not 0 <= base <= self.version:
            raise Rejected(
                "malformed_header",
                f"worker {worker}: base_version {base} is not in 0..{self.version} (the shard's version)",
            )
        return int(worker), int(seq), int(base)

    def _decode(self, payload: Any) -> tuple[Any, int]:
        """A push's values and size as received (decoded into a kept buffer with a decoder);
        Rejected("bad_payload"): a compressed payload that does not decode."""
        if self.decoder is None:
            return payload, getattr(payload, "nbytes", 0)
        if self._decoded is None:
            self._decoded = np.empty_like(self.params)
        try:
            values = self.decoder.decode(payload, self._decoded)
        except PayloadError as e:  # corrupt, truncated, foreign, or not bytes at all
            raise Rejected("bad_payload", str(e)) from None
        return values, self.decoder.length(payload)

    def _check_payload(self, payload: Any, *, judge_overflow: bool, values: bool = True) -> None:
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
        if values:  # else the step checks them (_step)
            err = self._values_refusal(payload, judge_overflow=judge_overflow)
            if err is not None:
                raise err

    def _values_refusal(self, payload: np.ndarray, *, judge_overflow: bool) -> Rejected | None:
        """The refusal a payload's values earn, if any (overflow only when no sender judged it)."""
        verdict = commit.check_values(payload)
        if verdict.code == commit.NOT_FINITE or (
            verdict.code == commit.OVERFLOW and judge_overflow
        ):
            return self._refusal(verdict, self.segments)  # named by the slice's leaves
        return None

    def _refusal(self, verdict: commit.Verdict, segments: Segments | None = None) -> Rejected:
        """The refusal a verdict stands for, worded once (:meth:`commit.Verdict.message`)."""
        return Rejected(
            verdict.kind or "bad_verdict", verdict.message(segments, self.staleness.max_staleness)
        )
