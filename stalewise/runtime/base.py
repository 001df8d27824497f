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


def batch_iterator(data: Any, worker: int, workers: int) -> Iterator[Any]:
    """A worker's batches: ``data(worker, workers)`` if callable, else ``data[worker]`` cycled."""
    if callable(data):
        return iter(data(worker, workers))
    return itertools.cycle(data[worker])


def mean_loss(last_losses: Any) -> float:
    """The train loss of a record: the mean of each worker's last loss, over workers that pushed.

    A worker that has not pushed yet has NaN there and does not count (as 0 it
    would pull the mean down); NaN when no worker has pushed.
    """
    seen = np.asarray(last_losses, dtype=np.float64)
    seen = seen[~np.isnan(seen)]
    return float(seen.mean()) if seen.size else math.nan


class WorkerError(RuntimeError):
    """User code raised inside a worker; the message carries the worker's traceback."""


@dataclass
class TrainResult:
    """What :meth:`stalewise.Job.train` returns."""

    params: Any  # final parameters, in the structure and backend the job was made with
    flat: np.ndarray  # the same, as the flat vector
    records: list[dict] = field(default_factory=list)  # metrics records (see stalewise.report)
    stats: dict = field(default_factory=dict)  # shard counters merged (see merge_stats)
    time: float = 0.0  # seconds (wall clock, or virtual in the simulator)
    pushes: int = 0  # updates pushed by all workers

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
