"""What every runtime shares: the training result, worker errors, straggler settings."""

from __future__ import annotations

import itertools
import logging
import math
import sys
import time as _time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stalewise import targets

log = logging.getLogger(__name__)


def batch_iterator(data: Any, worker: int, workers: int, drawn: Any = None) -> Iterator[Any]:
    """A worker's batches: ``data(worker, workers)`` if callable, else ``data[worker]`` cycled.

    ``drawn``: the count of batches each worker id has drawn (anything indexed by
    worker id). The stream then skips ``drawn[worker]`` batches and adds one to it
    for each batch it yields. Every runtime continues a worker id's stream this
    way: a new incarnation (a restart, a resumed run) starts a new stream and skips
    what its worker id has drawn, including a batch it died on, so a batch that
    makes the user's code raise is not drawn again.
    """
    batches = iter(data(worker, workers)) if callable(data) else itertools.cycle(data[worker])
    if drawn is None:
        return batches
    if drawn[worker]:
        next(itertools.islice(batches, int(drawn[worker]) - 1, None), None)  # skips exactly that
    return _counting(batches, drawn, worker)


def _counting(batches: Iterator[Any], drawn: Any, worker: int) -> Iterator[Any]:
    for batch in batches:
        drawn[worker] += 1
        yield batch


def mean_loss(last_losses: Any) -> float:
    """The train loss of a record: the mean of each worker's last loss, over workers that pushed.

    A worker that has not pushed yet has NaN there and does not count (as 0 it
    would pull the mean down); NaN when no worker has pushed.
    """
    seen = np.asarray(last_losses, dtype=np.float64)
    seen = seen[~np.isnan(seen)]
    return float(seen.mean()) if seen.size else math.nan


class WorkerError(RuntimeError):
    """A worker failed and the job's failure policy stopped the job.

    User code raised (the message carries the worker's traceback), or the
    worker's process died or hung (the message says how); the worker is named.
    """


class ShardError(RuntimeError):
    """A shard's process died and the job could not go on; the message names the shard."""


class DivergedError(RuntimeError):
    """Training diverged: every worker stopped because its pushes kept being refused."""


class FailureWarning(UserWarning):
    """Something failed during a run and changed its result (a worker or shard restarted,
    updates lost, a checkpoint not written); the event is also in ``TrainResult.failures``."""


FAILURE_POLICIES = ("restart", "drop", "fail")


