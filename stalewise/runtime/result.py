"""A run's records and result, the same in every runtime: the :class:`Recorder`, how the
run ended (:func:`end_reason`), the :class:`TrainResult`, the shards' counters merged."""

from __future__ import annotations

import logging
import math
import sys
import time as _time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stalewise import targets
from stalewise.protocol.notices import warn_user
from stalewise.runtime.errors import DivergedError, Failures

log = logging.getLogger(__name__)


def mean_loss(last_losses: Any) -> float:
    """The mean of each worker's last loss over the workers that pushed (NaN: none has)."""
    seen = np.asarray(last_losses, dtype=np.float64)
    seen = seen[~np.isnan(seen)]
    return float(seen.mean()) if seen.size else math.nan


def last_metrics(records: list[dict]) -> dict[str, float]:
    """The loss and accuracy (those it has as floats) of the last of ``records``."""
    last = records[-1] if records else {}
    return {k: last[k] for k in ("loss", "accuracy") if isinstance(last.get(k), float)}


PLAIN_EVERY = 10.0  # seconds between progress lines when output is not a terminal


class Recorder:
    """A run's metrics records: builds them, shows progress, says when ``stop_at`` is reached."""

    def __init__(
        self,
        run: str,
        steps: int,
        *,
        stop_at: targets.StopAt = None,
        on_record: Callable[[dict], None] | None = None,
        progress: bool = False,
    ):
        self.run, self.steps, self.on_record = run, steps, on_record
        self.stop_at = targets.parse(stop_at)
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
            metrics = "".join(f", {k} {v:.4g}" for k, v in last_metrics(self.records).items())
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
        if "workers" in stats:  # the live workers, from a runtime whose count may change
            rec["workers"] = stats["workers"]
        if evaluate is not None:
            rec.update({k: float(v) for k, v in evaluate(params()).items()})
        else:
            rec["loss"] = train_loss
        self.records.append(rec)
        if self.on_record:
            self.on_record(rec)
        self.progress(pushes)
        if self.bar is not None:
            self.bar.set_postfix({k: f"{v:.3g}" for k, v in last_metrics([rec]).items()})
        if targets.all_reached(self.stop_at, rec):
            self.stop_reason = " and ".join(map(str, self.stop_at)) + " reached"
            return True
        return False

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


#: How a run can end (:attr:`TrainResult.ended`; all workers diverged: DivergedError).
ENDINGS = ("budget", "stop_at", "no_workers")


@dataclass
class TrainResult:
    """What :meth:`stalewise.Job.train` returns; ``ended``: one of :data:`ENDINGS`."""

    params: Any  # final parameters, in the structure and backend the job was made with
    flat: np.ndarray  # the same, as the flat vector
    records: list[dict] = field(default_factory=list)  # metrics records (see stalewise.report)
    stats: dict = field(default_factory=dict)  # shard counters merged (see merge_stats)
    time: float = 0.0  # seconds (wall clock, or virtual in the simulator)
    pushes: int = 0  # updates pushed by all workers
    failures: list[dict] = field(default_factory=list)  # what failed and what was done (Failures)
    stop_reason: str = ""  # why the run ended, in words
    ended: str = ""  # how, in one word (ENDINGS): "budget", "stop_at" or "no_workers"

    @property
    def restarts(self) -> int:
        """How many times a worker or shard was restarted during the run."""
        return sum(e["action"] == "restarted" for e in self.failures)

    def __repr__(self) -> str:
        """One line: pushes, updates, time and the last record's metrics (not the parameters)."""
        metrics = ", ".join(f"{k}={v:.4g}" for k, v in last_metrics(self.records).items())
        return (
            f"TrainResult(pushes={self.pushes}, updates={self.stats.get('version', '?')}, "
            f"time={self.time:.4g}s, {self.flat.size} parameters"
            + (f", {metrics}" if metrics else "")
            + f", {len(self.records)} records)"
        )


def merge_stats(per_shard: Sequence[Mapping[str, Any]], *, settled: bool = False) -> dict[str, Any]:
    """Merges the shards' counters: shard 0's per-push counters, bytes and duplicates summed;
    ``settled``: shards whose per-push counters differ from shard 0's are warned about."""
    if not per_shard:
        return {}
    first = per_shard[0]

    def per_push(s: Mapping[str, Any]) -> tuple:
        # a Counter compares a missing kind equal to a zero count
        return s["applied"], Counter(s.get("rejected", {}))

    if settled:
        mine = per_push(first)
        torn = [k for k, s in enumerate(per_shard) if k and per_push(s) != mine]
        if torn:
            counts = "; ".join(
                f"shard {k}: applied {a}, rejected {dict(r)}"
                for k, (a, r) in ((k, per_push(per_shard[k])) for k in (0, *torn))
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
        "duplicates": sum(s.get("duplicates", 0) for s in per_shard),
        "staleness_mean": first["staleness_mean"],
        "staleness_max": first["staleness_max"],
        "staleness_counts": dict(first.get("staleness_counts", {})),  # tau -> applied pushes
        "mode_switches": first.get("mode_switches", 0),  # hybrid consistency
        "bytes_in": sum(s["bytes_in"] for s in per_shard),
        "bytes_out": sum(s["bytes_out"] for s in per_shard),
        "shards": len(per_shard),
    }


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
) -> tuple[str, str]:
    """How and why a run ended: ``(ended, reason)``, ``ended`` one of :data:`ENDINGS` (no push
    applied or a non-finite last loss is also warned); DivergedError if all diverged."""
    if recorder.stop_reason:
        ended, reason = "stop_at", recorder.stop_reason
    elif pushes >= steps or budget_spent:
        ended, reason = "budget", f"the budget of {steps} pushes is spent"
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
        ended = "no_workers"
        reason = f"every worker failed and was dropped, after {pushes} of {steps} pushes"
        log.error("%s: %s", run, reason)
    last = recorder.records[-1] if recorder.records else {}
    bad = [k for k in ("loss", "train_loss") if isinstance(last.get(k), float)]
    bad = [k for k in bad if not math.isfinite(last[k])][:1]
    if pushes and not stats["applied"]:  # diverge_after=None lets such a run reach its end
        problem = f"no push was applied, every one was refused ({stats['rejected']})"
    elif bad:  # refusals do not catch a NaN loss whose pushes are finite, nor diverge_after=None
        problem = (
            f"the {bad[0].replace('_', ' ')} at the end is {last[bad[0]]}: training diverged "
            "(lower the learning rate or clip the gradients)"
        )
    else:
        return ended, reason
    reason += f"; {problem}"
    log.warning("%s: %s", run, reason)
    warn_user(f"{run}: {reason}")
    return ended, reason