class Failures:
    """A job's failure policy, and the log of what it did (``TrainResult.failures``).

    ``policy`` says what happens to a worker that fails (its process dies, it
    hangs, or user code raises):

    * ``"restart"``: it starts again as a new incarnation at the current
      parameters, up to ``max_restarts`` times per worker id (None: no limit);
      one more failure stops the job with :class:`WorkerError`;
    * ``"drop"``: it leaves; the others carry on;
    * ``"fail"``: the job stops with :class:`WorkerError`.

    A shard that fails is restarted under ``"restart"`` and ``"drop"`` (up to
    ``max_restarts`` times per shard) and stops the job under ``"fail"``
    (:class:`ShardError`). A worker that diverged is never restarted. Every
    event is logged as a warning and kept in :attr:`events`. ``hint`` ends the
    message of an error that stops the job (e.g. how to resume it).

    Example:
        >>> f = Failures("restart", max_restarts=1)
        >>> f.worker(2, "killed by SIGKILL", time=1.5)
        'restart'
        >>> f.worker(2, "killed by SIGKILL", time=2.0)
        Traceback (most recent call last):
        stalewise.runtime.base.WorkerError: worker 2 failed 2 times, more than max_restarts=1 allows; the last time: killed by SIGKILL
        >>> f.restarts, [e["action"] for e in f.events]
        (1, ['restarted', 'failed'])
    """

    def __init__(self, policy: str = "restart", max_restarts: int | None = 3, *, hint: str = ""):
        if policy not in FAILURE_POLICIES:
            raise ValueError(
                f"on_worker_failure must be one of {', '.join(map(repr, FAILURE_POLICIES))}, "
                f"got {policy!r}"
            )
        self.policy, self.max_restarts, self.hint = policy, max_restarts, hint
        self.events: list[dict[str, Any]] = []
        self._restarts: Counter = Counter()  # ("worker" | "shard", id) -> restarts so far

    @property
    def restarts(self) -> int:
        """Restarts so far, of workers and shards."""
        return sum(self._restarts.values())

    def _event(self, kind: str, i: int, cause: str, time: float, action: str) -> None:
        self.events.append({kind: i, "time": time, "cause": cause, "action": action})

    def _budget_left(self, key: tuple[str, int]) -> bool:
        return self.max_restarts is None or self._restarts[key] < self.max_restarts

    def _fatal(self, what: str, cause: str, key: tuple[str, int], detail: str) -> str:
        n = self._restarts[key] + 1
        head = (
            f"{what} failed: {cause}"
            if self.policy == "fail"
            else f"{what} failed {'once' if n == 1 else f'{n} times'}, more than "
            f"max_restarts={self.max_restarts} allows; the last time: {cause}"
        )
        return head + (f"\n{detail.rstrip()}" if detail else "") + self.hint

    def worker(self, w: int, cause: str, *, time: float, detail: str = "") -> str:
        """Worker ``w`` failed (``cause``: how; ``detail``: its traceback, if any).

        Returns ``"restart"`` or ``"drop"``; raises :class:`WorkerError` when the
        policy is ``"fail"`` or the restart budget is spent.
        """
        key = ("worker", w)
        if self.policy == "fail" or (self.policy == "restart" and not self._budget_left(key)):
            self._event("worker", w, cause, time, "failed")
            raise WorkerError(self._fatal(f"worker {w}", cause, key, detail))
        if self.policy == "drop":
            self._event("worker", w, cause, time, "dropped")
            log.warning("worker %d failed (%s); dropped, the other workers carry on", w, cause)
            return "drop"
        self._restarts[key] += 1
        self._event("worker", w, cause, time, "restarted")
        log.warning(
            "worker %d failed (%s); restarting it (restart %d%s)",
            w,
            cause,
            self._restarts[key],
            "" if self.max_restarts is None else f" of {self.max_restarts}",
        )
        return "restart"

    def shard(self, k: int, cause: str, *, time: float) -> None:
        """Shard ``k`` failed: returns if it is to be restarted, else raises :class:`ShardError`."""
        key = ("shard", k)
        if self.policy == "fail" or not self._budget_left(key):
            self._event("shard", k, cause, time, "failed")
            raise ShardError(self._fatal(f"shard {k}", cause, key, ""))
        self._restarts[key] += 1
        self._event("shard", k, cause, time, "restarted")
        log.warning("shard %d failed (%s); restarting it", k, cause)

    def diverged(self, w: int, message: str, *, time: float) -> None:
        """Worker ``w`` stopped because its pushes kept being refused; it is not restarted."""
        self._event("worker", w, message, time, "diverged")
        log.warning("worker %d diverged and stopped: %s", w, message)


@dataclass
class TrainResult:
    """What :meth:`stalewise.Job.train` returns."""

    params: Any  # final parameters, in the structure and backend the job was made with
    flat: np.ndarray  # the same, as the flat vector
    records: list[dict] = field(default_factory=list)  # metrics records (see stalewise.report)
    stats: dict = field(default_factory=dict)  # shard counters merged (see merge_stats)
    time: float = 0.0  # seconds (wall clock, or virtual in the simulator)
    pushes: int = 0  # updates pushed by all workers
    failures: list[dict] = field(default_factory=list)  # what failed and what was done (Failures)
    stop_reason: str = ""  # why the run ended

    @property
    def restarts(self) -> int:
        """How many times a worker or shard was restarted during the run."""
        return sum(e["action"] == "restarted" for e in self.failures)

    def __repr__(self) -> str:
        """One line: pushes, updates, time and the last record's metrics (not the parameters)."""
        last = self.records[-1] if self.records else {}
        metrics = ", ".join(
            f"{k}={last[k]:.4g}" for k in ("loss", "accuracy") if isinstance(last.get(k), float)
        )
        return (
            f"TrainResult(pushes={self.pushes}, updates={self.stats.get('version', '?')}, "
            f"time={self.time:.4g}s, {self.flat.size} parameters"
            + (f", {metrics}" if metrics else "")
            + f", {len(self.records)} records)"
        )


def merge_stats(per_shard: Sequence[Mapping[str, Any]], *, settled: bool = False) -> dict[str, Any]:
    """Merges the shards' counters: per-push counters from shard 0, bytes summed.

    Under the commit rule (:mod:`stalewise.protocol.commit`) a push is applied
    by every shard or by none, so the per-push counters (``applied``,
    ``rejected`` by kind, ``duplicates``) are the same on every shard and are
    taken from shard 0, as are the version and the staleness; a push refused
    for NaN counts once, not once per shard. Bytes are per shard and add up.

    Mid-run, a push may have reached some shards and not yet the others, so
    their counters may differ for a moment. ``settled=True`` says no push is in
    flight (the run is over): then shards whose per-push counters differ from
    shard 0's are named in a warning, as that would be a torn push (a bug).

    Example:
        >>> s = {"applied": 3, "rejected": {"not_finite": 1}, "duplicates": 0,
        ...      "staleness_mean": 0.5, "staleness_max": 1, "bytes_in": 8, "bytes_out": 4}
        >>> m = merge_stats([s, s], settled=True)
        >>> m["applied"], m["rejected"], m["bytes_in"], m["shards"]
        (3, {'not_finite': 1}, 16, 2)
    """
    if not per_shard:
        return {}
    first = per_shard[0]

    def per_push(s: Mapping[str, Any]) -> tuple:
        # a Counter compares a missing kind equal to a zero count
        return s["applied"], Counter(s.get("rejected", {})), s.get("duplicates", 0)

    if settled:
        mine = per_push(first)
        torn = [k for k, s in enumerate(per_shard) if k and per_push(s) != mine]
        if torn:
            counts = "; ".join(
                f"shard {k}: applied {a}, rejected {dict(r)}, duplicates {d}"
                for k, (a, r, d) in ((k, per_push(per_shard[k])) for k in (0, *torn))
            )
            log.warning(
                "shard(s) %s disagree with shard 0 on the per-push counters, which the "
                "commit rule keeps equal (a torn push?): %s",
                ", ".join(map(str, torn)),
                counts,
            )
    return {
        "applied": first["applied"],
        "version": first.get("version", first.get("rounds", 0)),
        "rejected": dict(first.get("rejected", {})),
        "duplicates": first.get("duplicates", 0),
        "staleness_mean": first["staleness_mean"],
        "staleness_max": first["staleness_max"],
        "staleness_counts": dict(first.get("staleness_counts", {})),  # tau -> applied pushes
        "mode_switches": first.get("mode_switches", 0),  # hybrid consistency
        "bytes_in": sum(s["bytes_in"] for s in per_shard),
        "bytes_out": sum(s["bytes_out"] for s in per_shard),
        "shards": len(per_shard),
    }


def slowdowns(
    stragglers: Mapping[int, float] | Sequence[float] | None, workers: int
) -> list[float]:
    """Normalises a straggler setting to one slowdown factor (>= 1) per worker.

    ``{3: 4.0}`` makes worker 3 four times slower; a list gives every worker's factor.
    """
    factors = [1.0] * workers
    if stragglers is None:
        return factors
    items = stragglers.items() if isinstance(stragglers, Mapping) else enumerate(stragglers)
    if not isinstance(stragglers, Mapping) and len(stragglers) != workers:
        raise ValueError(f"stragglers lists {len(stragglers)} factors for {workers} workers")
    for w, f in items:
        if not (isinstance(w, int) and 0 <= w < workers):
            raise ValueError(f"stragglers: unknown worker {w!r} (workers are 0..{workers - 1})")
        if not (isinstance(f, int | float) and f >= 1):
            raise ValueError(f"stragglers[{w}]: slowdown factor must be a number >= 1, got {f!r}")
        factors[w] = float(f)
    return factors


def check_run(
    workers: Any, steps: Any, data: Any, stragglers: Any, delays: Mapping[int, float] | None
) -> tuple[list[float], list[float]]:
    """Checks the arguments every runtime's ``train`` shares.

    Returns:
        ``(slowdown factor per worker, extra delay in seconds per worker)``.
    """
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    if not callable(data) and len(data) != workers:
        raise ValueError(f"data has {len(data)} per-worker shards for {workers} workers")
    extra = [0.0] * workers
    for w, d in (delays or {}).items():
        if not (isinstance(w, int) and 0 <= w < workers) or not (
            isinstance(d, int | float) and d >= 0
        ):
            raise ValueError(
                f"delays[{w!r}] = {d!r}: need a worker id in 0..{workers - 1} and seconds >= 0"
            )
        extra[w] = float(d)
    return slowdowns(stragglers, workers), extra


PLAIN_EVERY = 10.0  # seconds between progress lines when output is not a terminal


def end_reason(
    recorder: Recorder,
    failures: Failures,
    *,
    pushes: int,
    steps: int,
    budget_spent: bool,
    diverged: Sequence[int],
    stats: dict,
    version: int | None = None,
    run: str = "",
) -> str:
    """Why a run ended, in every runtime.

    The recorder's reason (``stop_at`` reached, a stop), else the budget of
    ``steps`` pushes (``budget_spent``: a worker's loop ended with it), else, when
    no worker is left: :class:`DivergedError` if some diverged (the last cause in
    ``failures``), or every worker failed and was dropped. A run that pushed but
    had no push applied (the merged shard ``stats``) says so, with a warning: it
    is not a silent success.
    """
    if recorder.stop_reason:
        reason = recorder.stop_reason
    elif pushes >= steps or budget_spent:
        reason = f"the budget of {steps} pushes is spent"
    elif diverged:
        last = next(e["cause"] for e in reversed(failures.events) if e["action"] == "diverged")
        at = f" (version {version})" if version is not None else ""
        raise DivergedError(
            f"training diverged: worker(s) {', '.join(map(str, sorted(diverged)))} stopped because "
            f"their pushes kept being refused ({last}); no worker is left, after {pushes} of "
            f"{steps} pushes. The parameters are unchanged by refused pushes{at}; lower the "
            "learning rate or clip the gradients."
        )
    else:
        reason = f"every worker failed and was dropped, after {pushes} of {steps} pushes"
        log.error("%s: %s", run, reason)
    if pushes and not stats["applied"]:  # diverge_after=None lets such a run reach its end
        reason += f"; no push was applied, every one was refused ({stats['rejected']})"
        log.warning("%s: %s", run, reason)
    return reason


class Recorder:
    """A run's metrics records: builds them, shows progress, says when to stop.

    Every runtime records the same schema (see :mod:`stalewise.report`), so a
    simulated run and a real one of the same job compare line by line.

    ``stop_at`` is anything :func:`stalewise.targets.parse` accepts; the run stops
    at the first record that reaches every target. A runtime calls
    :meth:`finish` with why the run ended, which the progress output says.
    Progress is a tqdm bar on a terminal, and one plain line every
    ``PLAIN_EVERY`` seconds otherwise (logs are not flooded with redraws).

    Example:
        >>> r = Recorder("run", 10, stop_at={"loss": 1e-3})
        >>> stats = {"version": 1, "staleness_mean": 0.0, "staleness_max": 0}
        >>> r.record(0.1, 1, stats, 0.5, None, dict), r.record(0.2, 2, stats, 1e-4, None, dict)
        (False, True)
    """

    def __init__(
        self,
        run: str,
        steps: int,
        *,
        stop_at: targets.StopAt = None,
        on_record: Callable[[dict], None] | None = None,
        progress: bool = False,
    ):
        self.run = run
        self.steps = steps
        self.stop_at = targets.parse(stop_at)
        self.on_record = on_record
        self.records: list[dict] = []
        self.stop_reason: str | None = None  # set when stop_at is reached
        self.bar = None
        self.plain = progress and not sys.stderr.isatty()  # one line now and then, no bar
        self._printed_at = -math.inf
        self._pushes = 0
        if progress and not self.plain:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=steps, desc=run, unit="push", leave=True)

    def progress(self, pushes: int) -> None:
        self._pushes = pushes
        if self.bar is not None:
            self.bar.update(min(pushes, self.steps) - self.bar.n)
        elif self.plain and _time.monotonic() - self._printed_at >= PLAIN_EVERY:
            self._printed_at = _time.monotonic()
            last = self.records[-1] if self.records else {}
            metrics = "".join(
                f", {k} {last[k]:.4g}"
                for k in ("loss", "accuracy")
                if isinstance(last.get(k), float)
            )
            print(f"{self.run}: {pushes}/{self.steps} pushes{metrics}", file=sys.stderr, flush=True)

    def finish(self, reason: str) -> None:
        """Says why the run ended (after the last record), on the progress output and the log."""
        line = f"{self.run}: stopped after {self._pushes} pushes: {reason}"
        log.info("%s", line)
        if self.bar is not None:
            self.bar.close()
            self.bar.write(line, file=sys.stderr)
        elif self.plain:
            print(line, file=sys.stderr, flush=True)

    def record(
        self,
        time: float,
        pushes: int,
        stats: Mapping[str, Any],
        train_loss: float,
        evaluate: Callable[[Any], Mapping[str, float]] | None,
        params: Callable[[], Any],
    ) -> bool:
        """Makes and keeps one record; returns True when ``stop_at`` is reached."""
        rec: dict[str, Any] = {
            "run": self.run,
            "time": time,
            "updates": stats["version"],
            "pushes": pushes,
            "train_loss": train_loss,
            "staleness_mean": stats["staleness_mean"],
            "staleness_max": stats["staleness_max"],
        }
        if evaluate is not None:
            rec.update({k: float(v) for k, v in evaluate(params()).items()})
        else:
            rec["loss"] = train_loss
        self.records.append(rec)
        if self.on_record:
            self.on_record(rec)
        self.progress(pushes)
        if self.bar is not None:
            self.bar.set_postfix({k: f"{rec[k]:.3g}" for k in ("loss", "accuracy") if k in rec})
        if targets.all_reached(self.stop_at, rec):
            self.stop_reason = " and ".join(map(str, self.stop_at)) + " reached"
            return True
        return False

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
